"""Gemma 4's patch embedder as one GEMM kernel with the prescale in the prologue and the lookup in the epilogue.

out[m] = round(round(W @ round_W(2 * (pixels[m] - 0.5))) + pe[m])

- Prologue: pixels (fp32, fp16 or bf16, the processor's dtype) are prescaled in their own dtype and
  rounded to the weight dtype on load, as stock's `(2 * (pixel_values - 0.5)).to(W.dtype)`: for fp32
  pixels one fma, 2p - 1 (doubling is exact, so it rounds as stock's two steps), and one hardware cast.
- Main loop: bf16/fp16 weights take a tensor-core dot with an fp32 accumulator. fp32 weights take ieee
  dots (stock's fp32 linear does not use tf32), one FMA chain per output over the K block; the
  blocks' sums add up in fp64, so the rounding error grows with BLOCK_K rather than with K. A single
  chain over K = 768 is less accurate than cuBLAS when it splits K for a small output (1.4 to 3.4 times
  the error for 2 to 16 splits); summed per block in fp64, at most that of 16 splits
  (bench/fp32_accumulation.py emulates each order). K and D are compile-time sizes: where the blocks
  tile them (768 and 1152 by 64 and 128), the loop has no masks; rows past the last are read as the
  last row and never stored, so no load in the loop is masked.
- Epilogue: the accumulator rounds to the weight dtype (stock's `input_proj` output), the two table rows
  are gathered for non-padding rows, and `hidden + pe` rounds once more, as stock. One store; no
  (B, N, K) or (B, N, D) temporaries.

Programs walk the D blocks of one M block consecutively, so a pixel tile comes from HBM once and from
L2 for the other D blocks; the (D, K) weight stays resident in L2.
"""

import torch
import triton
import triton.language as tl

from .._device import FMA, MFMA, MMA_SYNC, WGMMA, WMMA
from .common import (
    ASYNC_MMA,
    TORCH_TO_TL,
    autotune_per_dtype,
    configs,
    interpreting,
    launcher,
    offset_dtype,
    round_to,
    unit_inner_stride,
)
from .position_embeddings import flat_ids, lookup_block, table_rows


@triton.jit
def _prescale(pixels, PIXEL_DTYPE: tl.constexpr, DTYPE: tl.constexpr):
    """Stock's ``(2 * (pixels - 0.5)).to(DTYPE)``, its arithmetic in the pixel dtype."""
    if PIXEL_DTYPE == tl.float32:
        doubled = tl.fma(pixels, 2.0, -1.0)
    else:
        # fp16's range is narrower than fp32's: the doubling rounds (and may overflow) in the pixel dtype.
        half = round_to(pixels.to(tl.float32) - 0.5, PIXEL_DTYPE).to(tl.float32)
        doubled = round_to(2.0 * half, PIXEL_DTYPE).to(tl.float32)
    return round_to(doubled, DTYPE)


