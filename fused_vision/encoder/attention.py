"""Attention within each item of a packed sequence, hooked into transformers' Gemma 4 vision layers.

The packed encoder hands each layer the items' ``Packing`` (``cu_seqlens``, lengths, the longest) as its
``attention_mask``; ``install`` patches ``Gemma4VisionAttention.forward`` to run stock's forward on a view
of the module made for that call, whose config names ``PACKED_ATTENTION``. Why and how: docs/encoders.md.
The attention itself, and the kernel each call takes: ``fused_vision.encoder.varlen``.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
from collections.abc import Sequence

import torch

from .. import _releases, patching
from .varlen import attention_path, varlen_attention

__all__ = [
    "PACKED_ATTENTION",
    "SUPPORTED_ATTENTION",
    "Packing",
    "attention_path",
    "attention_supported",
    "configured_attention",
    "install",
    "varlen_attention",
]

PACKED_ATTENTION = "fused_vision_packed"
# What a tower may be configured with for the packed encoder: the kernels it replaces compute the same
# attention (flex and other registered functions may carry score or mask modifications it would drop).
SUPPORTED_ATTENTION = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flash_attention_4")


def configured_attention(config) -> str | None:
    """The config's attention implementation, as the kernel it computes with (paged variants as their base)."""
    attention = getattr(config, "_attn_implementation", None)
    return attention.removeprefix("paged|") if isinstance(attention, str) else attention


def attention_supported(config) -> bool:
    """Whether the packed encoder (and the fused layers' attention) computes what the config's attention
    implementation does."""
    attention = configured_attention(config)
    return attention is None or attention in SUPPORTED_ATTENTION


@dataclasses.dataclass(frozen=True, eq=False)
class Packing:
    """The items of a packed sequence, as each attention call over it needs them: ``cu_seqlens`` (int32,
    (B + 1,)), each item's length (they sum to T) and the longest. Never changed once made; it lives as
    long as the calls, and the checkpointed replays, that hold it."""

    cu_seqlens: torch.Tensor
    lengths: tuple[int, ...]
    longest: int

    @classmethod
    def of(cls, lengths: Sequence[int], device) -> Packing:
        """The packing of items of ``lengths`` real patches, in that order, its offsets on ``device``."""
        lengths = tuple(int(length) for length in lengths)
        offsets = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
        if torch.device(device).type == "cuda":  # from pinned memory, queued: a pageable copy would sync
            return cls(offsets.pin_memory().to(device, non_blocking=True), lengths, max(lengths))
        return cls(offsets.to(device), lengths, max(lengths))

    def attend(self, query, key, value, *, scale, dropout=0.0):
        """``varlen_attention`` within these items, on (T, H, d) heads."""
        return varlen_attention(
            query, key, value, self.cu_seqlens, self.lengths, self.longest, scale=scale, dropout=dropout
        )


def _packed_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' attention-interface signature, ``attention_mask`` the ``Packing``: (1, H, T, d) states
    in, ((1, T, H, d) output, None) out."""
    modeling = sys.modules[type(module).__module__]
    key = modeling.repeat_kv(key, module.num_key_value_groups)
    value = modeling.repeat_kv(value, module.num_key_value_groups)
    if scaling is None:
        scaling = module.head_dim**-0.5
    states = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, H, d)
    return attention_mask.attend(*states, scale=scaling, dropout=dropout)[None], None


class _PackedConfig:
    """A layer's config as one packed call reads it: its own, but naming the packed attention."""

    _attn_implementation = PACKED_ATTENTION

    def __init__(self, config):
        self._config = config

    def __getattr__(self, name):
        return getattr(self._config, name)


def _attention_forward(self, *args, **kwargs):
    """``Gemma4VisionAttention.forward``: stock's, on a view of the module whose config names the packed
    attention where the call's mask is a ``Packing``."""
    if any(isinstance(value, Packing) for value in (*args, *kwargs.values())):
        self = patching.call_view(self, config=_PackedConfig(self.config))
    return patching.stock_method(self, "forward")(*args, **kwargs)


def install() -> None:
    """Register the packed attention and patch ``Gemma4VisionAttention.forward`` (stock's for every call
    without a ``Packing``): once, and again after ``revert_fused_vision_gemma4()`` restored the class."""
    attention_cls = _releases.modeling().Gemma4VisionAttention
    if attention_cls.__dict__.get("forward") is _attention_forward:
        return
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(PACKED_ATTENTION, _packed_attention_forward)
    patching.install_methods(attention_cls, {"forward": _attention_forward})
