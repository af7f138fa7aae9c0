"""The kernels' casts against PyTorch's, bit for bit, special values included.

On a GPU these are the hardware's casts; under the interpreter, fused_vision's correction of Triton's (whose
fp32 -> bf16 cast truncates and whose bf16 -> fp32 cast of a subnormal is wrong): the same kernels, launched
as the ops launch theirs. Inputs in the kernels are fp32 sums and GEMM accumulators, which on a GPU carry the
hardware's NaN (0x7FFFFFFF), not numpy's: the special patterns are fed in as bits, so the interpreter meets
them too. NaN payloads are the device's choice (the GPU's cast gives 0x7FFF, torch's CPU cast 0x7FC0 or
0xFFFF); NaN stays NaN.
"""

import pytest
import torch
import triton
import triton.language as tl

from fused_vision.kernels.common import TORCH_TO_TL, launcher, round_to

from helpers import DEVICE, assert_bit_identical, dtype_id

SPECIAL_BITS = [
    0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FFF8000, 0x7FBFFFFF,  # NaNs
    0x7F800000, 0xFF800000,  # infinities
    0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F7FFF, 0x7F7F8000,  # near the largest finite: to inf, down, a tie
    0x00000000, 0x80000000, 0x00000001, 0x807FFFFF, 0x00008000, 0x00018000,  # zeros, subnormals, ties
    0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0x3FFFFFFF,  # ties to even (down, up), near a tie, a carry
]  # fmt: skip


@triton.jit
def _cast_kernel(x_ptr, out_ptr, numel, DTYPE: tl.constexpr, ROUND: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    x = tl.load(x_ptr + offsets, mask=mask)
    tl.store(out_ptr + offsets, round_to(x, DTYPE) if ROUND else x.to(DTYPE), mask=mask)


@launcher
def cast(x: torch.Tensor, dtype: torch.dtype, rounded: bool = True) -> torch.Tensor:
    """x cast to dtype by a kernel (``round_to``, or a plain ``.to``), into a NaN-filled output."""
    out = torch.full(x.shape, float("nan"), dtype=dtype, device=x.device)
    grid = (triton.cdiv(x.numel(), 1024),)
    _cast_kernel[grid](x, out, x.numel(), DTYPE=TORCH_TO_TL[dtype], ROUND=rounded, BLOCK=1024)
    return out


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


def fp32_cases() -> torch.Tensor:
    """The special patterns, every rounding class, 200,000 random bit patterns, and values at every exponent."""
    special = torch.tensor(SPECIAL_BITS, dtype=torch.int64).to(torch.int32).view(torch.float32)
    generator = torch.Generator().manual_seed(0)
    random_bits = torch.randint(-(2**31), 2**31, (200_000,), generator=generator, dtype=torch.int64)
    scaled = torch.randn(4093, generator=generator) * torch.logspace(-40, 38, 4093)  # every exponent, odd size
    return torch.cat([special, every_rounding_class(), random_bits.to(torch.int32).view(torch.float32), scaled])


def assert_cast_matches_torch(out: torch.Tensor, x: torch.Tensor) -> None:
    expected = x.to(out.dtype)
    nan = x.isnan()
    assert out[nan].isnan().all(), f"NaN in, not NaN out: {out[nan][~out[nan].isnan()][:8].tolist()}"
    assert_bit_identical(out[~nan], expected[~nan])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
@pytest.mark.parametrize("rounded", [True, False], ids=["round_to", "to"])
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # numpy, on fp16's overflow to inf
def test_fp32_casts_are_torch_casts(dtype, rounded):
    """Ties both ways, carries into the exponent, overflow to inf, subnormals: torch's cast bit for bit."""
    x = fp32_cases().to(DEVICE)
    out = cast(x, dtype, rounded)
    assert_cast_matches_torch(out, x)
    if dtype == torch.bfloat16:  # the classes the cases must hold, or the test proves less than it says
        finite = x.isfinite()
        assert out[finite].isinf().any() and (out[finite] == 0).any() and ((out.view(torch.int16) & 0x7F80) == 0).any()


@pytest.mark.parametrize("src", [torch.float16, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("dst", [torch.float32, torch.float16, torch.bfloat16], ids=dtype_id)
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_half_casts_are_torch_casts(src, dst):
    """Every one of the 65,536 bf16 and fp16 values, subnormals included, up to fp32 exactly and across."""
    if src == dst:
        pytest.skip("no cast")
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(src).to(DEVICE)
    assert_cast_matches_torch(cast(x, dst, rounded=False), x)
