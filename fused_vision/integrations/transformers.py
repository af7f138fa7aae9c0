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
from .stem import FusedOp, broadcast_rows, lookup_is_onehot, pooler_runs_fused, tower_targets

__all__ = ["ENCODERS", "apply_fused_vision_to_gemma4", "revert_fused_vision_gemma4"]

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
            SGLang builds a tower of its own: ``fused_vision.apply_fused_vision_to_sglang_gemma4``.
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
            run the packed encoder (``fused_vision.encoder.packed``), with stock's outputs; "fused" runs the packed
            encoder with fused layers (``fused_vision.encoder.fused_layer``: concatenated QKV and gate/up GEMMs,
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
    tower_target = None
    if encoder != "stock":
        state = FusedOp(f"{encoder}_encoder", backend, **release)
        tower_target = encoder_target(modeling.Gemma4VisionModel, model, state)
    embedder_cls, options = modeling.Gemma4VisionPatchEmbedder, dict(embedder=embedder, pooler=pooler, backend=backend)
    targets = tower_targets(caller, embedder_cls, poolers, release, **options, encoder=tower_target)
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
    joined_weights.release(model)  # the parameters own their storage again
    return undone
