"""fused_vision inside SGLang's Gemma 4 vision tower, which is SGLang's own code, not transformers'.

    apply_fused_vision_to_sglang_gemma4()        # the classes, before SGLang builds the model
    apply_fused_vision_to_sglang_gemma4(model)   # the instances inside a model that is already built

The embedder becomes ``fused_vision.patch_embed`` (or stock's with the lookup swapped), the pooler and
EmbeddingGemma2's pooler fused_vision's; SGLang's scheduler processes get it through its plugin loader
(``FUSED_VISION_SGLANG=1``, ``sglang_plugin``). Details: docs/sglang.md.
"""

from __future__ import annotations

import importlib
import logging
import os

import torch
from torch import nn

from ..ops.pool_by_positions import pool_by_positions as _fused_pool_by_positions
from . import patching, sglang_packed, stem

__all__ = ["apply_fused_vision_to_sglang_gemma4", "revert_fused_vision_sglang_gemma4", "sglang_plugin"]

logger = logging.getLogger("fused_vision")

SGLANG_MODULE = "sglang.srt.models.gemma4_vision"
SGLANG_EMBEDDING_MODULE = "sglang.srt.models.embedding_gemma2"
ENV_SGLANG = "FUSED_VISION_SGLANG"
# What ``encoder=`` takes here: SGLang's own padded encoder, or it packed (``fused_vision.sglang_packed``).
ENCODERS = ("stock", "packed")


def _sglang_vision():
    """SGLang's Gemma 4 vision module, with a clear error when it is missing."""
    try:
        return importlib.import_module(SGLANG_MODULE)
    except ImportError as exc:
        raise ImportError(
            f"fused_vision.sglang needs SGLang with Gemma 4 ({SGLANG_MODULE}, SGLang 0.5.x): {exc}"
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
    comes out 0.2 % too large), so in bf16 and fp16 the two lie within 2 ulps (tests/test_sglang.py).
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


def apply_fused_vision_to_sglang_gemma4(
    model: nn.Module | None = None,
    *,
    embedder: str | None = "patch_embed",
    pooler: bool = True,
    encoder: str = "stock",
    backend: str = "auto",
) -> int:
    """Put fused_vision's ops into SGLang's Gemma 4 vision tower (``sglang.srt.models.gemma4_vision``).

    The keywords, the return value and idempotence are ``fused_vision.apply_fused_vision_to_gemma4``'s.

    Args:
        model: None to patch SGLang's ``Gemma4VisionPatchEmbedder``, ``Gemma4VisionPooler`` and (where
            SGLang has it) ``EmbeddingGemma2VisionPooler`` classes, for every tower built from then on; or
            a module (SGLang's ``Gemma4ForConditionalGeneration``, ``EmbeddingGemma2Model``, their
            ``Gemma4VisionEncoder``, ...) whose instances of them to patch.
        embedder: ``"patch_embed"``, the whole embedder as ``fused_vision.patch_embed``;
            ``"position_embeddings"``, only the lookup: then the embedder's output is bit-identical to
            stock's; None leaves the embedder stock.
        pooler: the poolers as ``fused_vision.pool_by_positions``. ``Gemma4VisionPooler`` then rounds as
            transformers' pooler does, not as SGLang's (see ``_pooler_forward``);
            ``EmbeddingGemma2VisionPooler`` equals stock up to float32 summation order. False keeps
            SGLang's numerics bit for bit.
        encoder: "stock" leaves ``Gemma4VisionEncoder.forward`` stock; "packed" makes it strip each item's
            padding and attend within each item's real patches on every attention backend, FA3 and Triton
            included, which drop stock's padding mask (``fused_vision.sglang_packed``), with stock's outputs.
        backend: "auto", "triton" or "reference", for every patched op.

    Raises:
        ValueError: nothing selected, an unknown ``embedder``, ``encoder`` or backend, or ``model`` holds no
            module to patch.
        TypeError: ``model`` is neither None nor an ``nn.Module``.
        ImportError: SGLang or its Gemma 4 is missing.
    """
    vision = _sglang_vision()
    poolers = [(vision.Gemma4VisionPooler, _pooler_forward)]
    poolers += [(cls, _embedding_pooler_forward) for cls in _embedding_pooler_classes()]
    caller = "apply_fused_vision_to_sglang_gemma4"
    release = dict(onehot_lookup=stem.lookup_is_onehot(vision.Gemma4VisionPatchEmbedder), pooler_float32=False)
    if encoder not in ENCODERS:
        raise ValueError(f"encoder: expected one of {ENCODERS}, got {encoder!r}")
    encoder_target = None
    if encoder == "packed":
        state = stem.FusedOp("packed_encoder", backend, **release)
        encoder_target = sglang_packed.encoder_target(vision.Gemma4VisionEncoder, state)
    options = dict(embedder=embedder, pooler=pooler, backend=backend, encoder=encoder_target)
    targets = stem.tower_targets(caller, vision.Gemma4VisionPatchEmbedder, poolers, release, **options)
    hint = (
        "Pass SGLang's Gemma4ForConditionalGeneration, EmbeddingGemma2Model or Gemma4VisionEncoder (for "
        "transformers' Gemma 4, apply_fused_vision_to_gemma4), or call it with model=None before the model is built."
    )
    return patching.patch(caller, model, targets, hint)


def _is_sglang_class(cls: type) -> bool:
    return cls.__module__ in (SGLANG_MODULE, SGLANG_EMBEDDING_MODULE)


def revert_fused_vision_sglang_gemma4(model: nn.Module | None = None) -> int:
    """Undo ``apply_fused_vision_to_sglang_gemma4``, as ``fused_vision.revert_fused_vision_gemma4`` undoes
    transformers' patch: with ``model=None`` SGLang's classes and every instance patch; with a model, its
    modules. Returns the number of classes and instance patches undone, or of modules that were fused."""
    return patching.revert(model, _is_sglang_class)


def sglang_plugin() -> None:
    """SGLang's general-plugin hook (entry point group ``sglang.srt.plugins``), which SGLang runs in every
    process it starts, its schedulers included. Opt-in: patches SGLang's Gemma 4 classes only when
    FUSED_VISION_SGLANG=1."""
    if os.environ.get(ENV_SGLANG) != "1":
        return
    try:
        apply_fused_vision_to_sglang_gemma4()
    except ImportError as exc:
        logger.warning("fused_vision: %s=1 but SGLang's Gemma 4 cannot be patched here (%s)", ENV_SGLANG, exc)
