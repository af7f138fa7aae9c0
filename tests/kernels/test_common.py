"""The kernels' rounding to the storage dtype against PyTorch's cast, bit for bit, special values included.

``round_to`` is the hardware's cast on a GPU and, under the interpreter (whose cast truncates), bf16
rounding in integer ops; ``round_to_bf16_by_integers`` is checked on its own as well, so that on a GPU the
two are compared with each other. Inputs in the kernels are fp32 sums and GEMM accumulators, which on a GPU
carry the hardware's NaN (0x7FFFFFFF), not numpy's: the special patterns are fed in as bits, so the
interpreter meets them too. NaN payloads are the one difference: the integer rounding keeps the sign and
the high payload and sets the quiet bit, the GPU's cast gives 0x7FFF and torch's CPU cast 0x7FC0 (each
with the sign); all of them are NaN.
"""

import pytest
import torch
import triton
import triton.language as tl

from fused_vision.kernels.common import TORCH_TO_TL, round_to, round_to_bf16_by_integers

from helpers import DEVICE, assert_bit_identical, dtype_id

SPECIAL_BITS = [
    0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FFF8000, 0x7FBFFFFF,  # NaNs
    0x7F800000, 0xFF800000,  # infinities
    0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F7FFF, 0x7F7F8000,  # near the largest finite: to inf, down, a tie
    0x00000000, 0x80000000, 0x00000001, 0x807FFFFF, 0x00008000, 0x00018000,  # zeros, subnormals, ties
    0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF,  # ties to even (down, up), just above and below a tie
]  # fmt: skip


@triton.jit
def _round_kernel(x_ptr, out_ptr, numel, DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    tl.store(out_ptr + offsets, round_to(tl.load(x_ptr + offsets, mask=mask), DTYPE), mask=mask)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # numpy, on fp16's overflow to inf
def test_round_to_matches_the_torch_cast(dtype):
    special = torch.tensor(SPECIAL_BITS, dtype=torch.int64).to(torch.int32).view(torch.float32)
    scaled = torch.randn(4093) * torch.logspace(-40, 38, 4093)  # every exponent, odd size
    x = torch.cat([special, scaled]).to(DEVICE)
    out = torch.full_like(x, float("nan"), dtype=dtype)
    _round_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), DTYPE=TORCH_TO_TL[dtype], BLOCK=1024)

    expected = x.to(dtype)
    nan = x.isnan()
    assert out[nan].isnan().all(), f"NaN in, not NaN out: {out[nan].tolist()}"
    # NaN payloads are the device's choice (the CPU cast gives 0x7FC0, the GPU's 0x7FFF); all else is exact.
    assert_bit_identical(out[~nan], expected[~nan])


@triton.jit
def _integer_round_kernel(x_ptr, out_ptr, numel, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    tl.store(out_ptr + offsets, round_to_bf16_by_integers(tl.load(x_ptr + offsets, mask=mask)), mask=mask)


def every_rounding_class() -> torch.Tensor:
    """fp32 bit patterns of both signs at every exponent (subnormals and inf/NaN's included) with the low
    16 bits on each side of the rounding point: ties to an even and to an odd bf16, one above and one below
    each, zero, the largest; and the bf16 mantissa's carry into the exponent (0x...7F + a round up)."""
    low = torch.tensor([0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x4000, 0xC000])
    high = torch.tensor([0x00, 0x01, 0x7E, 0x7F])  # bf16 mantissa: even, odd, and 0x7F, whose round up carries
    exponent = torch.arange(256)
    sign = torch.tensor([0, 1])
    bits = (sign[:, None, None, None] << 31) | (exponent[None, :, None, None] << 23)
    bits = bits | (high[None, None, :, None] << 16) | low[None, None, None, :]
    return bits.flatten().to(torch.int32).view(torch.float32)


def test_integer_rounding_is_the_cast_on_every_class():
    """The interpreter's bf16 rounding is torch's cast (round to nearest even) bit for bit outside NaN:
    ties both ways, subnormals, overflow to inf, every exponent. NaN stays NaN with its sign."""
    x = every_rounding_class().to(DEVICE)
    out = torch.full_like(x, float("nan"), dtype=torch.bfloat16)
    _integer_round_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    nan = x.isnan()
    assert nan.any()
    assert_bit_identical(out[~nan], x[~nan].to(torch.bfloat16))
    assert out[nan].isnan().all() and (out[nan].signbit() == x[nan].signbit()).all()
    # Overflow to inf happens in this set: the largest finite fp32 values round up past bf16's largest.
    assert out[~nan].isinf().sum() > x.isinf().sum()
