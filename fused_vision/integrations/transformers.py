"""fused_vision inside transformers' Gemma 4 vision tower: a one-line patcher.

    from fused_vision.gemma4 import apply_fused_vision_to_gemma4

    apply_fused_vision_to_gemma4()        # the classes: every Gemma 4 tower built from now on, vLLM's included
    apply_fused_vision_to_gemma4(model)   # the instances inside a model that is already loaded

Both transformers families are supported: 5.5-5.9 (one-hot lookup, the pooler returns the hidden dtype)
and 5.10+ (``F.embedding`` lookup, the pooler returns float32 and the tower standardizes in float32). The
family is told from the stock code itself, never from a version string, and each patched module keeps
its family's semantics: the lookup is bit-identical, the pooler equal up to fp32 summation order.

A patched module runs stock code whenever the fused op cannot take its inputs or would round
differently (float64; a quantized or hooked ``input_proj`` or autocast keep the embedder to the fused
lookup alone; the pooler under autocast is stock). The ops are differentiable, so a patched tower
trains with stock's gradients. SGLang's tower reuses the embedder's forwards (``fused_vision.sglang``);
vLLM's plugin is ``fused_vision.vllm``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import torch
from torch import nn

from .. import _releases
from .._dispatch import BACKENDS
from .._validation import FLOAT_DTYPES, INDEX_DTYPES
from ..encoder import fused_layer, packed
from ..encoder.padded import encoder_forward
from ..ops.patch_embed import patch_embed as _fused_patch_embed
from ..ops.pool_by_positions import pool_by_positions as _fused_pool_by_positions
from ..ops.position_embeddings import position_embeddings as _fused_position_embeddings
from . import patching

__all__ = ["EMBEDDER_OPS", "ENCODERS", "apply_fused_vision_to_gemma4", "revert_fused_vision_gemma4"]

# What ``embedder=`` takes: the whole embedder in one kernel, or the lookup alone inside the stock one.
EMBEDDER_OPS = ("patch_embed", "position_embeddings")
# What ``encoder=`` takes: stock's padded encoder, the packed one (``fused_vision.packed``), or the packed
# one with fused layers (``fused_vision.fused_layer``).
ENCODERS = ("stock", "packed", "fused")


@dataclasses.dataclass(frozen=True)
class FusedOp:
    """The state a patched module runs with: its op and backend, and its release family."""

    op: str  # "patch_embed", "position_embeddings", "pool_by_positions", "packed_encoder" or "fused_encoder"
    backend: str
    # The release family, told once at patch time so that forwards (and torch.compile) see constants.
    onehot_lookup: bool = dataclasses.field(default=False, compare=False)
    pooler_float32: bool = dataclasses.field(default=True, compare=False)

    def __str__(self) -> str:
        return f"{self.op}(backend={self.backend})"


# ---- transformers, located lazily ----------------------------------------------------------------


def _stock(kind: str, name: str):
    modeling = _releases.modeling()
    cls = modeling.Gemma4VisionPatchEmbedder if kind == "embedder" else modeling.Gemma4VisionPooler
    return patching.stock_attribute(cls, name)


@functools.cache
def pooler_returns_float32() -> bool:
    """Whether the stock pooler returns float32 (5.10+) rather than the hidden dtype (5.5-5.9).

    Told by running the stock forward once on a 1-element bfloat16 input, on the CPU.
    """
    modeling = _releases.modeling()
    pooler = modeling.Gemma4VisionPooler(modeling.Gemma4VisionConfig(hidden_size=4))
    hidden = torch.ones(1, 1, 4, dtype=torch.bfloat16)
    ids = torch.zeros(1, 1, 2, dtype=torch.long)
    padding = torch.zeros(1, 1, dtype=torch.bool)
    with torch.no_grad():
        pooled, _ = _stock("pooler", "forward")(pooler, hidden, ids, padding, 1)
    return pooled.dtype == torch.float32


def lookup_is_onehot(embedder_cls: type) -> bool:
    """Whether the class's stock lookup is the one-hot matmul of 5.5-5.9 (else the F.embedding of 5.10+)."""
    lookup = patching.stock_attribute(embedder_cls, "_position_embeddings")
    return lookup is not patching.MISSING and "one_hot" in lookup.__code__.co_names


