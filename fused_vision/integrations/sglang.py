"""fused_vision inside SGLang's Gemma 4 vision tower, which is SGLang's own code, not transformers'.

    apply_fused_vision_to_sglang_gemma4()        # the classes, before SGLang builds the model
    apply_fused_vision_to_sglang_gemma4(model)   # the instances inside a model that is already built

The embedder runs ``fused_vision.integrations.stem``'s forwards, the poolers (Gemma 4's, EmbeddingGemma2's)
this module's; ``encoder="packed"`` runs SGLang's own encoder on each item's real patches, as its FA3 and
Triton backends, which drop stock's padding mask, would not. SGLang's processes get it through its plugin
loader (``FUSED_VISION_SGLANG=1``, ``sglang_plugin``). Details: docs/sglang.md.
"""

from __future__ import annotations

import functools
import importlib
import logging

import torch
from torch import nn

from .. import patching
from .._environment import flag
from ..encoder import packed
from ..encoder.attention import Packing
from ..ops.pool_by_positions import pool_by_positions as _fused_pool_by_positions
from ..pipeline import _memory
from . import report, stem

__all__ = [
    "VARLEN_BACKENDS",
    "apply_fused_vision_to_sglang_gemma4",
    "encoder_target",
    "packed_encoder_forward",
    "revert_fused_vision_sglang_gemma4",
    "sglang_plugin",
]

logger = logging.getLogger("fused_vision")
# The plugin's report goes through SGLang's loggers, which its processes print at INFO.
engine_logger = logging.getLogger("sglang.fused_vision")

SGLANG_MODULE = "sglang.srt.models.gemma4_vision"
SGLANG_EMBEDDING_MODULE = "sglang.srt.models.embedding_gemma2"
ENV_SGLANG = "FUSED_VISION_SGLANG"
# What ``encoder=`` takes here: SGLang's own padded encoder, or it packed (``packed_encoder_forward``).
SGLANG_ENCODERS = ("stock", "packed")
# SGLang's attention backends (``QKV_BACKEND_IMPL`` names) that attend within each cu_seqlens segment of
# one (T, H, d) sequence: flash-attn's varlen layout.
VARLEN_BACKENDS = ("triton_attn", "fa3", "fa4", "aiter_attn")


def _sglang_vision():
    """SGLang's Gemma 4 vision module, with a clear error when it is missing."""
    try:
        return importlib.import_module(SGLANG_MODULE)
    except ImportError as exc:
        raise ImportError(
            f"fused_vision.integrations.sglang needs SGLang with Gemma 4 ({SGLANG_MODULE}, SGLang 0.5.x): {exc}"
        ) from exc


def _embedding_pooler_classes() -> list[type]:
    """SGLang's ``EmbeddingGemma2VisionPooler``, where this SGLang has one (0.5.23 does; older ones not)."""
    try:
        module = importlib.import_module(SGLANG_EMBEDDING_MODULE)
    except ImportError as exc:
        if getattr(exc, "name", None) != SGLANG_EMBEDDING_MODULE:
            # SGLang could not serve EmbeddingGemma2 either; Gemma 4 itself still gets patched
            logger.warning(
                "fused_vision: %s does not import (%s); its pooler stays stock", SGLANG_EMBEDDING_MODULE, exc
            )
        return []
    pooler = getattr(module, "EmbeddingGemma2VisionPooler", None)
    return [pooler] if isinstance(pooler, type) else []


# ---- the poolers --------------------------------------------------------------------------------------


def _fused_rows(pooler: nn.Module, inputs: tuple, args: tuple, kwargs: dict) -> tuple | None:
    """The rows an SGLang pooler hands to ``pool_by_positions``, broadcast as stock broadcasts them; None
    where stock runs: inputs the op does not take, and where stock skips the pooling (N == L: a scale,
    nothing to fuse; EmbeddingGemma2's mask is then ``~padding_positions``)."""
    hidden_states, _, _, output_length = inputs
    if args or kwargs or not stem.pooler_runs_fused(pooler, *inputs) or output_length == hidden_states.shape[1]:
        return None
    return stem.broadcast_rows(*inputs[:3])


