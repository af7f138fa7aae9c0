"""Gemma 4 vision MLP's gate/up GEMM with the GELU gate in its epilogue: one kernel for
``gelu_tanh(y @ W_gate^T) * (y @ W_up^T)``, with the E2B/E4B clipped linears' output clamps folded in.

- Main loop: a program owns BLOCK_M rows and BLOCK_N of the I columns, and keeps two fp32 accumulators,
  gate's and up's, fed by two tensor-core dots per K block from the concatenated (2 I, D) weight: the
  same y tile serves both, so the (T, 2 I) gate/up activations never reach memory.
- Epilogue: each accumulator rounds to the hidden dtype (stock's two linears' outputs), then
  ``gelu_gate_values``, the separate kernel's own code, rounds where stock rounds. So the output is
  ``gelu_gate(F.linear(y, W))`` up to the GEMM's summation order.
- bf16 and fp16 only: fp32 linears keep cuBLAS and the separate kernel (the op chooses).

D (768, 1152) is a compile-time size the K blocks tile exactly; the last row and column blocks are shifted
back to end at the last row and column, so no load or store is masked (the overlap is computed twice and
written with the same values). Programs walk the column blocks of one row block consecutively, so a y
tile comes from HBM once and from L2 for the others; the weight stays resident in L2.
"""

import torch
import triton
import triton.language as tl

from .common import ASYNC_MMA, SYNC_MMA, TORCH_TO_TL, autotune_per_dtype, configs, interpreting, launcher, round_to
from .gelu_gate import gelu_gate_bounds, gelu_gate_values