@functools.cache
def onehot_lookup() -> bool:
    """Whether transformers' stock lookup is the one-hot matmul of 5.5-5.9."""
    return lookup_is_onehot(_releases.modeling().Gemma4VisionPatchEmbedder)


# ---- the patched methods, shared with SGLang's tower (its embedder is 5.5-5.9's) ---------------------


def _plain_linear(linear: nn.Module) -> bool:
    """An ``nn.Linear`` whose weight the fused embedder may read directly (no bias, hooks or quantization)."""
    if not isinstance(linear, nn.Linear) or linear.bias is not None:
        return False
    if linear._forward_hooks or linear._forward_pre_hooks or hasattr(linear, "_hf_hook"):
        return False
    weight = linear.weight
    return type(weight) in (torch.Tensor, nn.Parameter) and weight.dtype in FLOAT_DTYPES


def _autocast_enabled(device_type: str) -> bool:
    """``torch.is_autocast_enabled``, False on the meta device, where it raises. (Not through
    ``torch.amp.is_autocast_available``: torch 2.11's dynamo breaks the graph on it.)"""
    return device_type != "meta" and torch.is_autocast_enabled(device_type)


def _lookup_runs_stock(embedder: nn.Module, pixel_position_ids) -> bool:
    """Whether the embedder's lookup runs stock code: it is not patched, or a dtype is one the fused op
    does not take (a float64 table, say)."""
    return (
        patching.fused_state(embedder) is None
        or embedder.position_embedding_table.dtype not in FLOAT_DTYPES
        or not isinstance(pixel_position_ids, torch.Tensor)
        or pixel_position_ids.dtype not in INDEX_DTYPES
    )


def embedder_runs_stock(embedder: nn.Module, pixel_values, pixel_position_ids) -> bool:
    """Whether the embedder hands these inputs to its stock forward: its lookup does, or the pixels are of a
    dtype the fused ops do not take (float64, say)."""
    return (
        _lookup_runs_stock(embedder, pixel_position_ids)
        or not isinstance(pixel_values, torch.Tensor)
        or pixel_values.dtype not in FLOAT_DTYPES
    )


def _lookup_table(embedder: nn.Module, fused: FusedOp) -> torch.Tensor:
    """The position table in the dtype whose rows the stock lookup returns."""
    table = embedder.position_embedding_table
    device_type = table.device.type
    if fused.onehot_lookup and _autocast_enabled(device_type):
        # 5.5-5.9's one-hot matmul runs in the autocast dtype: its rows come out rounded to it
        table = table.to(torch.get_autocast_dtype(device_type))
    return table


def broadcast_rows(features, position_ids, padding_positions):
    """(B, N, ·) features, (B, N, 2) ids and (B, N) padding (None passes through) expanded to one batch, as
    stock's arithmetic broadcasts a batch of one (an engine may pair (1, N, 2) ids with (B, N, K) pixels);
    or None where they are not such rows of one N: stock then runs, and broadcasts or raises as it does."""
    present = [(t, ndim) for t, ndim in ((features, 3), (position_ids, 3), (padding_positions, 2)) if t is not None]
    if any(not isinstance(t, torch.Tensor) or t.dim() != ndim for t, ndim in present):
        return None
    if len({t.shape[1] for t, _ in present}) != 1:
        return None
    batches = {t.shape[0] for t, _ in present} - {1}
    if len(batches) > 1:
        return None
    batch = batches.pop() if batches else 1
    return tuple(
        t if t is None or t.shape[0] == batch else t.expand(batch, *t.shape[1:])
        for t in (features, position_ids, padding_positions)
    )


