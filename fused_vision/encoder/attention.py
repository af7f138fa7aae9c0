"""Attention within each item of a packed sequence, hooked into transformers' Gemma 4 vision layers.

The packed encoder hands each layer the items' ``Packing`` (``cu_seqlens``, lengths, the longest) as its
``attention_mask``; ``install`` patches ``Gemma4VisionAttention.forward`` to run stock's forward on a view
of the module made for that call, whose config names ``PACKED_ATTENTION``. Why and how: docs/encoders.md.
The paths, the first that takes the inputs (``attention_path``), each with the layer's own scale, the one
a process takes logged once (logger ``fused_vision``, INFO):

    flash_attn       flash-attn's ``flash_attn_varlen_func``: CUDA sm80+ or ROCm, fp16/bf16, head_dim % 8 == 0, <= 256
    vllm_flash_attn  vLLM's own (``vllm.vllm_flash_attn``; vLLM does not install flash-attn): the same limits
    torch_varlen     ``torch.nn.attention.varlen.varlen_attn`` (torch 2.10+): the same limits, no dropout
    sdpa             ``F.scaled_dot_product_attention`` per item, no mask: every other device, dtype or shape
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import itertools
import logging
import sys
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .. import _releases
from .._dispatch import warn_once
from ..integrations import patching

logger = logging.getLogger("fused_vision")

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
_HALF_DTYPES = (torch.float16, torch.bfloat16)
_MAX_FLASH_HEAD_DIM = 256


def configured_attention(config) -> str | None:
    """The config's attention implementation, as the kernel it computes with (paged variants as their base)."""
    attention = getattr(config, "_attn_implementation", None)
    return attention.removeprefix("paged|") if isinstance(attention, str) else attention


def attention_supported(config) -> bool:
    """Whether the packed encoder (and the fused layers' attention) computes what the config's attention
    implementation does."""
    attention = configured_attention(config)
    return attention is None or attention in SUPPORTED_ATTENTION


@functools.cache
def _flash_attn_varlen():
    """flash-attn's ``flash_attn_varlen_func``, or None where the package is not importable."""
    try:
        return importlib.import_module("flash_attn").flash_attn_varlen_func
    except (ImportError, AttributeError):
        return None


@functools.cache
def _vllm_flash_attn_varlen():
    """vLLM's own ``flash_attn_varlen_func``, or None where vLLM or its CUDA flash-attention build is missing."""
    try:
        return importlib.import_module("vllm.vllm_flash_attn").flash_attn_varlen_func
    except (ImportError, AttributeError, OSError):
        return None


@functools.cache
def _log_path(path: str) -> None:
    logger.info("fused_vision: the packed attention runs %s", path)


@functools.cache
def _torch_varlen():
    """torch's ``varlen_attn`` (2.10+) where this build has its flash kernels, else None."""
    try:
        varlen = importlib.import_module("torch.nn.attention.varlen").varlen_attn
    except (ImportError, AttributeError):
        return None
    return varlen if torch.backends.cuda.is_flash_attention_available() else None


def _flash_kernels_take(query: torch.Tensor) -> bool:
    """Whether flash attention's varlen kernels take these queries: an sm80+ NVIDIA GPU or a ROCm one (its
    flash-attn and torch builds carry their own kernels), fp16 or bf16, and a head size they are built for."""
    if query.device.type != "cuda" or query.dtype not in _HALF_DTYPES:
        return False
    head_dim = query.shape[-1]
    head_size_built = head_dim % 8 == 0 and head_dim <= _MAX_FLASH_HEAD_DIM
    rocm = torch.version.hip is not None
    return head_size_built and (rocm or torch.cuda.get_device_capability(query.device) >= (8, 0))


def attention_path(query: torch.Tensor, dropout: float = 0.0) -> str:
    """The path ``varlen_attention`` takes for (T, H, d) queries: "flash_attn", "vllm_flash_attn",
    "torch_varlen" or "sdpa"."""
    if _flash_kernels_take(query):
        if _flash_attn_varlen() is not None:
            return "flash_attn"
        if _vllm_flash_attn_varlen() is not None:
            return "vllm_flash_attn"
        if _torch_varlen() is not None and dropout == 0.0:
            return "torch_varlen"
    if query.device.type == "cuda":
        warn_once(
            f"packed encoder: no varlen kernel for {query.dtype}, head_dim {query.shape[-1]}: attention per item", 2
        )
    return "sdpa"


def varlen_attention(query, key, value, cu_seqlens, lengths, max_seqlen, *, scale, dropout=0.0, path=None):
    """Attention within each item of a packed sequence: (T, H, d) query, key and value, items delimited by
    ``cu_seqlens`` (int32, (B + 1,)) whose ``lengths`` (ints) sum to T; returns (T, H, d).

    ``path`` forces one of ``attention_path``'s (for tests); it must take the inputs.
    """
    path = path or attention_path(query, dropout)
    _log_path(path)
    if path == "flash_attn":
        return _flash_attn_varlen()(
            query, key, value, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p=dropout, softmax_scale=scale
        )
    if path == "vllm_flash_attn":  # its own argument order: max_seqlen_q before cu_seqlens_q
        return _vllm_flash_attn_varlen()(
            query, key, value, max_seqlen, cu_seqlens, max_seqlen, cu_seqlens, dropout_p=dropout, softmax_scale=scale
        )
    if path == "torch_varlen":
        if dropout:
            raise ValueError("dropout: torch's varlen_attn takes none")
        return _torch_varlen()(query, key, value, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scale=scale)
    if path != "sdpa":
        raise ValueError(f"path: expected 'flash_attn', 'vllm_flash_attn', 'torch_varlen' or 'sdpa', got {path!r}")
    # (H, T, d) views; each item attends to its own patches only, so no mask is needed
    query, key, value = (t.transpose(0, 1) for t in (query, key, value))
    outputs, start = [], 0
    for length in lengths:
        end = start + length
        if length:
            item = (t[None, :, start:end] for t in (query, key, value))
            outputs.append(F.scaled_dot_product_attention(*item, dropout_p=dropout, scale=scale)[0])
        start = end
    return torch.cat(outputs, dim=1).transpose(0, 1)


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
