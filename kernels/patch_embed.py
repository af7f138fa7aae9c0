"""Gemma 4's patch embedder as one GEMM kernel with the prescale in the prologue and the lookup in the epilogue.

out[m] = round(round(W @ round_W(2 * (pixels[m] - 0.5))) + pe[m])

- Prologue: pixels (fp32, fp16 or bf16, the processor's dtype) are prescaled in their own dtype and
  rounded to the weight dtype on load, as stock's `(2 * (pixel_values - 0.5)).to(W.dtype)`.
- Main loop: bf16/fp16 weights take a tensor-core dot with an fp32 accumulator. fp32 weights take ieee
  dots (stock's fp32 linear does not use tf32), one FMA chain per output over the K block; the
  blocks' sums add up in fp64, so the rounding error grows with BLOCK_K rather than with K. A single
  chain over K = 768 is less accurate than cuBLAS when it splits K for a small output (1.4 to 3.4 times
  the error for 2 to 16 splits); summed per block in fp64, at most that of 16 splits
  (bench/fp32_accumulation.py emulates each order).
- Epilogue: the accumulator rounds to the weight dtype (stock's `input_proj` output), the two table rows
  are gathered for non-padding rows, and `hidden + pe` rounds once more, as stock. One store; no
  (B, N, K) or (B, N, D) temporaries.

Programs walk the D blocks of one M block consecutively, so a pixel tile comes from HBM once and from
L2 for the other D blocks; the (D, K) weight stays resident in L2.
"""

import torch
import triton
import triton.language as tl

from .common import (
    ASYNC_MMA,
    TORCH_TO_TL,
    autotune_per_dtype,
    configs,
    int32_inner_offsets,
    interpreting,
    launcher,
    round_to,
)
from .position_embeddings import load_positions, position_embeddings_tile


