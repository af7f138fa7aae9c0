"""Gemma 4's residual add between two RMS norms in one pass: h = residual + post_norm(x), y = next_norm(h).

Each program owns ROWS whole rows (both norms reduce over D), one at a time in fp32 registers, and reads
the two weights once. A row is cut into a power-of-two main part and a tail (1152 = 1024 + 128,
768 = 512 + 256), so no lane holds a column past D. Values round to the hidden dtype where stock's
modules round them: post_norm's output before the add, h, and y.
"""

import torch
import triton
import triton.language as tl

from .common import (
    TORCH_TO_TL,
    as_rows,
    interpreting,
    launcher,
    load_part,
    offset_dtype,
    rms_inverse,
    round_to,
    row_parts,
    store_part,
)


@triton.jit
def _norm(x_main, x_tail, w_main, w_tail, eps, HIDDEN: tl.constexpr, TAIL: tl.constexpr, DTYPE: tl.constexpr):
    """Gemma4RMSNorm on an fp32 row cut in two: ``x * pow(mean(x²) + eps, -0.5)``, then ``* weight``, rounded."""
    sum_squares = tl.sum(x_main * x_main, axis=0)
    if TAIL > 0:
        sum_squares += tl.sum(x_tail * x_tail, axis=0)
    inverse = rms_inverse(sum_squares, HIDDEN, eps)
    y_main = round_to(x_main * inverse * w_main, DTYPE)
    y_tail = y_main
    if TAIL > 0:
        y_tail = round_to(x_tail * inverse * w_tail, DTYPE)
    return y_main, y_tail


@triton.jit
def _residual_rms_norm_kernel(
    x_ptr,
    residual_ptr,
    post_weight_ptr,
    next_weight_ptr,
    h_ptr,
    y_ptr,
    num_rows,
    eps,
    stride_x,
    stride_residual,
    stride_post_weight,
    stride_next_weight,
    HIDDEN: tl.constexpr,
    MAIN: tl.constexpr,
    TAIL: tl.constexpr,
    MASK_TAIL: tl.constexpr,
    HAS_NEXT: tl.constexpr,
    DTYPE: tl.constexpr,
    OFFSETS: tl.constexpr,
    ROWS: tl.constexpr,
):
    # A row a block, as 1-D parts whose sums are scalars: the two parts never meet in one layout.
    main = tl.arange(0, MAIN)
    post_main = tl.load(post_weight_ptr + main * stride_post_weight).to(tl.float32)
    next_main = tl.load(next_weight_ptr + main * stride_next_weight).to(tl.float32)
    post_tail, next_tail = post_main, next_main
    if TAIL > 0:
        tail = MAIN + tl.arange(0, TAIL)
        post_tail = load_part(post_weight_ptr + tail * stride_post_weight, tail, HIDDEN, MASK_TAIL).to(tl.float32)
        next_tail = load_part(next_weight_ptr + tail * stride_next_weight, tail, HIDDEN, MASK_TAIL).to(tl.float32)
    for block in tl.static_range(ROWS):
        # The last program's rows past the end repeat the last row, rewriting it with the same values: no masks.
        row = tl.minimum(tl.program_id(0).to(OFFSETS) * ROWS + block, num_rows - 1)
        x_row, residual_row = x_ptr + row * stride_x, residual_ptr + row * stride_residual
        h_row, y_row = h_ptr + row * HIDDEN, y_ptr + row * HIDDEN
        x_main = tl.load(x_row + main).to(tl.float32)
        r_main = tl.load(residual_row + main)
        x_tail, r_tail = x_main, r_main
        if TAIL > 0:
            x_tail = load_part(x_row + tail, tail, HIDDEN, MASK_TAIL).to(tl.float32)
            r_tail = load_part(residual_row + tail, tail, HIDDEN, MASK_TAIL)
        # Stock rounds post_norm's output to the hidden dtype, then adds it to the residual in that dtype.
        n_main, n_tail = _norm(x_main, x_tail, post_main, post_tail, eps, HIDDEN, TAIL, DTYPE)
        h_main = r_main + n_main
        tl.store(h_row + main, h_main)
        h_tail = h_main
        if TAIL > 0:
            h_tail = r_tail + n_tail
            store_part(h_row + tail, h_tail, tail, HIDDEN, MASK_TAIL)
        if HAS_NEXT:
            y_main, y_tail = _norm(
                h_main.to(tl.float32), h_tail.to(tl.float32), next_main, next_tail, eps, HIDDEN, TAIL, DTYPE
            )
            tl.store(y_row + main, y_main)
            if TAIL > 0:
                store_part(y_row + tail, y_tail, tail, HIDDEN, MASK_TAIL)


def launch_config(interpreted: bool) -> tuple[int, int]:
    """(ROWS, num_warps): one warp a program, which reduces each row within itself, and 16 rows a program
    reusing the weights from registers (5,040 programs at 80,640 rows). The interpreter pays per program
    and per operation alike: 8 rows."""
    return (8, 1) if interpreted else (16, 1)


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
    main, tail = row_parts(hidden)
    rows_per_program, num_warps = launch_config(interpreting())
    next_weight_arg = post_weight if next_weight is None else next_weight  # a pointer HAS_NEXT keeps from being read
    _residual_rms_norm_kernel[(triton.cdiv(num_rows, rows_per_program),)](
        x_rows,
        residual_rows,
        post_weight,
        next_weight_arg,
        h,
        h if y is None else y,
        num_rows,
        eps,
        x_rows.stride(0),
        residual_rows.stride(0),
        post_weight.stride(0),
        next_weight_arg.stride(0),
        HIDDEN=hidden,
        MAIN=main,
        TAIL=tail,
        MASK_TAIL=main + tail > hidden,
        HAS_NEXT=next_weight is not None,
        DTYPE=TORCH_TO_TL[x.dtype],
        OFFSETS=offset_dtype(x_rows, residual_rows, h),
        ROWS=rows_per_program,
        num_warps=num_warps,
        enable_fp_fusion=False,  # stock rounds each product and sum apart: no fma
    )
    return h, y
