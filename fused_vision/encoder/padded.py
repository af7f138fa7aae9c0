"""``Gemma4VisionEncoder.forward`` for ``encoder="packed"`` and ``"fused"``, on the padded batch it is handed.

Engines (vLLM) call the encoder on a padded (B, N) batch, never the tower's forward. Where the host may
read the items' lengths, the real rows run packed (``fused_vision.encoder.packed.run_packed``) and come
back as stock's (B, N, D), zeros at the padding. Elsewhere (torch.compile, CUDA-graph capture, vLLM's
LoRA layers, which map adapters per padded row) it stays padded: stock's code, or the fused layers with
each item's queries attending to its valid keys. Details: docs/encoders.md.
"""

from __future__ import annotations

import torch
from torch import nn

from ..integrations import patching
from . import fused_layer, packed
from .attention import Packing, attention_supported

__all__ = ["encoder_forward", "packs"]

# Keywords the stock encoder's forward takes that change nothing the layers compute
_ENCODER_PASSIVE_KWARGS = ("output_hidden_states", "output_attentions", "return_dict", "use_cache")


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


def _maps_rows_by_place(module: nn.Module) -> bool:
    """Whether the module computes a row by its place in the batch: vLLM's LoRA layers (punica's mapping of
    adapters to tokens follows the padded batch)."""
    classes = type(module).__mro__
    return any(cls.__name__ == "BaseLayerWithLoRA" and cls.__module__.startswith("vllm.") for cls in classes)


def packs(encoder: nn.Module, attention_mask: torch.Tensor) -> bool:
    """Whether a call on this padded batch runs packed: the host may read the mask, no layer maps rows by
    their place or records its outputs, and some row is real."""
    if not fused_layer.may_read_on_host(attention_mask):
        return False
    layers = encoder.layers[: encoder.config.num_hidden_layers]
    if any(_maps_rows_by_place(module) or fused_layer.records_outputs(module) for module in layers.modules()):
        return False
    return bool(attention_mask.any())


def _padded_fused(encoder, inputs_embeds, attention_mask, pixel_position_ids, backend) -> torch.Tensor:
    """The fused layers on the padded (B, N, D) batch, each item's queries attending to its valid keys."""

    def stock_kwargs():  # stock's (B, 1, N, N) mask, built only where a layer runs stock code
        mask = fused_layer.modeling_of(encoder).create_bidirectional_mask(
            config=encoder.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask
        )
        return dict(attention_mask=mask)

    rows, ids = inputs_embeds.flatten(0, 1), pixel_position_ids.flatten(0, 1)
    attend = fused_layer.attend_valid_keys(attention_mask)
    return fused_layer.run_layers(encoder, rows, ids, attend, attention_mask.shape, stock_kwargs, backend)


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
    if packs(self, attention_mask):
        lengths = attention_mask.sum(dim=1).tolist()
        backend = state.backend if state.op == "fused_encoder" else None
        rows, ids = inputs_embeds[attention_mask], pixel_position_ids[attention_mask]
        packing = Packing.of(lengths, rows.device)
        hidden_states = packed.scatter_rows(packed.run_packed(self, rows, ids, packing, backend), attention_mask)
    elif state.op == "fused_encoder":
        hidden_states = _padded_fused(self, inputs_embeds, attention_mask, pixel_position_ids, state.backend)
        hidden_states = hidden_states.view_as(inputs_embeds)
    else:
        return patching.stock_method(self, "forward")(inputs_embeds, attention_mask, pixel_position_ids, **kwargs)
    return fused_layer.modeling_of(self).BaseModelOutputWithPast(last_hidden_state=hidden_states)