@triton.jit
def _patch_embed_kernel(
    pixels_ptr,
    weight_ptr,
    table_ptr,
    ids_ptr,
    padding_ptr,
    out_ptr,
    num_rows,
    seq_len,
    features,
    hidden,
    num_positions,
    stride_pixels_b,
    stride_pixels_n,
    stride_pixels_k,
    stride_weight_d,
    stride_weight_k,
    stride_table_axis,
    stride_table_pos,
    stride_table_d,
    stride_ids_b,
    stride_ids_n,
    stride_ids_axis,
    stride_padding_b,
    stride_padding_n,
    PIXEL_DTYPE: tl.constexpr,
    DTYPE: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    num_d_blocks = tl.cdiv(hidden, BLOCK_D)
    pid = tl.program_id(0)
    rows = (pid // num_d_blocks).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid % num_d_blocks) * BLOCK_D + tl.arange(0, BLOCK_D)
    row_in = rows < num_rows
    col_in = cols < hidden
    batch = rows // seq_len
    patch = rows % seq_len

    pixel_rows = pixels_ptr + batch[:, None] * stride_pixels_b + patch[:, None] * stride_pixels_n
    weight_cols = weight_ptr + cols[None, :].to(tl.int64) * stride_weight_d
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float64 if DTYPE == tl.float32 else tl.float32)
    for k0 in range(0, features, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_in = ks < features
        pixels = tl.load(pixel_rows + ks[None, :] * stride_pixels_k, mask=row_in[:, None] & k_in[None, :], other=0.5)
        # 2 * (p - 0.5) in the pixel dtype, then the cast to the weight dtype. Doubling in fp32 is exact and
        # matches stock's doubling in fp32 and bf16 (fp32's range); fp16's range is narrower, where stock's
        # doubling can overflow to inf, so it is rounded to fp16 again.
        doubled = 2.0 * round_to(pixels.to(tl.float32) - 0.5, PIXEL_DTYPE).to(tl.float32)
        if PIXEL_DTYPE == tl.float16:
            doubled = doubled.to(tl.float16).to(tl.float32)
        a = round_to(doubled, DTYPE)
        b = tl.load(weight_cols + ks[:, None] * stride_weight_k, mask=k_in[:, None] & col_in[None, :], other=0.0)
        if DOT_IN_FP32:  # the interpreter has no bf16 dot; bf16 values are exact in fp32
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        elif DTYPE == tl.float32:
            # Not `tl.dot(a, b, acc)`, one chain over all of K; Triton also folds `acc + tl.dot(a, b)` into that.
            acc += tl.dot(a, b, input_precision="ieee").to(tl.float64)
        else:
            acc = tl.dot(a, b, acc)

    hidden_states = round_to(acc, DTYPE).to(tl.float32)
    x, y, padding = load_positions(
        ids_ptr,
        padding_ptr,
        batch,
        patch,
        row_in,
        stride_ids_b,
        stride_ids_n,
        stride_ids_axis,
        stride_padding_b,
        stride_padding_n,
    )
    pe = position_embeddings_tile(
        table_ptr,
        x,
        y,
        padding,
        row_in,
        cols,
        col_in,
        num_positions,
        stride_table_axis,
        stride_table_pos,
        stride_table_d,
        DTYPE,
    )
    out = round_to(hidden_states + pe, DTYPE)
    tl.store(out_ptr + rows[:, None] * hidden + cols[None, :], out, mask=row_in[:, None] & col_in[None, :])


# Each is offered where it fits and does not spill with Triton 3.6 to 3.9 (bench/tools/build_matrix.py
# checks every target): the fp32 pixel tile and its conversion cost registers a plain bf16 GEMM would not
# spend, most under mma.sync, whose operands sit in registers too (sm_80 to sm_89, sm_120). fp32 weights
# (ieee dots, as stock's fp32 linear) need smaller tiles still, and 8 warps: with their fp64 block sums,
# each 4-warp tile tried (64x64, 32x128) spills under Triton 3.6, 3.7 or 3.9. Tuned once per (D, K,
# dtypes), at the first call's row count, which then serves every size: a key on the row count would
# time candidates at sizes first seen inside a CUDA graph capture.
_TILE = ("BLOCK_M", "BLOCK_D", "BLOCK_K")
_patch_embed_tuned, gpu_configs = autotune_per_dtype(
    _patch_embed_kernel,
    key=["hidden", "features"],
    dtype_of="weight_ptr",
    half=configs(
        _TILE,
        [
            (128, 128, 64, 8, 3, 144, ASYNC_MMA),
            (128, 128, 32, 8, 4, 96, ASYNC_MMA + ("sm_120",)),  # sm_80 to sm_89: spills (3.6, 3.9)
            (64, 256, 64, 8, 3, 144, None),
            (64, 128, 64, 4, 4, 128, ASYNC_MMA),
            (128, 64, 64, 4, 4, 152, ASYNC_MMA),
            (64, 128, 32, 4, 2, 48, ("gfx",)),  # 64 KiB of LDS: two stages, 4 wavefronts of 64
            (128, 128, 32, 8, 2, 64, None),  # every target's fallback: 32 KiB (64 on AMD), spill-free
        ],
    ),
    fp32=configs(
        _TILE,
        [
            (128, 64, 32, 8, 3, 64, None),
            (64, 128, 32, 8, 3, 56, None),
            (64, 64, 32, 8, 3, 40, ("sm_90", "gfx")),  # spills under mma.sync, and on sm_100a (3.6)
            (64, 64, 64, 8, 3, 80, ("sm_86", "sm_89", "sm_90", "sm_100", "sm_120")),  # sm_80: spills (3.9)
            (128, 64, 32, 8, 4, 88, None),
        ],
    ),
)


@launcher
def patch_embed(
    pixel_values: torch.Tensor,
    weight: torch.Tensor,
    table: torch.Tensor,
    position_ids: torch.Tensor,
    padding_positions: torch.Tensor,
) -> torch.Tensor:
    """Launch the fused embedder on validated inputs; returns a new contiguous (B, N, D) tensor."""
    pixel_values, weight, table = map(int32_inner_offsets, (pixel_values, weight, table))
    batch, seq_len, features = pixel_values.shape
    hidden = weight.shape[0]
    out = torch.empty((batch, seq_len, hidden), dtype=weight.dtype, device=weight.device)
    num_rows = batch * seq_len
    if out.numel() == 0:
        return out
    args = (
        pixel_values,
        weight,
        table,
        position_ids,
        padding_positions.view(torch.uint8),
        out,
        num_rows,
        seq_len,
        features,
        hidden,
        table.shape[1],
        *pixel_values.stride(),
        *weight.stride(),
        *table.stride(),
        *position_ids.stride(),
        *padding_positions.stride(),
    )
    dtypes = dict(PIXEL_DTYPE=TORCH_TO_TL[pixel_values.dtype], DTYPE=TORCH_TO_TL[weight.dtype])

    def grid(meta):
        return (triton.cdiv(num_rows, meta["BLOCK_M"]) * triton.cdiv(hidden, meta["BLOCK_D"]),)

    if interpreting():
        # Fixed large tiles: the interpreter pays per program, and autotuning needs a GPU.
        block_d = min(256, triton.next_power_of_2(hidden))
        _patch_embed_kernel[grid](
            *args, **dtypes, DOT_IN_FP32=weight.dtype == torch.bfloat16, BLOCK_M=64, BLOCK_D=block_d, BLOCK_K=64
        )
    else:
        _patch_embed_tuned[grid](*args, **dtypes, DOT_IN_FP32=False)
    return out