def _pooler_forward(self, hidden_states, patch_positions, padding_positions, output_length=None, *args, **kwargs):
    """SGLang's ``Gemma4VisionPooler.forward`` through ``fused_vision.pool_by_positions``.

    As stock: the result is in the hidden dtype, the mask marks the filled slots, and padding patches
    (ids clamped to (0, 0)) pool into slot 0 unless the module masks them first (``mask_pad_before_pool``,
    which SGLang's ``gemma4_mm`` leaves False). Unlike stock, each patch weighs exactly 1/k^2, as in
    transformers' pooler: stock's matmul weighs it by 1/k^2 rounded to the hidden dtype (in bf16, 1/9
    comes out 0.2 % too large), so in bf16 and fp16 the two lie within 2 ulps (tests/integrations/test_sglang.py).
    """
    inputs = (hidden_states, patch_positions, padding_positions, output_length)
    mask_first = getattr(self, "mask_pad_before_pool", None)
    rows = _fused_rows(self, inputs, args, kwargs)
    if not isinstance(mask_first, bool) or rows is None:
        return patching.stock_method(self, "forward")(*inputs, *args, **kwargs)
    hidden, ids, padding = rows
    padding = padding if mask_first else torch.zeros_like(padding)
    pooled, mask = _fused_pool_by_positions(
        hidden, ids, padding, output_length, backend=patching.fused_state(self).backend
    )
    return pooled.to(hidden_states.dtype), mask[: patch_positions.shape[0]]  # stock's mask: a row per item of ids


def _embedding_pooler_forward(
    self, hidden_states, patch_positions, padding_positions, output_length=None, *args, **kwargs
):
    """SGLang's ``EmbeddingGemma2VisionPooler.forward`` through ``fused_vision.pool_by_positions``.

    As stock: the fp32 k x k average, scaled by sqrt(D) in fp32 with no rounding between
    (``round_average=False``), cast once to the hidden dtype; equal to stock up to fp32 summation order.
    """
    inputs = (hidden_states, patch_positions, padding_positions, output_length)
    rows = _fused_rows(self, inputs, args, kwargs)
    if rows is None:
        return patching.stock_method(self, "forward")(*inputs, *args, **kwargs)
    backend = patching.fused_state(self).backend
    pooled, mask = _fused_pool_by_positions(*rows, output_length, round_average=False, backend=backend)
    return pooled.to(hidden_states.dtype), mask[: patch_positions.shape[0]]


# ---- the packed encoder inside SGLang's ``Gemma4VisionEncoder`` --------------------------------------


class _Varlen:
    """A layer's attention backend for one packed call, handed the packing's boundaries: SGLang's attention
    passes every argument by keyword, ``cu_seqlens=None`` among them."""

    def __init__(self, backend: nn.Module, packing: Packing):
        self.backend, self.packing = backend, packing

    def forward(self, **kwargs):
        boundaries = {"cu_seqlens": self.packing.cu_seqlens, "max_seqlen": self.packing.longest}
        return self.backend.forward(**{**kwargs, **boundaries})

    __call__ = forward


def _attention_forward(self, *args, **kwargs):
    """SGLang's ``Gemma4VisionAttention.forward``: stock's; where its mask is a ``Packing``, stock's without
    a mask on a view of the module whose backend attends within the packing's items."""
    packing = next((value for value in (*args, *kwargs.values()) if isinstance(value, Packing)), None)
    if packing is not None:
        args = tuple(None if value is packing else value for value in args)
        kwargs = {name: None if value is packing else value for name, value in kwargs.items()}
        self = patching.call_view(self, qkv_backend=_Varlen(self.qkv_backend, packing))
    return patching.stock_method(self, "forward")(*args, **kwargs)


def _keyword_names(code) -> set[str]:
    names = set()
    for const in code.co_consts:
        if isinstance(const, tuple):
            names.update(item for item in const if isinstance(item, str))
    return names


@functools.cache
def _attention_takes_boundaries(attention_cls: type) -> bool:
    """Whether ``attention_cls``'s stock forward calls its ``qkv_backend.forward`` with keywords only,
    cu_seqlens and attention_mask among them: where it does not, the backend cannot be handed the boundaries."""
    code = getattr(patching.stock_attribute(attention_cls, "forward"), "__code__", None)
    if code is None or "qkv_backend" not in code.co_names:
        return False
    return {"cu_seqlens", "attention_mask", "bsz", "seq_len"} <= _keyword_names(code)


def _vit_cuda_graph() -> bool:
    try:
        from sglang.srt.environ import envs

        return bool(envs.SGLANG_VIT_ENABLE_CUDA_GRAPH.get())
    except (ImportError, AttributeError):
        return False


def _install(vision) -> None:
    """SGLang's ``Gemma4VisionAttention.forward`` patched to take a ``Packing`` (stock's for every other
    call): once, and again after a revert restored the class."""
    attention_cls = vision.Gemma4VisionAttention
    if attention_cls.__dict__.get("forward") is not _attention_forward:
        patching.install_methods(attention_cls, {"forward": _attention_forward})


