"""Attention restricted to each item of a packed sequence, hooked into transformers' Gemma 4 vision layers.

The packed encoder (``fused_vision.packed``) runs the tower's own encoder and layers on one (1, T, D)
sequence of every item's real patches. Only the attention computation changes: transformers' layers look
it up in ``ALL_ATTENTION_FUNCTIONS`` under ``config._attn_implementation``, so for the duration of a packed
forward the tower's config names ``PACKED_ATTENTION``, registered there, and the layers pass the items'
boundaries (``cu_seq_lens_q``, int32, flash-attn's varlen layout) through their keyword arguments.

Paths, the first one that takes the inputs (``attention_path``):

    flash_attn       flash-attn's ``flash_attn_varlen_func``: CUDA sm80+, fp16/bf16, head_dim % 8 == 0, <= 256
    vllm_flash_attn  vLLM's own (``vllm.vllm_flash_attn``; vLLM does not install flash-attn): the same limits
    torch_varlen     ``torch.nn.attention.varlen.varlen_attn`` (torch 2.10+): the same limits, no dropout
    sdpa             ``F.scaled_dot_product_attention`` per item, no mask: every other device, dtype or shape

Each takes the layer's own scale (Gemma 4: 1.0, its q/k norms replace the 1/sqrt(d)). The path a process
takes is logged once (logger ``fused_vision``, INFO).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import sys
import threading

import torch
import torch.nn.functional as F

from ._dispatch import warn_once

logger = logging.getLogger("fused_vision")

__all__ = [
    "PACKED_ATTENTION",
    "SUPPORTED_ATTENTION",
    "attention_path",
    "attention_supported",
    "configured_attention",
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
    """Whether flash attention's varlen kernels take these queries: an sm80+ NVIDIA GPU, fp16 or bf16, and a
    head size they are built for."""
    if query.device.type != "cuda" or torch.version.hip is not None or query.dtype not in _HALF_DTYPES:
        return False
    head_dim = query.shape[-1]
    head_size_built = head_dim % 8 == 0 and head_dim <= _MAX_FLASH_HEAD_DIM
    return head_size_built and torch.cuda.get_device_capability(query.device) >= (8, 0)


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


def _packed_attention_forward(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, cu_seq_lens_q=None, **kwargs
):
    """transformers' attention-interface signature: (1, H, T, d) states in, ((1, T, H, d) output, None) out."""
    if cu_seq_lens_q is None:  # a stock forward on a config a packed forward switched: its mask is gone too
        raise RuntimeError(
            "fused_vision: a stock Gemma 4 vision forward ran on a config that a packed forward in another "
            "thread had switched to the packed attention; run them on towers with configs of their own"
        )
    modeling = sys.modules[type(module).__module__]
    key = modeling.repeat_kv(key, module.num_key_value_groups)
    value = modeling.repeat_kv(value, module.num_key_value_groups)
    if scaling is None:
        scaling = module.head_dim**-0.5
    lengths, max_seqlen = kwargs["fused_vision_lengths"], kwargs["max_length_q"]
    states = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, H, d)
    output = varlen_attention(*states, cu_seq_lens_q, lengths, max_seqlen, scale=scaling, dropout=dropout)
    return output[None], None


_LOCK = threading.Lock()
_SWITCHED: dict[int, list] = {}  # id(config) -> [the implementation it had, packed forwards running on it]


@functools.cache
def _register() -> None:
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(PACKED_ATTENTION, _packed_attention_forward)


@contextlib.contextmanager
def packed_attention(configs):
    """Every config of ``configs`` names ``PACKED_ATTENTION`` inside the block, and its own implementation
    again once the last packed forward on it returns (threads, e.g. ``nn.DataParallel`` replicas, share it)."""
    _register()
    configs = list({id(config): config for config in configs}.values())
    with _LOCK:
        for config in configs:
            entry = _SWITCHED.setdefault(id(config), [config._attn_implementation, 0])
            entry[1] += 1
            config._attn_implementation = PACKED_ATTENTION
    try:
        yield
    finally:
        with _LOCK:
            for config in configs:
                entry = _SWITCHED[id(config)]
                entry[1] -= 1
                if entry[1] == 0:
                    config._attn_implementation = entry[0]
                    del _SWITCHED[id(config)]
