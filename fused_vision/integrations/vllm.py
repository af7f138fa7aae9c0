"""fused_vision inside vLLM's Gemma 4: its plugin, the planner's chunks and an out-of-memory guard.

    FUSED_VISION_VLLM=1 vllm serve ...     # the plugin patches every process vLLM starts
    apply_fused_vision_to_vllm_gemma4()     # or the same patch, in the process that builds the model

vLLM builds transformers' own tower, which ``apply_fused_vision_to_vllm_gemma4`` fuses as
``fused_vision.integrations.transformers`` does. Patched here too, vLLM's model sizes the tower's chunks by
``fused_vision.pipeline.planner.plan`` rather than by the one-hot's price, runs an encoding call again at half the
chunk when it runs out of memory, and (``encoder=``, ``FUSED_VISION_VLLM_ENCODER``) packs the encoder
(``fused_vision.encoder.padded``). Details: docs/vllm.md.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import importlib
import logging
import sys
from typing import NamedTuple

import torch
from torch import nn

from .. import _releases, patching
from .._dispatch import warn_once
from .._environment import choice, flag
from ..encoder.attention import attention_path
from ..pipeline import encoding, planner
from ..pipeline._chunks import HalvingChunks
from . import report, stem
from .transformers import ENCODERS, gemma4_targets, revert_fused_vision_gemma4

__all__ = [
    "ENV_VLLM",
    "ENV_VLLM_ENCODER",
    "apply_fused_vision_to_vllm_gemma4",
    "revert_fused_vision_vllm_gemma4",
    "vllm_plugin",
]

logger = logging.getLogger("fused_vision")
# The plugin's report goes through vLLM's own logger, whose handler and format vLLM's processes print.
engine_logger = logging.getLogger("vllm.fused_vision")

ENV_VLLM = "FUSED_VISION_VLLM"
ENV_VLLM_ENCODER = "FUSED_VISION_VLLM_ENCODER"  # the plugin's encoder= (stock when unset)
VLLM_MODULE = "vllm.model_executor.models.gemma4_mm"
_PLANNER_STATE = "planner"  # what a patched model runs with, shown in its repr


class _Chunk(NamedTuple):
    """One answer of ``_encoder_chunk``: items of ``patches`` patches per tower call, vLLM's own answer beside
    it, within vLLM's ``budget`` bytes."""

    patches: int
    items: int
    vllms: int
    budget: int

    def __str__(self) -> str:
        budget = f"{self.budget / 2**20:.0f} MiB"
        return f"{self.items} items of {self.patches} patches per tower call in {budget} (vLLM's own: {self.vllms})"


@dataclasses.dataclass
class _Call:
    """One guarded call of a model: the model, the cap its re-runs put on the chunk, and each chunk
    ``_encoder_chunk`` answered in the current run."""

    model: nn.Module
    cap: int | None = None
    chunks: list[_Chunk] = dataclasses.field(default_factory=list)


# The guarded call running in this thread (context), which vLLM's own method between the guard and
# ``_encoder_chunk`` cannot pass on: each thread, and each asyncio task, sees only its own.
_GUARDED: contextvars.ContextVar[_Call | None] = contextvars.ContextVar("fused_vision_guarded_call", default=None)


def _planner_path(tower: nn.Module) -> str:
    """``encoding.planner_path`` for what vLLM hands the embedder: float pixels and int64 position ids."""
    table = tower.patch_embedder.position_embedding_table
    probe = torch.empty(0, dtype=table.dtype, device="meta"), torch.empty(0, 2, dtype=torch.int64, device="meta")
    return encoding.planner_path(tower, [probe])