def _varlen(vision, transformer) -> bool:
    """Whether every layer takes the packed sequence with a ``Packing``: SGLang's own attention forward,
    which hands a backend that attends within cu_seqlens segments the boundaries."""
    if not _attention_takes_boundaries(vision.Gemma4VisionAttention):
        return False
    _install(vision)
    for layer in transformer.layers:
        attention = layer.self_attn
        backend = type(getattr(attention, "qkv_backend", None))
        if type(attention).forward is not _attention_forward:  # a subclass's own forward
            return False
        if not any(backend is vision.QKV_BACKEND_IMPL.get(name) for name in VARLEN_BACKENDS):
            return False
    return True


def _encode(vision, transformer, inputs_embeds, ids, lengths) -> torch.Tensor:
    """SGLang's encoder on the (1, T, D) packed sequence, attention within each item: (T, D)."""
    if _varlen(vision, transformer):
        packing = Packing.of(lengths, inputs_embeds.device)
        return transformer(inputs_embeds=inputs_embeds, attention_mask=packing, patch_positions=ids)[0]
    items = zip(torch.split(inputs_embeds[0], lengths), torch.split(ids[0], lengths))
    return torch.cat(
        [transformer(inputs_embeds=e[None], attention_mask=None, patch_positions=i[None])[0] for e, i in items]
    )


def _takes(vision, encoder, pixel_values, pixel_position_ids, args, kwargs) -> bool:
    """Whether the packed forward returns what stock would: SGLang's own modules, padded (B, N, ·) tensors
    with N a multiple of k^2; else stock runs (and raises where it raises)."""
    if args or kwargs or _vit_cuda_graph():
        return False
    if not isinstance(getattr(encoder, "encoder", None), vision.Gemma4VisionTransformer):
        return False
    if not all(isinstance(layer.self_attn, vision.Gemma4VisionAttention) for layer in encoder.encoder.layers):
        return False
    if not packed.padded_batch(pixel_values, pixel_position_ids):
        return False
    k2 = encoder.pooling_kernel_size**2
    return pixel_values.shape[0] > 0 and pixel_values.shape[1] >= k2 and pixel_values.shape[1] % k2 == 0


def packed_encoder_forward(self, pixel_values, pixel_position_ids, *args, **kwargs):
    """SGLang's ``Gemma4VisionEncoder.forward`` through the packed encoder: (pooled, pooler_mask) as stock
    returns them, each item's attention within its real patches whatever the backend."""
    vision = _sglang_vision()
    state = patching.fused_state(self)
    inputs = (pixel_values, pixel_position_ids, *args)
    if state is None or not _takes(vision, self, pixel_values, pixel_position_ids, args, kwargs):
        return patching.stock_method(self, "forward")(*inputs, **kwargs)
    real, lengths, pixels, ids = packed.pack_items(list(pixel_values), list(pixel_position_ids))
    if min(lengths) == 0:  # an item with no real patch: stock's own forward
        return patching.stock_method(self, "forward")(*inputs, **kwargs)
    no_padding = torch.zeros(ids.shape[:2], dtype=torch.bool, device=ids.device)
    inputs_embeds = self.patch_embedder(pixels, ids, no_padding)
    mask = torch.stack(real)
    hidden = packed.scatter_rows(_encode(vision, self.encoder, inputs_embeds, ids, lengths), mask)
    output_length = pixel_values.shape[-2] // self.pooling_kernel_size**2
    pooled, pooler_mask = self.pooler(hidden, pixel_position_ids, ~mask, output_length=output_length)
    if getattr(self, "standardize", False):
        pooled = (pooled - self.std_bias) * self.std_scale
    return pooled, pooler_mask


def encoder_target(encoder_cls: type, state) -> patching.Target:
    """What ``encoder="packed"`` patches: SGLang's ``Gemma4VisionEncoder.forward``."""
    return patching.Target(encoder_cls, {"forward": packed_encoder_forward}, state)


# ---- patching, reverting, the plugin ------------------------------------------------------------------


