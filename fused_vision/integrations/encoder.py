"""The packed and fused encoders as the forwards ``apply_fused_vision_to_gemma4`` patches into transformers'
``Gemma4VisionModel`` and ``Gemma4VisionEncoder``: each reads its module's state and hands the encoder
(``fused_vision.encoder``) its backend with the call; stock runs wherever the call is not one they take.
Details: docs/encoders.md.
"""

from __future__ import annotations

import functools
import inspect
import sys

import torch
from torch import nn

from .. import patching
from ..encoder import fused_layer, packed, padded
from ..encoder.attention import Packing, attention_supported
from ..encoder.packed import check_attention, count_items, encode, padded_batch

__all__ = ["encoder_forward", "encoder_target", "fused_backend", "packed_model_forward", "stock_output_class"]

# Keywords of Gemma4VisionModel.forward under which the packed forward still returns stock's outputs
_TOWER_PASSIVE_KWARGS = ("return_dict", "output_hidden_states", "output_attentions")
# Keywords the stock encoder's forward takes that change nothing the layers compute
_ENCODER_PASSIVE_KWARGS = ("output_hidden_states", "output_attentions", "return_dict", "use_cache")


def fused_backend(module: nn.Module) -> str | None:
    """The backend of the fused layers a patched tower or encoder runs; None where they run stock's."""
    return _backend_of(patching.fused_state(module))


def _backend_of(state) -> str | None:
    return state.backend if state is not None and state.op == "fused_encoder" else None


# ---- Gemma4VisionModel.forward ---------------------------------------------------------------------


@functools.cache
def stock_output_class(cls: type) -> type:
    """The ``ModelOutput`` class the stock ``cls.forward`` returns (5.5-5.9 and 5.10+ differ), told from its code."""
    from transformers.utils import ModelOutput

    stock = inspect.unwrap(patching.stock_attribute(cls, "forward"))
    module = sys.modules[cls.__module__]
    found = {getattr(module, name, None) for name in stock.__code__.co_names}
    outputs = [value for value in found if isinstance(value, type) and issubclass(value, ModelOutput)]
    if len(outputs) != 1:
        raise RuntimeError(f"encoder: cannot tell the output class of this {cls.__name__}.forward ({outputs})")
    return outputs[0]


def _packs(tower, pixel_values, pixel_position_ids, kwargs) -> bool:
    """Whether the packed forward returns exactly what stock would: padded (B, N, ·) tensors, no recorded
    hidden states or attentions, a ``ModelOutput`` back; else stock runs (and raises as it does)."""
    config = tower.config
    if any(name not in _TOWER_PASSIVE_KWARGS for name in kwargs) or kwargs.get("return_dict", True) is False:
        return False
    recorded = ("output_hidden_states", "output_attentions")
    if any(kwargs.get(name) or getattr(config, name, False) for name in recorded):
        return False
    if getattr(config, "return_dict", True) is False:
        return False
    return padded_batch(pixel_values, pixel_position_ids)


def encoder_target(tower_cls: type, model, state) -> patching.Target:
    """What ``encoder="packed"`` or ``"fused"`` patches: ``tower_cls.forward`` (``Gemma4VisionModel``'s),
    once every tower in ``model`` is known to be configured with an attention the packed encoder replaces;
    a fused tower's layers get their concatenated weights here."""
    stock_output_class(tower_cls)  # raises where the stock forward is not one this module knows
    towers = [m for m in model.modules() if isinstance(m, tower_cls)] if isinstance(model, nn.Module) else []
    for tower in towers:
        check_attention(tower.config)
    for tower in towers if state.op == "fused_encoder" else ():
        fused_layer.prepare(tower)
    return patching.Target(tower_cls, {"forward": packed_model_forward}, state)


def packed_model_forward(self, pixel_values, pixel_position_ids, **kwargs):
    """``Gemma4VisionModel.forward`` through the packed encoder: the padding stripped, the same outputs."""
    state = patching.fused_state(self)
    # Under torch.compile stock's padded forward runs (its encoder's layers fused where so patched): packing
    # reads the items' lengths on the host.
    packs = not torch.compiler.is_compiling() and _packs(self, pixel_values, pixel_position_ids, kwargs)
    if state is None or not packs:
        return patching.stock_method(self, "forward")(pixel_values, pixel_position_ids, **kwargs)
    check_attention(self.config)
    position_ids = list(pixel_position_ids)
    counts = count_items(position_ids, self.config.pooling_kernel_size, self.config.position_embedding_size)
    if not any(counts.real):  # nothing real: stock's own forward
        return patching.stock_method(self, "forward")(pixel_values, pixel_position_ids, **kwargs)
    output_class = stock_output_class(next(cls for cls in type(self).__mro__ if "forward" in cls.__dict__))
    tokens = encode(self, list(pixel_values), position_ids, state.pooler_float32, counts, _backend_of(state))
    return output_class(last_hidden_state=torch.cat(tokens))


# ---- Gemma4VisionEncoder.forward -------------------------------------------------------------------


def _padded_call(inputs_embeds, attention_mask, pixel_position_ids, kwargs) -> bool:
    """Whether the call is stock's padded batch: (B, N, D) rows, a (B, N) bool mask of the real ones, (B, N, 2)
    ids, and no keyword that changes what the layers compute."""
    return (
        isinstance(inputs_embeds, torch.Tensor)
        and inputs_embeds.dim() == 3
        and isinstance(attention_mask, torch.Tensor)
        and attention_mask.dtype == torch.bool
        and attention_mask.shape == inputs_embeds.shape[:2]
        and isinstance(pixel_position_ids, torch.Tensor)
        and pixel_position_ids.shape == (*inputs_embeds.shape[:2], 2)
        and all(name in _ENCODER_PASSIVE_KWARGS for name in kwargs)
    )


def encoder_forward(self, inputs_embeds, attention_mask, pixel_position_ids=None, **kwargs):
    """``Gemma4VisionEncoder.forward``, packed where the host may read the items' lengths, else padded (the
    fused layers where the encoder is fused); stock's output either way. Other calls run stock."""
    state = patching.fused_state(self)
    if (
        state is None
        or not _padded_call(inputs_embeds, attention_mask, pixel_position_ids, kwargs)
        or not attention_supported(self.config)
    ):
        return patching.stock_method(self, "forward")(inputs_embeds, attention_mask, pixel_position_ids, **kwargs)
    if padded.packs(self, attention_mask):
        lengths = attention_mask.sum(dim=1).tolist()
        rows, ids = inputs_embeds[attention_mask], pixel_position_ids[attention_mask]
        packing = Packing.of(lengths, rows.device)
        hidden_states = packed.scatter_rows(
            packed.run_packed(self, rows, ids, packing, _backend_of(state)), attention_mask
        )
    elif state.op == "fused_encoder":
        hidden_states = padded.padded_fused(self, inputs_embeds, attention_mask, pixel_position_ids, state.backend)
        hidden_states = hidden_states.view_as(inputs_embeds)
    else:
        return patching.stock_method(self, "forward")(inputs_embeds, attention_mask, pixel_position_ids, **kwargs)
    return fused_layer.modeling_of(self).BaseModelOutputWithPast(last_hidden_state=hidden_states)
