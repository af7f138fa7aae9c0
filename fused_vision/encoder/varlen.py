"""Attention within each item of a packed sequence: the kernels that compute it, and the one a call takes.

Every path computes exact attention of (T, H, d) queries, keys and values within the items ``cu_seqlens``
delimits, with the layer's own scale. ``attention_path`` takes the first of ``AUTO_ORDER`` that is
installed and takes the inputs; ``FUSED_VISION_ATTENTION`` names one to take first. The paths, and why
the order is what it is (measured per device by bench/tools/attention_paths.py): docs/encoders.md.

    flash_attn_3     FlashAttention-3 (``flash_attn_interface``): sm90, fp16/bf16, head_dim % 8 == 0, <= 256, no dropout
    flash_attn_4     FlashAttention-4 (``flash_attn.cute``): sm90 and sm100, the same, head_dim <= 128, no dropout
    vllm_flash_attn  vLLM's own build (vLLM does not install flash-attn): its FlashAttention-3 on sm90 where it
                     has one, else its FlashAttention-2; CUDA sm80+, head_dim % 8 == 0, <= 256
    flash_attn       flash-attn's ``flash_attn_varlen_func`` (FlashAttention-2): sm80+ or ROCm, the same limits
    torch_varlen     ``torch.nn.attention.varlen.varlen_attn`` (torch 2.10+, FlashAttention-2): the same, no dropout
    cudnn            cuDNN's ragged attention (``aten._cudnn_attention_forward``): sm90+, head_dim <= 128, no
                     dropout; by request until a GPU run measures it faster
    flex             FlexAttention with a document mask, compiled on CUDA (eager, and slow, elsewhere); no
                     dropout; by request
    sdpa             ``F.scaled_dot_product_attention``, one call per run of equal-length items: every input
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import itertools
import logging
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from .._dispatch import warn_once
from .._environment import choice

logger = logging.getLogger("fused_vision")

__all__ = ["AUTO_ORDER", "ENV_ATTENTION", "PATHS", "AttentionPath", "attention_path", "usable", "varlen_attention"]

ENV_ATTENTION = "FUSED_VISION_ATTENTION"
_HALF_DTYPES = (torch.float16, torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class AttentionPath:
    """One way to compute the packed attention: ``load()`` its function, None where it is not installed;
    ``takes(query)`` whether its kernels take such queries; ``run(function, query, key, value, cu_seqlens,
    lengths, longest, scale, dropout)`` the (T, H, d) output; ``dropout`` whether it takes dropout."""

    load: Callable[[], Callable | None]
    takes: Callable[[torch.Tensor], bool]
    run: Callable[..., torch.Tensor]
    dropout: bool = False


def _importer(module: str, name: str) -> Callable[[], Callable | None]:
    """A cached loader of ``module.name``, None where the module or its compiled kernels are missing."""

    @functools.cache
    def load():
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, OSError):
            return None

    return load


@functools.cache
def _torch_varlen():
    """torch's ``varlen_attn`` (2.10+) where this build has its flash kernels, else None."""
    varlen = _importer("torch.nn.attention.varlen", "varlen_attn")()
    return varlen if varlen is not None and torch.backends.cuda.is_flash_attention_available() else None


@functools.cache
def _cudnn_ragged():
    """aten's cuDNN attention where it takes cumulative sequence lengths (torch 2.8+) and cuDNN is here."""
    op = getattr(torch.ops.aten, "_cudnn_attention_forward", None)
    if op is None or "cum_seq_q" not in str(op.default._schema) or not torch.backends.cudnn.is_available():
        return None
    return op.default


@functools.cache
def _flex():
    """FlexAttention and its block-mask builder, its compiled form for CUDA inputs; None before torch 2.5."""
    try:
        module = importlib.import_module("torch.nn.attention.flex_attention")
    except ImportError:
        return None
    return module.flex_attention, torch.compile(module.flex_attention, dynamic=False), module.create_block_mask


def _capability(query: torch.Tensor) -> tuple[int, int]:
    return torch.cuda.get_device_capability(query.device)