def apply_fused_vision_to_sglang_gemma4(
    model: nn.Module | None = None,
    *,
    embedder: str | None = "patch_embed",
    pooler: bool = True,
    encoder: str = "stock",
    backend: str = "auto",
) -> int:
    """Put fused_vision's ops into SGLang's Gemma 4 vision tower (``sglang.srt.models.gemma4_vision``).

    The keywords, the return value, idempotence and the errors are those every engine's ``apply_…`` shares
    (docs/integrations.md). Here:

    - ``model=None`` patches SGLang's ``Gemma4VisionPatchEmbedder``, ``Gemma4VisionPooler`` and (where
      SGLang has it) ``EmbeddingGemma2VisionPooler`` classes (and, for the packed encoder,
      ``Gemma4VisionEncoder``). A module is SGLang's ``Gemma4ForConditionalGeneration``,
      ``EmbeddingGemma2Model``, their ``Gemma4VisionEncoder``, or anything holding those classes.
    - ``embedder="position_embeddings"``: the embedder's output is bit-identical to stock's.
    - ``pooler``: ``Gemma4VisionPooler`` then rounds as transformers' pooler does, not as SGLang's (see
      ``_pooler_forward``); ``EmbeddingGemma2VisionPooler`` equals stock up to float32 summation order.
      False keeps SGLang's numerics bit for bit.
    - ``encoder``: "stock" or "packed" only (``SGLANG_ENCODERS``; "fused" raises ValueError): "packed" makes
      ``Gemma4VisionEncoder.forward`` strip each item's padding and attend within each item's real
      patches on every attention backend, FA3 and Triton included, which drop stock's padding mask
      (``packed_encoder_forward``), with stock's outputs.

    Raises:
        ValueError: as every ``apply_…``; also a ``model`` with no module to patch.
        TypeError: ``model`` is neither None nor an ``nn.Module``.
        ImportError: SGLang or its Gemma 4 is missing.
    """
    caller = "apply_fused_vision_to_sglang_gemma4"
    stem.check_keywords(
        caller, model, embedder=embedder, pooler=pooler, encoder=encoder, backend=backend, encoders=SGLANG_ENCODERS
    )
    vision = _sglang_vision()
    poolers = [(vision.Gemma4VisionPooler, _pooler_forward)]
    poolers += [(cls, _embedding_pooler_forward) for cls in _embedding_pooler_classes()]
    release = dict(onehot_lookup=stem.lookup_is_onehot(vision.Gemma4VisionPatchEmbedder), pooler_float32=False)
    packed_target = None
    if encoder == "packed":
        packed_target = encoder_target(vision.Gemma4VisionEncoder, stem.FusedOp("packed_encoder", backend, **release))
    options = dict(embedder=embedder, pooler=pooler, backend=backend, encoder=packed_target)
    targets = stem.tower_targets(vision.Gemma4VisionPatchEmbedder, poolers, release, **options)
    hint = (
        "Pass SGLang's Gemma4ForConditionalGeneration, EmbeddingGemma2Model or Gemma4VisionEncoder (for "
        "transformers' Gemma 4, apply_fused_vision_to_gemma4), or call it with model=None before the model is built."
    )
    return patching.patch(caller, model, targets, hint)


def _is_sglang_class(cls: type) -> bool:
    return cls.__module__ in (SGLANG_MODULE, SGLANG_EMBEDDING_MODULE)


def revert_fused_vision_sglang_gemma4(model: nn.Module | None = None) -> int:
    """Undo ``apply_fused_vision_to_sglang_gemma4`` as every ``revert_…`` undoes its ``apply_…``
    (docs/integrations.md): ``model=None``, SGLang's classes and every instance patch of them; a model,
    its modules of those classes."""
    return patching.revert(model, _is_sglang_class)


def sglang_plugin() -> None:
    """SGLang's general-plugin hook (entry point group ``sglang.srt.plugins``), which SGLang runs in every
    process it starts, its schedulers included. Opt-in: patches SGLang's Gemma 4 classes only when
    FUSED_VISION_SGLANG is on; a value the switch does not take raises ValueError naming it."""
    if not flag(ENV_SGLANG):
        return
    try:
        apply_fused_vision_to_sglang_gemma4()
    except ImportError as exc:
        logger.warning("fused_vision: %s=1 but SGLang's Gemma 4 cannot be patched here (%s)", ENV_SGLANG, exc)
        return
    _report_patched()


def _report_patched() -> None:
    """The plugin's line, once per process: the classes it patched, the backend each op resolves to on this
    process's device (SGLang builds its model there next), and every fallback so far with its reason."""
    vision = _sglang_vision()
    classes = [vision.Gemma4VisionPatchEmbedder, vision.Gemma4VisionPooler, *_embedding_pooler_classes()]
    device = _memory.current_device()
    ops = [f"{cls.__name__}: {report.backend_on(patching.fused_state(cls), device)}" for cls in classes]
    report.log_once(
        engine_logger,
        "sglang-patched",
        "fused_vision: patched SGLang's Gemma 4 tower: %s; on %s: %s; fallbacks: %s",
        ", ".join(report.patched_classes(classes)) or "nothing",
        device,
        ", ".join(ops),
        report.fallbacks(),
    )