@triton.jit
def _gate_up_gelu_kernel(
    y_ptr,
    weight_ptr,
    clamps_ptr,
    out_ptr,
    num_rows,
    HIDDEN: tl.constexpr,
    INTERMEDIATE: tl.constexpr,
    HAS_CLAMPS: tl.constexpr,
    DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FULL_ROWS: tl.constexpr,
):
    N_BLOCKS: tl.constexpr = (INTERMEDIATE + BLOCK_N - 1) // BLOCK_N
    FULL_COLS: tl.constexpr = INTERMEDIATE >= BLOCK_N
    pid = tl.program_id(0)
    # int64 rows: T x I passes 2**31 at 500k rows of the 26B/31B tower.
    first_row = (pid // N_BLOCKS).to(tl.int64) * BLOCK_M
    first_col = (pid % N_BLOCKS) * BLOCK_N
    if FULL_ROWS:  # the last blocks end at the last row and column: no masks
        first_row = tl.minimum(first_row, num_rows - BLOCK_M)
    if FULL_COLS:
        first_col = tl.minimum(first_col, INTERMEDIATE - BLOCK_N)
    rows = first_row + tl.arange(0, BLOCK_M)
    cols = first_col + tl.arange(0, BLOCK_N)
    # Where the blocks pass the matrix (tiny sizes only), the last row or column is read again, never stored.
    read_rows = rows if FULL_ROWS else tl.minimum(rows, num_rows - 1)
    read_cols = cols if FULL_COLS else tl.minimum(cols, INTERMEDIATE - 1)
    y_rows = y_ptr + read_rows[:, None] * HIDDEN
    gate_cols = weight_ptr + read_cols[None, :] * HIDDEN
    up_cols = gate_cols + INTERMEDIATE * HIDDEN  # up's rows sit I rows after gate's
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        if HIDDEN % BLOCK_K == 0:
            a = tl.load(y_rows + ks[None, :])
            b_gate = tl.load(gate_cols + ks[:, None])
            b_up = tl.load(up_cols + ks[:, None])
        else:  # tiny sizes: zeros past D
            a = tl.load(y_rows + ks[None, :], mask=(ks < HIDDEN)[None, :], other=0.0)
            b_gate = tl.load(gate_cols + ks[:, None], mask=(ks < HIDDEN)[:, None], other=0.0)
            b_up = tl.load(up_cols + ks[:, None], mask=(ks < HIDDEN)[:, None], other=0.0)
        gate = tl.dot(a, b_gate, gate)
        up = tl.dot(a, b_up, up)

    bounds = gelu_gate_bounds(clamps_ptr, HAS_CLAMPS, DTYPE)
    out = gelu_gate_values(round_to(gate, DTYPE).to(tl.float32), round_to(up, DTYPE), bounds, HAS_CLAMPS, DTYPE)
    out_ptrs = out_ptr + rows[:, None] * INTERMEDIATE + cols[None, :]
    if FULL_ROWS and FULL_COLS:
        tl.store(out_ptrs, out)
    else:
        tl.store(out_ptrs, out, mask=(rows < num_rows)[:, None] & (cols < INTERMEDIATE)[None, :])


# Two accumulators of BLOCK_M x BLOCK_N: the register cost of one GEMM tile of twice the width, so the
# tiles are the embedder's GEMM's at half their width. Each is offered where it fits and does not spill
# with Triton 3.6 to 3.9 (bench/tools/build_matrix.py checks every target). Tuned once per (D, I, dtype),
# at the first call's row count: a key on the row count would time candidates inside a graph capture.
_TILE = ("BLOCK_M", "BLOCK_N", "BLOCK_K")
HEURISTICS = {"FULL_ROWS": lambda args: args["num_rows"] >= args["BLOCK_M"]}
_gate_up_gelu_tuned, gpu_configs = autotune_per_dtype(
    triton.heuristics(HEURISTICS)(_gate_up_gelu_kernel),
    key=["HIDDEN", "INTERMEDIATE"],
    dtype_of="y_ptr",
    half=configs(
        _TILE,
        [
            (128, 64, 64, 8, 3, 96, ASYNC_MMA),  # a stage: the y tile's 16 KiB and two weight tiles' 8 KiB each
            (64, 64, 64, 4, 4, 96, ASYNC_MMA),  # 128x64x64 on 4 warps spills on sm_90a (3.7, I=3072)
            (128, 64, 32, 8, 2, 32, SYNC_MMA),  # the fallback: mma.sync's operands sit in registers too
        ],
    ),
    fp32=[],  # fp32 keeps cuBLAS and the separate kernel
)


@launcher
def gate_up_gelu(y: torch.Tensor, weight: torch.Tensor, clamps: torch.Tensor | None) -> torch.Tensor:
    """Launch on validated (T, D) ``y`` and (2 I, D) ``weight``, both contiguous, bf16 or fp16; returns a
    new contiguous (T, I) tensor."""
    num_rows, hidden = y.shape
    intermediate = weight.shape[0] // 2
    out = torch.empty((num_rows, intermediate), dtype=y.dtype, device=y.device)
    if out.numel() == 0:
        return out
    args = (y, weight, out if clamps is None else clamps.contiguous(), out, num_rows)
    meta = dict(HIDDEN=hidden, INTERMEDIATE=intermediate, HAS_CLAMPS=clamps is not None, DTYPE=TORCH_TO_TL[y.dtype])

    def grid(tile):
        return (triton.cdiv(num_rows, tile["BLOCK_M"]) * triton.cdiv(intermediate, tile["BLOCK_N"]),)

    # No fma in the epilogue, as the separate kernel: the products the interpreter's tests check.
    if interpreting():  # fixed large tiles: the interpreter pays per program, and autotuning needs a GPU
        block_n = min(128, triton.next_power_of_2(intermediate))
        tile = dict(BLOCK_M=64, BLOCK_N=block_n, BLOCK_K=64, FULL_ROWS=num_rows >= 64)
        _gate_up_gelu_kernel[grid](*args, **meta, **tile, enable_fp_fusion=False)
    else:
        _gate_up_gelu_tuned[grid](*args, **meta, enable_fp_fusion=False)
    return out
