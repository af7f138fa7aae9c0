"""The kernels' rounding to the storage dtype against PyTorch's cast, bit for bit, special values included.

``round_to`` rounds bf16 with integer ops (the interpreter's cast truncates). Its inputs in the kernels
are fp32 sums and GEMM accumulators, which on a GPU carry the hardware's NaN (0x7FFFFFFF), not numpy's:
the special patterns are fed in as bits, so the interpreter meets them too.
"""

import pytest
import torch
import triton
import triton.language as tl

from fused_vision.kernels.common import TORCH_TO_TL, round_to

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