def _flash_inputs(query: torch.Tensor, max_head_dim: int) -> bool:
    """CUDA fp16 or bf16 queries of a head size flash kernels are built for (multiples of 8)."""
    head_dim = query.shape[-1]
    sized = head_dim % 8 == 0 and head_dim <= max_head_dim
    return query.device.type == "cuda" and query.dtype in _HALF_DTYPES and sized


def _nvidia(query: torch.Tensor, minimum: tuple[int, int]) -> bool:
    return torch.version.hip is None and _capability(query) >= minimum


def _takes_flash_2(query):  # flash-attn and torch build their own kernels for ROCm too
    return _flash_inputs(query, 256) and (torch.version.hip is not None or _capability(query) >= (8, 0))


def _takes_flash_3(query):
    return _flash_inputs(query, 256) and _nvidia(query, (9, 0)) and _capability(query)[0] == 9


def _takes_flash_4(query):
    return _flash_inputs(query, 128) and _nvidia(query, (9, 0)) and _capability(query)[0] in (9, 10)


def _takes_vllm_flash(query):  # vLLM builds its flash attention for CUDA only
    return _flash_inputs(query, 256) and _nvidia(query, (8, 0))


def _takes_cudnn(query):
    return _flash_inputs(query, 128) and _nvidia(query, (9, 0))


def _output(result) -> torch.Tensor:
    """The output of a flash-attention call: some releases return (output, logsumexp, ...)."""
    return result[0] if isinstance(result, tuple) else result


def _run_flash(function, query, key, value, cu_seqlens, lengths, longest, scale, dropout, **options):
    """FlashAttention 2, 3 or 4's ``flash_attn_varlen_func``, by keyword: vLLM's orders them otherwise."""
    items = {"cu_seqlens_q": cu_seqlens, "cu_seqlens_k": cu_seqlens, "max_seqlen_q": longest, "max_seqlen_k": longest}
    if dropout:  # FlashAttention-3 and 4 take no dropout_p
        options["dropout_p"] = dropout
    return _output(function(query, key, value, **items, softmax_scale=scale, **options))


def _run_vllm_flash(function, query, key, value, cu_seqlens, lengths, longest, scale, dropout):
    """vLLM's build: its FlashAttention-3 on sm90 where it has one (its default is 2), without dropout."""
    version = 3 if not dropout and _capability(query)[0] == 9 and _vllm_fa3_supported(query.device) else 2
    return _run_flash(function, query, key, value, cu_seqlens, lengths, longest, scale, dropout, fa_version=version)


@functools.cache
def _vllm_fa3_supported(device: torch.device) -> bool:
    supported = _importer("vllm.vllm_flash_attn", "is_fa_version_supported")()
    return supported is not None and bool(supported(3, device))


def _run_torch_varlen(function, query, key, value, cu_seqlens, lengths, longest, scale, dropout):
    return function(query, key, value, cu_seqlens, cu_seqlens, longest, longest, scale=scale)


def _run_cudnn(function, query, key, value, cu_seqlens, lengths, longest, scale, dropout):
    return function(query, key, value, None, cu_seqlens, cu_seqlens, longest, longest, False, scale=scale)[0]


def _document_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Each of ``total`` packed rows' item index, on the device (no host read)."""
    rows = torch.arange(total, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens[1:], rows, right=True)


def _run_flex(function, query, key, value, cu_seqlens, lengths, longest, scale, dropout):
    eager, compiled, create_block_mask = function
    total = query.shape[0]
    documents = _document_ids(cu_seqlens, total)

    def same_item(batch, head, query_row, key_row):
        return documents[query_row] == documents[key_row]

    mask = create_block_mask(same_item, None, None, total, total, device=query.device)
    heads = [t.transpose(0, 1)[None] for t in (query, key, value)]  # (1, H, T, d)
    attend = compiled if query.device.type == "cuda" else eager
    return attend(*heads, block_mask=mask, scale=scale)[0].transpose(0, 1)


def _equal_runs(lengths: Sequence[int]) -> list[tuple[int, int, int]]:
    """(start row, items, length) of each run of consecutive items of one length, empty items left out."""
    start, runs = 0, []
    for length, run in itertools.groupby(lengths):
        count = len(list(run))
        if length:
            runs.append((start, count, length))
        start += count * length
    return runs


