"""Gemma 4 vision MLP's activation in one pass over the fused gate/up projection's output:
``gelu_tanh(gate) * up``, with the E2B/E4B clipped linears' clamps (gate's and up's output clamps, down's
input clamp) folded in. Values round to the hidden dtype where stock rounds them: the GELU, the product.
"""

import torch
import triton
import triton.language as tl

from .common import TORCH_TO_TL, as_rows, clamp, clamp_bounds, gather_launch_config, interpreting, launcher, round_to

SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)  # torch's kBeta: M_SQRT2 * M_2_SQRTPI * 0.5
KAPPA = tl.constexpr(0.044715)


@triton.jit
def _gelu_tanh(x):
    """torch's ``gelu(x, approximate="tanh")`` in fp32: 0.5 x (1 + tanh(u)), u = kBeta (x + kappa x³).

    tanh from exp(-2|u|), which never overflows (the interpreter has no tanh); 1 + tanh(u) then cancels
    as stock's does where u is very negative, to exactly 0 where tanh(u) rounds to -1.
    """
    inner = SQRT_2_OVER_PI * (x + KAPPA * (x * x * x))
    decay = tl.exp(-2.0 * tl.abs(inner))
    tanh = (1.0 - decay) / (1.0 + decay)
    return 0.5 * x * (1.0 + tl.where(inner < 0, -tanh, tanh))


@triton.jit
def _gelu_gate_kernel(
    gate_up_ptr,
    clamps_ptr,
    out_ptr,
    num_rows,
    intermediate,
    stride_gate_up,
    HAS_CLAMPS: tl.constexpr,
    DTYPE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_I: tl.constexpr,
):
    # int64 rows: rows * 2I may exceed 2**31 elements.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    tile_in = (rows < num_rows)[:, None] & (cols < intermediate)[None, :]
    gate = gate_up_ptr + rows[:, None] * stride_gate_up + cols[None, :]
    up = tl.load(gate + intermediate, mask=tile_in, other=0.0).to(tl.float32)
    gate = tl.load(gate, mask=tile_in, other=0.0).to(tl.float32)
    if HAS_CLAMPS:
        # gate_proj's and up_proj's output clamps, in the hidden dtype.
        low, high = clamp_bounds(clamps_ptr, 0, DTYPE)
        gate = clamp(gate, low, high)
        low, high = clamp_bounds(clamps_ptr, 1, DTYPE)
        up = clamp(up, low, high)
    # Stock's act_fn(gate) rounds to the hidden dtype, then `* up` rounds again.
    out = round_to(round_to(_gelu_tanh(gate), DTYPE).to(tl.float32) * up, DTYPE)
    if HAS_CLAMPS:
        # down_proj's input clamp.
        low, high = clamp_bounds(clamps_ptr, 2, DTYPE)
        out = clamp(out.to(tl.float32), low, high).to(DTYPE)
    tl.store(out_ptr + rows[:, None] * intermediate + cols[None, :], out, mask=tile_in)


@launcher
def gelu_gate(gate_up: torch.Tensor, clamps: torch.Tensor | None) -> torch.Tensor:
    """Launch on already-validated inputs; returns a new contiguous (..., I) tensor."""
    intermediate = gate_up.shape[-1] // 2
    out = torch.empty((*gate_up.shape[:-1], intermediate), dtype=gate_up.dtype, device=gate_up.device)
    if out.numel() == 0:
        return out
    rows = as_rows(gate_up)
    num_rows = rows.shape[0]
    block_rows, block_i, num_warps = gather_launch_config(intermediate, interpreting())
    grid = (triton.cdiv(num_rows, block_rows), triton.cdiv(intermediate, block_i))
    _gelu_gate_kernel[grid](
        rows,
        out if clamps is None else clamps.contiguous(),  # read as (3, 2) rows; HAS_CLAMPS=False: never read
        out,
        num_rows,
        intermediate,
        rows.stride(0),
        HAS_CLAMPS=clamps is not None,
        DTYPE=TORCH_TO_TL[gate_up.dtype],
        BLOCK_ROWS=block_rows,
        BLOCK_I=block_i,
        num_warps=num_warps,
        enable_fp_fusion=False,  # no fma: the products the interpreter's tests check, under every Triton's default
    )
    return out