@triton.jit
def _patch_embed_kernel(
    pixels_ptr,
    weight_ptr,
    table_ptr,
    ids_ptr,
    padding_ptr,
    out_ptr,
    num_rows,
    num_positions,
    stride_table_axis,
    stride_table_pos,
    FEATURES: tl.constexpr,
    HIDDEN: tl.constexpr,
    PIXEL_DTYPE: tl.constexpr,
    DTYPE: tl.constexpr,
    OFFSETS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FULL_ROWS: tl.constexpr,
):
    D_BLOCKS: tl.constexpr = (HIDDEN + BLOCK_D - 1) // BLOCK_D
    pid = tl.program_id(0)
    first_row = (pid // D_BLOCKS).to(OFFSETS) * BLOCK_M
    first_col = (pid % D_BLOCKS) * BLOCK_D
    # The last block of rows (of columns) ends at the last row (column), overlapping the one before, which it
    # writes again with the same values: every row it reads exists, so no load is masked, and the rows of a
    # thread sit at constant distances, which the loads take as immediates (pixels and weight are contiguous
    # (B * N, K) and (D, K)). Only a tensor smaller than one block masks.
    if FULL_ROWS:
        first_row = tl.minimum(first_row, num_rows - BLOCK_M)
    if HIDDEN >= BLOCK_D:
        first_col = tl.minimum(first_col, HIDDEN - BLOCK_D)
    rows = first_row + tl.arange(0, BLOCK_M)
    cols = first_col + tl.arange(0, BLOCK_D)
    row_in = rows < num_rows
    col_in = cols < HIDDEN
    pixel_rows = pixels_ptr + (rows if FULL_ROWS else tl.minimum(rows, num_rows - 1))[:, None] * FEATURES
    weight_cols = weight_ptr + (cols if HIDDEN >= BLOCK_D else tl.minimum(cols, HIDDEN - 1))[None, :] * FEATURES
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float64 if DTYPE == tl.float32 else tl.float32)
    for k0 in range(0, FEATURES, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        if FEATURES % BLOCK_K == 0:
            pixels = tl.load(pixel_rows + ks[None, :])
            b = tl.load(weight_cols + ks[:, None])
        else:  # masked K: pixels of 0.5 prescale to 0
            pixels = tl.load(pixel_rows + ks[None, :], mask=(ks < FEATURES)[None, :], other=0.5)
            b = tl.load(weight_cols + ks[:, None], mask=(ks < FEATURES)[:, None], other=0.0)
        a = _prescale(pixels, PIXEL_DTYPE, DTYPE)
        if DTYPE == tl.float32:
            # Not `tl.dot(a, b, acc)`, one chain over all of K; Triton also folds `acc + tl.dot(a, b)` into that.
            acc += tl.dot(a, b, input_precision="ieee").to(tl.float64)
        else:
            acc = tl.dot(a, b, acc)

    hidden_states = round_to(acc, DTYPE)
    x_rows, y_rows, lookup, fill = table_rows(
        table_ptr, ids_ptr, padding_ptr, rows, row_in, num_positions, stride_table_axis, stride_table_pos
    )
    pe = lookup_block(x_rows, y_rows, lookup, fill, cols, HIDDEN, BLOCK_D, DTYPE)
    out = hidden_states + pe
    tl.store(out_ptr + rows[:, None] * HIDDEN + cols[None, :], out, mask=row_in[:, None] & col_in[None, :])


# Each is offered where it fits and does not spill with Triton 3.6 to 3.9 (bench/tools/build_matrix.py
# checks every target) and, on wgmma and tcgen05, where its K loop feeds the tensor cores (at most 48
# instructions per HGMMA: bench/tools/speed_of_light.py; 32-deep K blocks pay their loop twice as often).
# The fp32 pixel tile and its conversion cost registers a plain bf16 GEMM would not spend, most under
# mma.sync, whose operands sit in registers too (sm_80 to sm_89, sm_120). fp32 weights (ieee dots, as
# stock's fp32 linear) need smaller tiles still, and 8 warps: with their fp64 block sums, each 4-warp tile
# tried (64x64, 32x128) spills under Triton 3.6, 3.7 or 3.9. Tuned once per (D, K, dtypes), at the first
# call's row count, which then serves every size: a key on the row count would time candidates at sizes
# first seen inside a CUDA graph capture.
_TILE = ("BLOCK_M", "BLOCK_D", "BLOCK_K")
NOT_WMMA = (FMA, MMA_SYNC, *ASYNC_MMA, MFMA)  # fp32 tiles that spill on WMMA's waves of 32 (gfx1100, 3.6)
# Meta-parameters that follow from a config and the call: the tools that build a launch apply them too.
HEURISTICS = {"FULL_ROWS": lambda args: args["num_rows"] >= args["BLOCK_M"]}
_patch_embed_tuned, gpu_configs = autotune_per_dtype(
    triton.heuristics(HEURISTICS)(_patch_embed_kernel),
    key=["HIDDEN", "FEATURES"],
    dtype_of="weight_ptr",
    half=configs(
        _TILE,
        [
            (128, 128, 64, 8, 3, 144, ASYNC_MMA),
            (128, 128, 32, 8, 4, 96, ("sm_12",)),  # sm_80 to sm_89: spills (3.6, 3.9)
            (64, 256, 64, 8, 3, 144, None),
            (64, 128, 64, 4, 4, 128, ASYNC_MMA),
            (128, 64, 64, 4, 4, 152, ASYNC_MMA),
            (64, 128, 32, 4, 2, 48, (MFMA,)),  # 64 KiB of LDS: two stages, 4 wavefronts of 64
            (128, 128, 32, 8, 2, 64, (MMA_SYNC, MFMA)),  # the fallback: 32 KiB (64 on AMD), spill-free
            # WMMA's waves of 32 hold more of a tile each: both tiles above spill on gfx1100 (3.6).
            (64, 128, 32, 8, 2, 16, (WMMA,)),
            (64, 64, 32, 8, 2, 12, (WMMA,)),
        ],
    ),
    fp32=configs(
        _TILE,
        [
            (128, 64, 32, 8, 3, 64, NOT_WMMA),
            (64, 128, 32, 8, 3, 56, NOT_WMMA),
            (64, 64, 32, 8, 3, 40, (WGMMA, MFMA)),  # spills under mma.sync, on sm_100a (3.6) and gfx1201 (3.9)
            (64, 64, 64, 8, 3, 80, (*ASYNC_MMA, "sm_86", "sm_89")),  # spills: sm_80 (3.9), sm_120 (3.6)
            (128, 64, 32, 8, 4, 88, NOT_WMMA),
            (64, 64, 32, 8, 2, 16, (WMMA,)),
            (32, 64, 32, 8, 2, 12, (WMMA,)),
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
    batch, seq_len, features = pixel_values.shape
    hidden = weight.shape[0]
    out = torch.empty((batch, seq_len, hidden), dtype=weight.dtype, device=weight.device)
    num_rows = batch * seq_len
    if out.numel() == 0:
        return out
    pixels, weight, table = pixel_values.contiguous(), weight.contiguous(), unit_inner_stride(table)
    ids, padding = flat_ids(position_ids, padding_positions)
    args = (
        pixels,
        weight,
        table,
        ids,
        padding,
        out,
        num_rows,
        table.shape[1],
        table.stride(0),
        table.stride(1),
    )
    meta = dict(
        FEATURES=features,
        HIDDEN=hidden,
        PIXEL_DTYPE=TORCH_TO_TL[pixel_values.dtype],
        DTYPE=TORCH_TO_TL[weight.dtype],
        OFFSETS=offset_dtype(pixels, weight, table, out),
    )

    def grid(tile):
        return (triton.cdiv(num_rows, tile["BLOCK_M"]) * triton.cdiv(hidden, tile["BLOCK_D"]),)

    if interpreting():
        # Fixed large tiles: the interpreter pays per program, and autotuning needs a GPU.
        block_d = min(256, triton.next_power_of_2(hidden))
        tile = dict(BLOCK_M=64, BLOCK_D=block_d, BLOCK_K=64, FULL_ROWS=num_rows >= 64)
        _patch_embed_kernel[grid](*args, **meta, **tile)
    else:
        _patch_embed_tuned[grid](*args, **meta)
    return out
