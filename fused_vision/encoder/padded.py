"""The encoder on the padded (B, N) batch engines (vLLM) hand ``Gemma4VisionEncoder.forward``.

``packs`` tells whether a call may run packed (``fused_vision.encoder.packed.run_packed``): the host may
read the items' lengths and no layer maps rows by their place. Elsewhere (torch.compile, CUDA-graph
capture, vLLM's LoRA layers, which map adapters per padded row) it stays padded: stock's code, or
``padded_fused``, the fused layers with each item's queries attending to its valid keys. The forward
that chooses is ``fused_vision.integrations.encoder.encoder_forward``. Details: docs/encoders.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import fused_layer

__all__ = ["packs", "padded_fused"]


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


def padded_fused(encoder, inputs_embeds, attention_mask, pixel_position_ids, backend) -> torch.Tensor:
    """The fused layers on the padded (B, N, D) batch, each item's queries attending to its valid keys."""

    def stock_kwargs():  # stock's (B, 1, N, N) mask, built only where a layer runs stock code
        mask = fused_layer.modeling_of(encoder).create_bidirectional_mask(
            config=encoder.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask
        )
        return dict(attention_mask=mask)

    rows, ids = inputs_embeds.flatten(0, 1), pixel_position_ids.flatten(0, 1)
    attend = attend_valid_keys(attention_mask)
    return fused_layer.run_layers(encoder, rows, ids, attend, attention_mask.shape, stock_kwargs, backend)


def attend_valid_keys(valid: torch.Tensor):
    """``attend`` for (B, N) padded rows: each item's queries attend to its valid keys (``valid``: (B, N)
    True where real), as stock's sdpa with its bidirectional mask."""
    mask = valid[:, None, None, :]

    def attend(query, key, value, *, scale, dropout):
        heads = [t.unflatten(0, valid.shape).transpose(1, 2) for t in (query, key, value)]  # (B, H, N, d)
        output = F.scaled_dot_product_attention(*heads, attn_mask=mask, dropout_p=dropout, scale=scale)
        return output.transpose(1, 2).flatten(0, 1)

    return attend
