"""The items of a packed sequence, handed to transformers' own layers with the call itself.

A packed forward runs every item's real patches as one (1, T, D) sequence. Its stock layers must attend
within each item; what tells them so travels with the call, never in a config or a global:

    sdpa (transformers' default)   the layers' ``attention_mask`` is a ``PackedMask``: a tensor holding no
                                   (T, T) values whose ``F.scaled_dot_product_attention`` runs
                                   ``fused_vision.attention.varlen_attention`` on the items
    eager                          the block-diagonal additive mask itself (eager holds (T, T) scores anyway)
    flash_attention_2/3/4          no mask, the items' boundaries as transformers' packed-sequence keywords
                                   (``cu_seq_lens_q``/``_k``, ``max_length_q``/``_k``), which those kernels read
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from . import attention

__all__ = ["PackedMask", "Packing", "stock_layer_kwargs"]


@dataclasses.dataclass(frozen=True)
class Packing:
    """The items of a packed sequence: their int32 offsets (flash-attn's ``cu_seqlens``, (B + 1,)), their
    lengths and the longest."""

    cu_seqlens: torch.Tensor
    lengths: tuple[int, ...]

    @classmethod
    def of(cls, lengths, device) -> Packing:
        lengths = tuple(int(length) for length in lengths)
        offsets = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(torch.int32)
        return cls(offsets.to(device), lengths)

    @property
    def longest(self) -> int:
        return max(self.lengths, default=0)

    def attend(self, query, key, value, *, scale, dropout=0.0):
        """Attention within each item on (T, H, d) heads."""
        offsets, lengths, longest = self.cu_seqlens, self.lengths, self.longest
        return attention.varlen_attention(query, key, value, offsets, lengths, longest, scale=scale, dropout=dropout)


class PackedMask(torch.Tensor):
    """An sdpa attention mask standing for a packed sequence's block-diagonal one, without its values: the
    ``F.scaled_dot_product_attention`` it is handed to runs on each item alone. Any other use raises."""

    packing: Packing

    @staticmethod
    def __new__(cls, packing: Packing):
        mask = torch.Tensor._make_subclass(cls, torch.empty(0, dtype=torch.bool, device=packing.cu_seqlens.device))
        mask.packing = packing
        return mask

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is F.scaled_dot_product_attention:
            return _attend_packed(*args, **kwargs)
        if func in (torch.Tensor.__repr__, torch.Tensor.__format__, torch.Tensor.__reduce_ex__):
            return f"PackedMask(items={len(args[0].packing.lengths)})"
        if func in (torch.Tensor.device.__get__, torch.Tensor.dtype.__get__):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        raise TypeError(f"PackedMask: a packed sequence's mask for F.scaled_dot_product_attention only, not {func}")


def _attend_packed(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """sdpa's (1, H, T, d) heads attending within each item of ``attn_mask.packing``."""
    if is_causal or query.shape[0] != 1:
        raise ValueError("PackedMask: a packed sequence is one bidirectional batch row")
    if enable_gqa and key.shape[1] != query.shape[1]:
        key, value = (t.repeat_interleave(query.shape[1] // t.shape[1], dim=1) for t in (key, value))
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    heads = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, H, d)
    return attn_mask.packing.attend(*heads, scale=scale, dropout=dropout_p).transpose(0, 1)[None]


def _block_diagonal_mask(packing: Packing, dtype) -> torch.Tensor:
    """The (1, 1, T, T) additive mask of attention within each item, for eager attention."""
    lengths = torch.tensor(packing.lengths, device=packing.cu_seqlens.device)
    item = torch.repeat_interleave(torch.arange(len(packing.lengths), device=lengths.device), lengths)
    blocked = item[:, None] != item[None, :]
    return torch.zeros(blocked.shape, dtype=dtype, device=lengths.device).masked_fill(blocked, torch.finfo(dtype).min)[
        None, None
    ]


def stock_layer_kwargs(config, packing: Packing, dtype) -> dict:
    """The keywords under which transformers' layers of a tower configured so attend within each item."""
    implementation = attention.configured_attention(config)
    if implementation in (None, "sdpa"):
        return dict(attention_mask=PackedMask(packing))
    if implementation == "eager":
        return dict(attention_mask=_block_diagonal_mask(packing, dtype))
    longest = packing.longest
    return dict(
        attention_mask=None,
        cu_seq_lens_q=packing.cu_seqlens,
        cu_seq_lens_k=packing.cu_seqlens,
        max_length_q=longest,
        max_length_k=longest,
    )