def _embedder_position_embeddings(self, pixel_position_ids, padding_positions, *args, **kwargs):
    """``Gemma4VisionPatchEmbedder._position_embeddings`` as ``fused_vision.position_embeddings``, bit-identical.

    Our forward never calls it; vLLM 0.34+ does: its ``_embed_patches`` inlines the embedder's forward
    around its own ``input_proj`` and asks the module for the lookup alone.
    """
    rows = None if args or kwargs else broadcast_rows(None, pixel_position_ids, padding_positions)
    if rows is None or _lookup_runs_stock(self, pixel_position_ids):
        return patching.stock_method(self, "_position_embeddings")(
            pixel_position_ids, padding_positions, *args, **kwargs
        )
    fused = patching.fused_state(self)
    return _fused_position_embeddings(_lookup_table(self, fused), *rows[1:], backend=fused.backend)


def _embedder_forward(self, pixel_values, pixel_position_ids, padding_positions=None, *args, **kwargs):
    """``Gemma4VisionPatchEmbedder.forward`` with the fused patch embedder, or the fused lookup alone."""
    # args, kwargs: arguments of a newer stock signature; let stock handle them
    rows = None if args or kwargs else broadcast_rows(pixel_values, pixel_position_ids, padding_positions)
    if rows is None or embedder_runs_stock(self, pixel_values, pixel_position_ids):
        return patching.stock_method(self, "forward")(
            pixel_values, pixel_position_ids, padding_positions, *args, **kwargs
        )
    pixel_values, pixel_position_ids, padding_positions = rows

    fused, table, weight = patching.fused_state(self), self.position_embedding_table, self.input_proj.weight
    if (
        fused.op == "patch_embed"
        and _plain_linear(self.input_proj)
        and weight.dtype == table.dtype
        and not _autocast_enabled(pixel_values.device.type)
    ):
        return _fused_patch_embed(
            pixel_values, weight, table, pixel_position_ids, padding_positions, backend=fused.backend
        )

    # The lookup alone, fused with the residual add; the projection stays the module's own.
    pixel_values = 2 * (pixel_values - 0.5)
    if weight.dtype.is_floating_point:
        pixel_values = pixel_values.to(weight.dtype)
    hidden_states = self.input_proj(pixel_values)
    table, backend = _lookup_table(self, fused), fused.backend
    if hidden_states.dtype == table.dtype:
        return _fused_position_embeddings(
            table, pixel_position_ids, padding_positions, residual=hidden_states, backend=backend
        )
    # e.g. autocast: keep stock's type promotion of `hidden_states + position_embeddings`
    return hidden_states + _fused_position_embeddings(table, pixel_position_ids, padding_positions, backend=backend)


def pooler_runs_fused(pooler: nn.Module, hidden_states, pixel_position_ids, padding_positions, output_length) -> bool:
    """Whether the pooler is patched and ``pool_by_positions`` takes these inputs as stock reads them; else
    stock runs, and raises its own errors."""
    return (
        patching.fused_state(pooler) is not None
        and not isinstance(output_length, bool)
        and isinstance(output_length, int)
        and isinstance(hidden_states, torch.Tensor)
        and hidden_states.dim() == 3
        and hidden_states.dtype in FLOAT_DTYPES
        and hidden_states.shape[-1] == pooler.hidden_size
        and 1 <= output_length <= hidden_states.shape[1]
        and isinstance(pixel_position_ids, torch.Tensor)
        and pixel_position_ids.dtype in INDEX_DTYPES
        and isinstance(padding_positions, torch.Tensor)
        and padding_positions.dtype == torch.bool
        and not _autocast_enabled(hidden_states.device.type)  # stock's matmul would run in low precision
    )


