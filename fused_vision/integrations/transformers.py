"""fused_vision inside transformers' Gemma 4 vision tower: ``apply_fused_vision_to_gemma4`` and its revert.

The embedder's forwards are ``fused_vision.integrations.stem``'s, shared with SGLang; the pooler's forward
and the release family (5.5-5.9 or 5.10+, told from the stock code) are here. Keywords, families,
fallbacks and training: docs/transformers.md; the encoders: docs/encoders.md.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from .. import _releases, patching
from ..encoder import joined_weights
from ..ops.pool_by_positions import pool_by_positions as _fused_pool_by_positions
from .encoder import encoder_forward, encoder_target
from .stem import FusedOp, broadcast_rows, check_keywords, lookup_is_onehot, pooler_runs_fused, tower_targets

__all__ = ["ENCODERS", "apply_fused_vision_to_gemma4", "gemma4_targets", "revert_fused_vision_gemma4"]

# What ``encoder=`` takes: stock's padded encoder, the packed one (``encoder.packed``), or the packed one
# with fused layers (``encoder.fused_layer``).
ENCODERS = ("stock", "packed", "fused")


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


@functools.cache
def onehot_lookup() -> bool:
    """Whether transformers' stock lookup is the one-hot matmul of 5.5-5.9."""
    return lookup_is_onehot(_releases.modeling().Gemma4VisionPatchEmbedder)


# ---- the pooler's patched method -------------------------------------------------------------------


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


def gemma4_targets(model: nn.Module | None, *, embedder, pooler, encoder, backend) -> list[patching.Target]:
    """What ``apply_fused_vision_to_gemma4`` patches for these keywords, checked before: transformers'
    embedder and pooler classes, and with a packed or fused encoder ``Gemma4VisionModel`` and
    ``Gemma4VisionEncoder``, whose towers in ``model`` get their concatenated weights here. vLLM's
    ``apply_…`` patches them too, for the tower vLLM builds."""
    modeling = _releases.modeling()
    release = dict(onehot_lookup=onehot_lookup(), pooler_float32=pooler_returns_float32())
    tower_target = None
    if encoder != "stock":
        state = FusedOp(f"{encoder}_encoder", backend, **release)
        tower_target = encoder_target(modeling.Gemma4VisionModel, model, state)
    poolers = [(modeling.Gemma4VisionPooler, _pooler_forward)]
    options = dict(embedder=embedder, pooler=pooler, backend=backend, encoder=tower_target)
    targets = tower_targets(modeling.Gemma4VisionPatchEmbedder, poolers, release, **options)
    if encoder != "stock":  # the encoder's own forward too: for its direct callers (vLLM) and torch.compile
        targets.append(patching.Target(modeling.Gemma4VisionEncoder, {"forward": encoder_forward}, state))
    return targets


def apply_fused_vision_to_gemma4(
    model: nn.Module | None = None,
    *,
    embedder: str | None = "patch_embed",
    pooler: bool = True,
    encoder: str = "stock",
    backend: str = "auto",
) -> int:
    """Put fused_vision's ops into transformers' Gemma 4 vision tower.

    The keywords, the return value, idempotence and the errors are those every engine's ``apply_…`` shares
    (docs/integrations.md). Here:

    - ``model=None`` patches transformers' ``Gemma4VisionPatchEmbedder`` and ``Gemma4VisionPooler`` (and,
      for a packed or fused encoder, ``Gemma4VisionModel`` and ``Gemma4VisionEncoder``): towers built later
      by ``from_pretrained`` or by vLLM's ``AutoModel.from_config`` included. A module is a
      ``Gemma4ForConditionalGeneration``, ``Gemma4Model``, ``Gemma4VisionModel``, or anything holding
      those classes, such as ``EmbeddingGemma2Model`` and DiffusionGemma's models, which build the same
      tower. SGLang builds a tower of its own: ``fused_vision.apply_fused_vision_to_sglang_gemma4``.
    - ``embedder``: either op also makes the embedder's ``_position_embeddings`` method the fused lookup,
      bit-identical: vLLM 0.34+ runs its own projection and calls that method alone.
    - ``encoder``: "packed" makes ``Gemma4VisionModel.forward`` strip the padding and run the packed
      encoder (``fused_vision.encoder.packed``), with stock's outputs; "fused" runs it with fused layers
      (``fused_vision.encoder.fused_layer``: concatenated QKV and gate/up GEMMs, whose weights the
      parameters then view, and the layer kernels), and makes ``Gemma4VisionEncoder.forward`` run them on
      its padded batch (under torch.compile the tower's forward runs padded). Both need sdpa, eager or
      flash attention configured; ``encode_images`` on a tower patched so runs the same encoder.

    Raises:
        ValueError: as every ``apply_…``; also a packed or fused tower configured with another attention
            implementation, and a ``model`` with no module to patch (e.g. ``gemma4_unified`` checkpoints,
            which have no vision tower).
        TypeError: ``model`` is neither None nor an ``nn.Module``.
        ImportError: transformers or its Gemma 4 is missing.
    """
    caller = "apply_fused_vision_to_gemma4"
    keywords = dict(embedder=embedder, pooler=pooler, encoder=encoder, backend=backend)
    check_keywords(caller, model, **keywords, encoders=ENCODERS)
    targets = gemma4_targets(model, **keywords)
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
    """Undo ``apply_fused_vision_to_gemma4`` as every ``revert_…`` undoes its ``apply_…``
    (docs/integrations.md): ``model=None``, transformers' Gemma 4 classes and every instance patch of them;
    a model, its modules of those classes. The fused encoder's parameters own their storage again."""
    undone = patching.revert(model, _is_transformers_class)
    joined_weights.release(model)  # the parameters own their storage again
    return undone
