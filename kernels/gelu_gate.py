"""Gemma 4 vision MLP's activation in one pass over the fused gate/up projection's output:
``gelu_tanh(gate) * up``, with the E2B/E4B clipped linears' clamps (gate's and up's output clamps, down's
input clamp) folded in. Values round to the hidden dtype where stock rounds them: the GELU, the product.

Each program owns ROWS whole rows, one at a time, cut into a power-of-two main part and a tail
(3072 = 2048 + 1024; 4304 = 4096 + 208, the tail rounded up to 256): one row's index math, then 16-byte
vectors of gate and of up, which sits I columns further.
"""

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .common import (
    TORCH_TO_TL,
    as_rows,
    clamp,
    clamp_bounds,
    interpreting,
    launcher,
    load_part,
    offset_dtype,
    round_to,
    row_parts,
    store_part,
)

SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)  # torch's kBeta: M_SQRT2 * M_2_SQRTPI * 0.5
KAPPA = tl.constexpr(0.044715)
# exp(-2u) = 2**(x (A + B x²)) with A = -2 kBeta / ln 2 and B = A kappa.
EXP2_A = tl.constexpr(-2.302208198144325)
EXP2_B = tl.constexpr(-0.1029432395800235)


@triton.jit
def _gelu_tanh(x, DTYPE: tl.constexpr):
    """torch's ``gelu(x, approximate="tanh")`` in fp32: 0.5 x (1 + tanh(u)), u = kBeta (x + kappa x³).

    For bf16 and fp16 as x / (1 + exp(-2u)), the same function without the cancellation of 1 + tanh(u)
    where u is very negative: an fma, the hardware's exp2 and a fast divide, within a few fp32 units of
    the exact GELU, far within one rounding of the dtype. fp32 keeps tanh from exp(-2|u|) (which never
    overflows) and exact division, within 2**-22 of stock's.
    """
    if DTYPE == tl.float32:
        inner = SQRT_2_OVER_PI * (x + KAPPA * (x * x * x))
        decay = tl.exp(-2.0 * tl.abs(inner))
        tanh = tl.div_rn(1.0 - decay, 1.0 + decay)
        return 0.5 * x * (1.0 + tl.where(inner < 0, -tanh, tanh))
    else:
        denominator = 1.0 + tl.exp2(x * tl.fma(x * x, EXP2_B, EXP2_A))
        # Past 2**126 (x below about -10) the fast divide gives 0 where the exact quotient, about x * 2**-126,
        # is a normal bf16; stock's 1 + tanh(u) has cancelled to 0 there too.
        return libdevice.fast_dividef(x, denominator)


@triton.jit
def gelu_gate_values(gate, up, bounds, HAS_CLAMPS: tl.constexpr, DTYPE: tl.constexpr):
    """``gelu_tanh(gate) * up`` in DTYPE from gate (fp32, holding DTYPE values) and up (DTYPE), with the
    clamps' ``bounds`` (gate's, up's, down's input); shared with the gate/up GEMM's epilogue."""
    # Stock's act_fn(gate) rounds to the hidden dtype, then `* up` rounds again.
    if HAS_CLAMPS:
        gate_low, gate_high, up_low, up_high, down_low, down_high = bounds
        gelu = round_to(_gelu_tanh(clamp(gate, gate_low, gate_high), DTYPE), DTYPE).to(tl.float32)
        # The product of two narrow values is exact in fp32, and down's input clamp has bounds in the dtype:
        # clamping before the product's rounding is clamping after it.
        product = gelu * clamp(up.to(tl.float32), up_low, up_high)
        return round_to(clamp(product, down_low, down_high), DTYPE)
    else:
        return round_to(_gelu_tanh(gate, DTYPE), DTYPE) * up