def _pooler_forward(self, hidden_states, pixel_position_ids, padding_positions, output_length=None, *args, **kwargs):
    """``Gemma4VisionPooler.forward`` through ``fused_vision.pool_by_positions``, in the release's dtype."""
    inputs = (hidden_states, pixel_position_ids, padding_positions, output_length)
    rows = None if args or kwargs else broadcast_rows(hidden_states, pixel_position_ids, padding_positions)
    if rows is None or not pooler_runs_fused(self, *inputs):
        return patching.stock_method(self, "forward")(*inputs, *args, **kwargs)
    fused = patching.fused_state(self)
    pooled, mask = _fused_pool_by_positions(*rows, output_length, backend=fused.backend)
    if not fused.pooler_float32:
        pooled = pooled.to(hidden_states.dtype)  # 5.5-5.9 scale in the hidden dtype: the same rounding
    return pooled, stock_pooler_mask(mask, pixel_position_ids, padding_positions, output_length)


def stock_pooler_mask(mask, pixel_position_ids, padding_positions, output_length):
    """The mask as stock returns it from broadcast inputs: the padding itself where nothing is pooled
    (N == L), else one row per item of the ids, which alone set the slots."""
    if padding_positions.shape[1] == output_length:
        return padding_positions
    return mask[: pixel_position_ids.shape[0]]


# ---- patching and reverting ---------------------------------------------------------------------