def _run_sdpa(function, query, key, value, cu_seqlens, lengths, longest, scale, dropout):
    """One SDPA call per run of equal-length items, batched: each item attends to its own rows, no mask."""
    outputs = []
    for start, count, length in _equal_runs(lengths):
        rows = slice(start, start + count * length)
        heads = [t[rows].unflatten(0, (count, length)).transpose(1, 2) for t in (query, key, value)]  # (n, H, L, d)
        output = function(*heads, dropout_p=dropout, scale=scale)
        outputs.append(output.transpose(1, 2).flatten(0, 1))
    return torch.cat(outputs)


PATHS = {
    "flash_attn_3": AttentionPath(
        _importer("flash_attn_interface", "flash_attn_varlen_func"), _takes_flash_3, _run_flash
    ),
    "flash_attn_4": AttentionPath(_importer("flash_attn.cute", "flash_attn_varlen_func"), _takes_flash_4, _run_flash),
    "vllm_flash_attn": AttentionPath(
        _importer("vllm.vllm_flash_attn", "flash_attn_varlen_func"), _takes_vllm_flash, _run_vllm_flash, dropout=True
    ),
    "flash_attn": AttentionPath(
        _importer("flash_attn", "flash_attn_varlen_func"), _takes_flash_2, _run_flash, dropout=True
    ),
    "torch_varlen": AttentionPath(_torch_varlen, _takes_flash_2, _run_torch_varlen),
    "cudnn": AttentionPath(_cudnn_ragged, _takes_cudnn, _run_cudnn),
    "flex": AttentionPath(_flex, lambda query: True, _run_flex),
    "sdpa": AttentionPath(lambda: F.scaled_dot_product_attention, lambda query: True, _run_sdpa, dropout=True),
}
# What a call takes unless FUSED_VISION_ATTENTION says otherwise: the newest FlashAttention first, sdpa last.
AUTO_ORDER = ("flash_attn_3", "flash_attn_4", "vllm_flash_attn", "flash_attn", "torch_varlen", "sdpa")


def usable(name: str, query: torch.Tensor, dropout: float = 0.0) -> bool:
    """Whether path ``name`` is installed and takes these (T, H, d) queries, and ``dropout``."""
    path = PATHS[name]
    return (path.dropout or not dropout) and path.takes(query) and path.load() is not None


def attention_path(query: torch.Tensor, dropout: float = 0.0) -> str:
    """The path ``varlen_attention`` takes for (T, H, d) queries: the one ``FUSED_VISION_ATTENTION`` names
    where it is installed and takes them (else a warning, once), otherwise the first of ``AUTO_ORDER`` that is."""
    requested = choice(ENV_ATTENTION, ("auto", *PATHS), "auto")
    if requested != "auto":
        if usable(requested, query, dropout):
            return requested
        inputs = f"{query.device.type} {query.dtype} queries of head_dim {query.shape[-1]}"
        warn_once(f"{ENV_ATTENTION}={requested}: not installed, or it takes no {inputs}: the first path that does", 2)
    name = next(name for name in AUTO_ORDER if usable(name, query, dropout))
    if name == "sdpa" and query.device.type == "cuda":
        warn_once(f"packed encoder: no varlen kernel for {query.dtype}, head_dim {query.shape[-1]}: sdpa", 2)
    return name


@functools.cache
def _log_path(path: str) -> None:
    logger.info("fused_vision: the packed attention runs %s", path)


def varlen_attention(query, key, value, cu_seqlens, lengths, max_seqlen, *, scale, dropout=0.0, path=None):
    """Attention within each item of a packed sequence: (T, H, d) query, key and value, items delimited by
    ``cu_seqlens`` (int32, (B + 1,)) whose ``lengths`` (ints) sum to T; returns (T, H, d).

    ``path`` forces one of ``PATHS`` (for tests and the benchmark); it must take the inputs.
    """
    path = path or attention_path(query, dropout)
    if path not in PATHS:
        raise ValueError(f"path: expected one of {', '.join(PATHS)}, got {path!r}")
    if dropout and not PATHS[path].dropout:
        raise ValueError(f"dropout: the {path} path takes none")
    _log_path(path)
    return PATHS[path].run(PATHS[path].load(), query, key, value, cu_seqlens, lengths, max_seqlen, scale, dropout)
