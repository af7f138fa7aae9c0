"""Gemma 4's residual add between two RMS norms in one pass: h = residual + post_norm(x), y = next_norm(h).

Each program owns BLOCK_ROWS whole rows (both norms reduce over D) in fp32 registers. Values round to the
hidden dtype where stock's modules round them: post_norm's output before the add, h, and y.
"""

import torch
import triton
import triton.language as tl

from .common import TORCH_TO_TL, as_rows, interpreting, launcher, rms_inverse, round_to


@triton.jit
def _norm(x, weight, hidden_f, eps, DTYPE: tl.constexpr):
    """Gemma4RMSNorm on fp32 rows: ``x * pow(mean(x²) + eps, -0.5)``, then ``* weight``, rounded once."""
    inverse = rms_inverse(tl.sum(x * x, axis=1), hidden_f, eps)
    return round_to(x * inverse[:, None] * weight[None, :], DTYPE)


@triton.jit
def _residual_rms_norm_kernel(
    x_ptr,
    residual_ptr,
    post_weight_ptr,
    next_weight_ptr,
    h_ptr,
    y_ptr,
    num_rows,
    hidden,
    hidden_f,
    eps,
    stride_x,
    stride_residual,
    stride_post_weight,
    stride_next_weight,
    HAS_NEXT: tl.constexpr,
    DTYPE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # int64 rows: rows * D may exceed 2**31 elements.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_D)
    col_in = cols < hidden
    tile_in = (rows < num_rows)[:, None] & col_in[None, :]

    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=tile_in, other=0.0).to(tl.float32)
    residual = tl.load(residual_ptr + rows[:, None] * stride_residual + cols[None, :], mask=tile_in, other=0.0)
    post_weight = tl.load(post_weight_ptr + cols * stride_post_weight, mask=col_in, other=0.0).to(tl.float32)
    # Stock rounds post_norm's output to the hidden dtype, then adds it to the residual: one more rounding.
    normed = _norm(x, post_weight, hidden_f, eps, DTYPE).to(tl.float32)
    h = round_to(residual.to(tl.float32) + normed, DTYPE)
    out = rows[:, None] * hidden + cols[None, :]
    tl.store(h_ptr + out, h, mask=tile_in)
    if HAS_NEXT:
        next_weight = tl.load(next_weight_ptr + cols * stride_next_weight, mask=col_in, other=0.0).to(tl.float32)
        tl.store(y_ptr + out, _norm(h.to(tl.float32), next_weight, hidden_f, eps, DTYPE), mask=tile_in)


def launch_config(hidden: int, interpreted: bool) -> tuple[int, int, int]:
    """(BLOCK_ROWS, BLOCK_D, num_warps): whole rows; about 4096 values per program on a GPU (16 per thread at
    8 warps), and many rows per program under the interpreter, which pays per program."""
    block_d = triton.next_power_of_2(hidden)
    if interpreted:
        return max(1, 8192 // block_d), block_d, 1
    return max(1, 4096 // block_d), block_d, 8 if block_d >= 1024 else 4


@launcher
def residual_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    post_weight: torch.Tensor,
    next_weight: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch on already-validated inputs; returns new contiguous h and y (None without ``next_weight``)."""
    h = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y = None if next_weight is None else torch.empty_like(h)
    if h.numel() == 0:
        return h, y
    x_rows, residual_rows = as_rows(x), as_rows(residual)
    num_rows, hidden = x_rows.shape
    block_rows, block_d, num_warps = launch_config(hidden, interpreting())
    _residual_rms_norm_kernel[(triton.cdiv(num_rows, block_rows),)](
        x_rows,
        residual_rows,
        post_weight,
        post_weight if next_weight is None else next_weight,  # a pointer HAS_NEXT keeps from being read
        h,
        h if y is None else y,
        num_rows,
        hidden,
        float(hidden),
        eps,
        x_rows.stride(0),
        residual_rows.stride(0),
        post_weight.stride(0),
        (post_weight if next_weight is None else next_weight).stride(0),
        HAS_NEXT=next_weight is not None,
        DTYPE=TORCH_TO_TL[x.dtype],
        BLOCK_ROWS=block_rows,
        BLOCK_D=block_d,
        num_warps=num_warps,
        enable_fp_fusion=False,  # stock rounds post_norm's product before the residual add: no fma
    )
    return h, y