def _encoder_chunk(self, patches_per_item, free_bytes, total_bytes, position_embedding_size):
    """``Gemma4ForConditionalGeneration._encoder_chunk`` for a model's own calls: the planner's chunk for its
    tower within vLLM's budget, ``min(free // 2, total // 10)``, and at most a guarded re-run's cap."""
    stock = patching.stock_method(self, "_encoder_chunk")
    if patching.fused_state(self) is None:
        return stock(patches_per_item, free_bytes, total_bytes, position_embedding_size)
    if free_bytes > total_bytes:  # no device reads so; vLLM's own formula is the safety net the planner keeps
        warn_once(
            f"fused_vision: vLLM reported free_bytes={free_bytes} > total_bytes={total_bytes}; "
            "this call's chunk is vLLM's own"
        )
        return stock(patches_per_item, free_bytes, total_bytes, position_embedding_size)
    tower = self.vision_tower  # position_embedding_size is its config's, which the planner reads
    encoder_state = patching.fused_state(tower.encoder)
    packed_encoder = encoder_state is not None and encoder_state.op in ("packed_encoder", "fused_encoder")
    chunk = planner.plan(
        sys.maxsize,  # vLLM takes min(len(items), chunk) itself
        patches_per_item,
        tower.config,
        path=_planner_path(tower),
        free_bytes=free_bytes,
        total_bytes=total_bytes,
        dtype=self.model_dtype,  # vLLM casts the embedder's output to it: the encoder's activations
        attn_implementation=encoding.planner_attention(tower.config),
        encoder="packed" if packed_encoder else "stock",  # packed: each item's real patches, no (N, N) mask
    )
    call = _GUARDED.get()
    if call is not None and call.model is self:
        if call.cap is not None:
            chunk = min(chunk, call.cap)
        vllms = stock(patches_per_item, free_bytes, total_bytes, position_embedding_size)
        call.chunks.append(_Chunk(patches_per_item, chunk, vllms, min(free_bytes // 2, total_bytes // 10)))
    return chunk


def _failed_chunk(call: _Call, pixel_values) -> int:
    """Items per tower call when the error struck: the last chunk ``_encoder_chunk`` answered, cut as vLLM
    cuts it to the items of that patch count; 1 (nothing to halve) where it was not asked (MM-LoRA)."""
    if not call.chunks:
        return 1
    last = call.chunks[-1]
    return min(last.items, sum(item.shape[0] == last.patches for item in pixel_values))


def _out_of_memory_guard(name: str, pixels_key: str):
    """vLLM's method ``name`` run again, whole, at half the chunk that ran out of memory, down to one item."""

    def guarded(self, inputs, *args, **kwargs):
        stock = patching.stock_method(self, name)
        if patching.fused_state(self) is None:
            return stock(inputs, *args, **kwargs)
        call = _Call(self)
        token = _GUARDED.set(call)
        chunks = HalvingChunks(None, self.vision_tower.patch_embedder.position_embedding_table.device)

        def run(cap: int | None):
            call.cap, call.chunks[:] = cap, []
            return stock(inputs, *args, **kwargs)

        try:
            return chunks.run(run, lambda cap: _failed_chunk(call, inputs[pixels_key]))
        finally:
            _GUARDED.reset(token)
            chunks.warn(f"fused_vision: vLLM's {name}", "vision-tower call", stacklevel=2)
            _report_first_call(self, name, call)

    guarded.__name__ = guarded.__qualname__ = name
    guarded.__doc__ = f"vLLM's ``{name}``, run again at half the chunk that runs out of memory."
    return guarded


# vLLM's calls that encode a batch, by the input key of its pixels. vLLM 0.34 splits each into a dispatcher
# (in data-parallel encoder mode: items split across ranks, then all_reduce and all_gather) and its
# ``_local`` half, which encodes one rank's items before any collective: that half is guarded, so a re-run
# never re-enters a collective.
_ENCODING_CALLS = {"_process_image_input": "pixel_values", "_process_video_input": "pixel_values_videos"}


def _methods(cls: type) -> dict[str, patching.InstanceMethod]:
    """The methods to patch on vLLM's class: the chunk, and the guard on each encoding call's innermost form."""
    methods = {"_encoder_chunk": patching.InstanceMethod(_encoder_chunk)}
    for name, pixels_key in _ENCODING_CALLS.items():
        local = f"{name}_local"
        guarded = local if patching.stock_attribute(cls, local) is not patching.MISSING else name
        methods[guarded] = patching.InstanceMethod(_out_of_memory_guard(guarded, pixels_key))
    return methods


def _model_class() -> type:
    """vLLM's ``Gemma4ForConditionalGeneration``, with a clear error where this vLLM has none."""
    try:
        module = importlib.import_module(VLLM_MODULE)
    except ImportError as exc:
        raise ImportError(f"fused_vision.integrations.vllm needs vLLM with Gemma 4 ({VLLM_MODULE}): {exc}") from exc
    if not isinstance(getattr(module, "Gemma4ForConditionalGeneration", None), type):
        raise ImportError(f"{VLLM_MODULE} has no Gemma4ForConditionalGeneration")
    return module.Gemma4ForConditionalGeneration


def _vllm_targets(cls: type) -> list[patching.Target]:
    """vLLM's class with the planner's chunk and the out-of-memory guard, on the methods this vLLM has; none
    without ``_encoder_chunk``, whose chunk the guard caps. What is left out is warned of, once."""
    methods = _methods(cls)
    missing = [name for name in methods if patching.stock_attribute(cls, name) is patching.MISSING]
    if "_encoder_chunk" in missing:
        warn_once(f"fused_vision: vLLM's {cls.__name__} has no _encoder_chunk: its chunks stay vLLM's")
        return []
    if missing:
        warn_once(f"fused_vision: vLLM's {cls.__name__} has no {' or '.join(missing)}: no out-of-memory guard there")
    methods = {name: method for name, method in methods.items() if name not in missing}
    return [patching.Target(cls, methods, _PLANNER_STATE)]


def apply_fused_vision_to_vllm_gemma4(
    model: nn.Module | None = None,
    *,
    embedder: str | None = "patch_embed",
    pooler: bool = True,
    encoder: str = "stock",
    backend: str = "auto",
) -> int:
    """Put fused_vision into vLLM's Gemma 4: transformers' tower, which vLLM builds, as
    ``apply_fused_vision_to_gemma4`` patches it, and vLLM's ``Gemma4ForConditionalGeneration``: the
    planner's chunks and the out-of-memory guard.

    The keywords, the return value, idempotence and the errors are those every engine's ``apply_…`` shares
    (docs/integrations.md). Here:

    - ``model=None`` patches transformers' tower classes and vLLM's class, for every model vLLM builds,
      built already or later. A module is vLLM's model as built (in its worker process, ``LLM.apply_model``
      hands it over): its tower's modules and its own methods, other models keeping theirs. A vLLM model
      that holds the tower but is no ``Gemma4ForConditionalGeneration`` (``EmbeddingGemma2Model``, which
      copies vLLM's methods into its class body) gets its tower patched only, as with ``model=None``.
    - ``_encoder_chunk`` called through the model returns ``fused_vision.pipeline.planner.plan``'s chunk for
      its tower's config, vLLM's model dtype and the tower's attention, within vLLM's own budget
      ``min(free // 2, total // 10)``. It prices the path that runs: the one-hot where a 5.5-5.9 embedder
      runs stock code, the tower's activations otherwise, the packed encoder's where it runs. Called
      through the class (vLLM's tests do), it stays vLLM's.
    - ``_process_image_input`` and ``_process_video_input`` (in vLLM 0.34 their ``_local`` halves, which
      also serve the CUDA-graph path's eager fallback) that run out of memory (``torch.OutOfMemoryError``)
      run again, whole, with the chunk capped at half the chunk that failed, down to one item, whose
      error is raised; a ``RuntimeWarning`` names the sizes.
    - ``encoder``: "packed" or "fused" run vLLM's padded batches packed in its eager calls, with fused
      layers on vLLM's linears for "fused".
    - A method this vLLM lacks is left out, and a warning names it; without ``_encoder_chunk``, whose chunk
      the guard caps, vLLM's class is left as it is and only the tower is patched.

    Raises:
        ValueError: as every ``apply_…``; also a packed or fused tower configured with another attention
            implementation, and a ``model`` with no module to patch.
        TypeError: ``model`` is neither None nor an ``nn.Module``.
        ImportError: vLLM's Gemma 4 model or transformers' Gemma 4 is missing; nothing is patched.
    """
    caller = "apply_fused_vision_to_vllm_gemma4"
    keywords = dict(embedder=embedder, pooler=pooler, encoder=encoder, backend=backend)
    stem.check_keywords(caller, model, **keywords, encoders=ENCODERS)
    cls = _model_class()
    targets = gemma4_targets(model, **keywords) + _vllm_targets(cls)
    hint = (
        "Pass vLLM's Gemma4ForConditionalGeneration as built (LLM.apply_model hands it over in its worker "
        "process), or call it with model=None before vLLM builds the model."
    )
    return patching.patch(caller, model, targets, hint)


def _is_vllm_class(cls: type) -> bool:
    return cls.__module__.startswith("vllm.")


def revert_fused_vision_vllm_gemma4(model: nn.Module | None = None) -> int:
    """Undo ``apply_fused_vision_to_vllm_gemma4`` as every ``revert_…`` undoes its ``apply_…``
    (docs/integrations.md): ``model=None``, vLLM's class, whose methods are then the very objects it held,
    and transformers' tower classes (shared: ``apply_fused_vision_to_gemma4``'s class patch goes too), with
    every instance patch of them; a model, its own methods and its tower's modules."""
    return patching.revert(model, _is_vllm_class) + revert_fused_vision_gemma4(model)


# ---- the plugin and its report -----------------------------------------------------------------------

_FIRST_CALL = "vllm-first-call"  # the report's second line, logged once per process


def _report_patched() -> None:
    """The plugin's first line: what it patched in this process, transformers' classes and vLLM's methods."""
    classes, methods = [], []
    with contextlib.suppress(ImportError):  # already warned: what is missing stays unpatched
        modeling = _releases.modeling()
        tower = (modeling.Gemma4VisionPatchEmbedder, modeling.Gemma4VisionPooler, modeling.Gemma4VisionEncoder)
        classes = report.patched_classes(tower)
    with contextlib.suppress(ImportError):
        methods = [name for name, value in vars(_model_class()).items() if isinstance(value, patching.InstanceMethod)]
    if not classes and not methods:
        return
    guards = [name for name in methods if name != "_encoder_chunk"]
    vllms = ["the chunk planner (_encoder_chunk)"] if "_encoder_chunk" in methods else []
    vllms += [f"the out-of-memory guard ({', '.join(guards)})"] if guards else []
    report.log_once(
        engine_logger,
        "vllm-patched",
        "fused_vision: patched transformers' Gemma 4 tower: %s; vLLM's Gemma 4: %s. Backends, chunks and "
        "fallbacks follow at the first encoding call",
        ", ".join(classes) or "nothing",
        ", ".join(vllms) or "nothing",
    )


def _report_first_call(model: nn.Module, name: str, call: _Call) -> None:
    """The plugin's second line, after the first guarded call in this process (vLLM's profiling run, where it
    profiles): the backend each op runs on the tower's device, the chunks that call was given, and every
    fallback so far with its reason. A line it cannot compose never fails vLLM's call: it says why."""
    if not report.pending(_FIRST_CALL):
        return
    try:
        line = _first_call_line(model, name, call)
    except Exception as exc:  # a tower of an unforeseen shape: the call's own result stands
        line = ("fused_vision: no report of the first encoding call (%s: %s)", type(exc).__name__, exc)
    report.log_once(engine_logger, _FIRST_CALL, *line)


def _first_call_line(model: nn.Module, name: str, call: _Call) -> tuple:
    tower = model.vision_tower
    embedder, pooler, encoder = (patching.fused_state(m) for m in (tower.patch_embedder, tower.pooler, tower.encoder))
    device = tower.patch_embedder.position_embedding_table.device
    whole = embedder is not None and embedder.op == "patch_embed" and stem.plain_linear(tower.patch_embedder.input_proj)
    lookup = "patch_embed" if whole else "position_embeddings (the projection is vLLM's)"
    ops = [
        f"the embedder's {lookup}: {report.backend_on(embedder, device, lookup.split()[0])}",
        f"the pooler's pool_by_positions: {report.backend_on(pooler, device)}",
    ]
    if encoder is None:
        ops.append("the encoder: stock")
    else:
        config = tower.config
        heads = torch.empty(0, config.num_attention_heads, config.head_dim, dtype=model.model_dtype, device=device)
        layers = f", its layers {report.backend_on(encoder, device)}" if encoder.op == "fused_encoder" else ""
        ops.append(f"the encoder: {encoder.op.split('_')[0]}, attention {attention_path(heads)}{layers}")
    return (
        "fused_vision: Gemma 4's vision tower on %s: %s; %s's chunks: %s; fallbacks: %s",
        device,
        "; ".join(ops),
        name,
        ", ".join(map(str, call.chunks)) or "none asked (every item in one call)",
        report.fallbacks(),
    )


def vllm_plugin() -> None:
    """vLLM's general-plugin hook (entry point group ``vllm.general_plugins``), which vLLM runs in every
    process it starts, its model workers included, where a patch made in the launching script does not
    reach. Opt-in: only with FUSED_VISION_VLLM=1 does it call ``apply_fused_vision_to_vllm_gemma4`` with
    FUSED_VISION_VLLM_ENCODER's encoder (stock when unset). A malformed switch raises ValueError naming
    it, which stops the process: a typo must not serve stock silently. A patch that cannot be made only
    logs a warning: vLLM runs its plugins unguarded."""
    if not flag(ENV_VLLM):
        return
    encoder = choice(ENV_VLLM_ENCODER, ENCODERS, "stock")
    try:
        apply_fused_vision_to_vllm_gemma4(encoder=encoder)
    except Exception as exc:
        logger.warning("fused_vision: %s=1 but vLLM's Gemma 4 cannot be patched here (%s)", ENV_VLLM, exc)
    _report_patched()