def tower_targets(
    caller: str,
    embedder_cls: type,
    poolers: Sequence[tuple[type, object]],
    release: dict,
    *,
    embedder: str | None,
    pooler: bool,
    backend: str,
    encoder: patching.Target | None = None,
) -> list[patching.Target]:
    """What an ``apply_…`` call patches: a tower's embedder class (its forward and its lookup) with the op
    ``embedder`` names, its pooler classes (``poolers``: (class, forward) pairs) when ``pooler``, and the
    ``encoder`` target when given."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if embedder is not None and embedder not in EMBEDDER_OPS:
        raise ValueError(f"embedder: expected one of {EMBEDDER_OPS} or None, got {embedder!r}")
    if embedder is None and not pooler and encoder is None:
        raise ValueError(f"{caller}: nothing selected (embedder=None and pooler=False)")
    targets = [] if encoder is None else [encoder]
    if embedder is not None:
        methods = {"forward": _embedder_forward, "_position_embeddings": _embedder_position_embeddings}
        targets.append(patching.Target(embedder_cls, methods, FusedOp(embedder, backend, **release)))
    if pooler:
        state = FusedOp("pool_by_positions", backend, **release)
        targets += [patching.Target(cls, {"forward": forward}, state) for cls, forward in poolers]
    return targets


def apply_fused_vision_to_gemma4(
    model: nn.Module | None = None,
    *,
    embedder: str | None = "patch_embed",
    pooler: bool = True,
    backend: str = "auto",
    encoder: str = "stock",
) -> int:
    """Put fused_vision's ops into transformers' Gemma 4 vision tower.

    Args:
        model: None to patch transformers' classes (``Gemma4VisionPatchEmbedder``, ``Gemma4VisionPooler``):
            every instance without a patch of its own uses the fused ops from then on, including towers
            built later by ``from_pretrained`` or by vLLM's ``AutoModel.from_config``. Or a module
            (``Gemma4ForConditionalGeneration``, ``Gemma4Model``, ``Gemma4VisionModel``, or anything
            containing those two classes, such as ``EmbeddingGemma2Model`` and DiffusionGemma's models,
            which build the same tower) whose instances to patch, whether the class is patched or not.
            SGLang builds a tower of its own: ``fused_vision.sglang.apply_fused_vision_to_sglang_gemma4``.
        embedder: ``"patch_embed"``, the whole patch embedder as ``fused_vision.patch_embed`` (prescale,
            projection, lookup and add in one kernel; where that cannot run, a quantized or hooked
            ``input_proj`` or autocast, the lookup alone); ``"position_embeddings"``, only the lookup
            inside the stock embedder (``fused_vision.position_embeddings``, fused with the residual
            add), the projection staying the module's own; None leaves the embedder stock. Either op
            also makes the embedder's ``_position_embeddings`` method the fused lookup, bit-identical:
            vLLM 0.34+ runs its own projection and calls that method alone.
        pooler: the pooler as ``fused_vision.pool_by_positions``.
        backend: "auto", "triton" or "reference", for every patched op.
        encoder: "stock" leaves ``Gemma4VisionModel.forward`` stock; "packed" makes it strip the padding and
            run the packed encoder (``fused_vision.packed``), with stock's outputs; "fused" runs the packed
            encoder with fused layers (``fused_vision.fused_layer``: concatenated QKV and gate/up GEMMs,
            whose weights the parameters then view, and the layer kernels), and makes
            ``Gemma4VisionEncoder.forward`` run them on its padded batch (under torch.compile the tower's
            forward runs padded). Both need sdpa, eager or flash attention configured; ``encode_images``
            on a tower patched so runs the same encoder.

    Returns:
        The number of modules (with ``model``) or classes (without) this call set to a fused op. Calling
        again with the same arguments changes nothing and returns the same number; calling with other
        arguments reconfigures the selected modules and leaves the unselected ones as they were.

    Raises:
        ValueError: nothing selected, an unknown ``embedder``, ``encoder`` or backend, a packed or fused
            tower configured with another attention implementation, or ``model`` holds no module to patch
            (e.g. ``gemma4_unified`` checkpoints, which have no vision tower).
        TypeError: ``model`` is neither None nor an ``nn.Module``.
        ImportError: transformers or its Gemma 4 is missing.
    """
    caller = "apply_fused_vision_to_gemma4"
    modeling = _releases.modeling()
    poolers = [(modeling.Gemma4VisionPooler, _pooler_forward)]
    release = dict(onehot_lookup=onehot_lookup(), pooler_float32=pooler_returns_float32())
    if encoder not in ENCODERS:
        raise ValueError(f"encoder: expected one of {ENCODERS}, got {encoder!r}")
    encoder_target = None
    if encoder != "stock":
        state = FusedOp(f"{encoder}_encoder", backend, **release)
        encoder_target = packed.encoder_target(modeling.Gemma4VisionModel, model, state)
    embedder_cls, options = modeling.Gemma4VisionPatchEmbedder, dict(embedder=embedder, pooler=pooler, backend=backend)
    targets = tower_targets(caller, embedder_cls, poolers, release, **options, encoder=encoder_target)
    if encoder != "stock":  # the encoder's own forward too: for its direct callers (vLLM) and torch.compile
        methods = {"forward": encoder_forward}
        targets.append(patching.Target(modeling.Gemma4VisionEncoder, methods, state))
    hint = (
        "Pass a Gemma4ForConditionalGeneration, Gemma4Model or Gemma4VisionModel (gemma4_unified checkpoints "
        "have no vision tower), or call it with model=None before the model is built."
    )
    if isinstance(model, nn.Module) and any(type(m).__module__.startswith("sglang.") for m in model.modules()):
        hint = "It is an SGLang model, whose tower is SGLang's own: use apply_fused_vision_to_sglang_gemma4."
    return patching.patch(caller, model, targets, hint)


def _is_transformers_class(cls: type) -> bool:
    return cls.__module__.startswith("transformers.")


def revert_fused_vision_gemma4(model: nn.Module | None = None) -> int:
    """Undo ``apply_fused_vision_to_gemma4``.

    With ``model=None``: restore transformers' patched classes and every instance patched (or pinned)
    with ``model=``, so all of transformers' Gemma 4 runs stock code again; returns the number of classes
    and instance patches undone. With a model: its modules run stock code, even while the classes stay
    patched; returns the number of its modules that were running a fused op.
    """
    undone = patching.revert(model, _is_transformers_class)
    fused_layer.release(model)  # the parameters own their storage again
    return undone