@triton.jit
def gelu_gate_bounds(clamps_ptr, HAS_CLAMPS: tl.constexpr, DTYPE: tl.constexpr):
    """The (3, 2) clamps table's six bounds in DTYPE (zeros without clamps), read once: the stores after
    may alias it, for all the compiler knows."""
    if HAS_CLAMPS:
        return (
            clamp_bounds(clamps_ptr, 0, DTYPE) + clamp_bounds(clamps_ptr, 1, DTYPE) + clamp_bounds(clamps_ptr, 2, DTYPE)
        )
    else:
        return (0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


@triton.jit
def _gelu_gate_part(gate_row, out_row, cols, bounds, INTERMEDIATE: tl.constexpr, MASKED: tl.constexpr,
                    HAS_CLAMPS: tl.constexpr, DTYPE: tl.constexpr):  # fmt: skip
    """One part of a row; up sits INTERMEDIATE columns after gate. Masked only where the part passes I."""
    gate = load_part(gate_row + cols, cols, INTERMEDIATE, MASKED).to(tl.float32)
    up = load_part(gate_row + INTERMEDIATE + cols, cols, INTERMEDIATE, MASKED)
    out = gelu_gate_values(gate, up, bounds, HAS_CLAMPS, DTYPE)
    store_part(out_row + cols, out, cols, INTERMEDIATE, MASKED)


@triton.jit
def _gelu_gate_kernel(
    gate_up_ptr,
    clamps_ptr,
    out_ptr,
    num_rows,
    stride_gate_up,
    INTERMEDIATE: tl.constexpr,
    MAIN: tl.constexpr,
    TAIL: tl.constexpr,
    HAS_CLAMPS: tl.constexpr,
    DTYPE: tl.constexpr,
    OFFSETS: tl.constexpr,
    ROWS: tl.constexpr,
):
    main = tl.arange(0, MAIN)
    MASK_TAIL: tl.constexpr = MAIN + TAIL > INTERMEDIATE
    bounds = gelu_gate_bounds(clamps_ptr, HAS_CLAMPS, DTYPE)
    for block in tl.static_range(ROWS):
        # The last program's rows past the end repeat the last row, rewriting it with the same values.
        row = tl.minimum(tl.program_id(0).to(OFFSETS) * ROWS + block, num_rows - 1)
        gate_row, out_row = gate_up_ptr + row * stride_gate_up, out_ptr + row * INTERMEDIATE
        _gelu_gate_part(gate_row, out_row, main, bounds, INTERMEDIATE, False, HAS_CLAMPS, DTYPE)
        if TAIL > 0:
            tail = MAIN + tl.arange(0, TAIL)
            _gelu_gate_part(gate_row, out_row, tail, bounds, INTERMEDIATE, MASK_TAIL, HAS_CLAMPS, DTYPE)


def launch_config(interpreted: bool) -> tuple[int, int]:
    """(ROWS, num_warps): a row at a time over 4 warps (4304 columns: 34 a thread), 4 rows a program:
    20,160 programs at 80,640 rows. The interpreter pays per program: 8 rows."""
    return (8, 1) if interpreted else (4, 4)


@launcher
def gelu_gate(gate_up: torch.Tensor, clamps: torch.Tensor | None) -> torch.Tensor:
    """Launch on already-validated inputs; returns a new contiguous (..., I) tensor."""
    intermediate = gate_up.shape[-1] // 2
    out = torch.empty((*gate_up.shape[:-1], intermediate), dtype=gate_up.dtype, device=gate_up.device)
    if out.numel() == 0:
        return out
    rows = as_rows(gate_up)
    main, tail = row_parts(intermediate)
    rows_per_program, num_warps = launch_config(interpreting())
    _gelu_gate_kernel[(triton.cdiv(rows.shape[0], rows_per_program),)](
        rows,
        out if clamps is None else clamps.contiguous(),  # read as (3, 2) rows; HAS_CLAMPS=False: never read
        out,
        rows.shape[0],
        rows.stride(0),
        INTERMEDIATE=intermediate,
        MAIN=main,
        TAIL=tail,
        HAS_CLAMPS=clamps is not None,
        DTYPE=TORCH_TO_TL[gate_up.dtype],
        OFFSETS=offset_dtype(rows, out),
        ROWS=rows_per_program,
        num_warps=num_warps,
        enable_fp_fusion=False,  # no fma: the products the interpreter's tests check, under every Triton's default
    )
    return out
