"""The arithmetic the kernels rely on, checked where it runs: on a GPU the hardware's, under the interpreter
fused_vision's correction of Triton's (fused_vision/_interpreter.py), through kernels launched as the ops
launch theirs. bf16 add, sub and mul are torch's bit for bit, bf16 dots accumulate in fp32, fma rounds once,
and the approximate libdevice calls stay within the error the GPU documents (docs/semantics.md).
"""

import math
from fractions import Fraction

import pytest
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from fused_vision import _interpreter
from fused_vision.kernels.common import launcher
from fused_vision.kernels.qkv_norm_rope import fast_cos_sin

from helpers import DEVICE, assert_bit_identical

OPS = ["add", "sub", "mul", "max", "less", "fma", "fast_dividef", "fast_sinf", "fast_cosf", "rint", "cos_sin"]


@triton.jit
def _elementwise_kernel(a_ptr, b_ptr, c_ptr, out_ptr, sin_ptr, numel, OP: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    a, b = tl.load(a_ptr + offsets, mask=mask), tl.load(b_ptr + offsets, mask=mask)
    if OP == 0:
        out = a + b
    elif OP == 1:
        out = a - b
    elif OP == 2:
        out = a * b
    elif OP == 3:
        out = tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)  # as the kernels clamp
    elif OP == 4:
        out = tl.where(a < b, a, b)
    elif OP == 5:
        out = tl.fma(a, b, tl.load(c_ptr + offsets, mask=mask))
    elif OP == 6:
        out = libdevice.fast_dividef(a, b)
    elif OP == 7:
        out = libdevice.fast_sinf(a)
    elif OP == 8:
        out = libdevice.fast_cosf(a)
    elif OP == 9:
        out = libdevice.rint(a)
    else:
        out, sin = fast_cos_sin(a)
        tl.store(sin_ptr + offsets, sin, mask=mask)
    tl.store(out_ptr + offsets, out, mask=mask)


@launcher
def elementwise(op, a, b=None, c=None):
    """``op`` on a, b (and c) by a kernel, into NaN-filled outputs; for "cos_sin" the pair."""
    out, sin = torch.full_like(a, float("nan")), torch.full_like(a, float("nan"))
    grid = (triton.cdiv(a.numel(), 1024),)
    b = a if b is None else b
    _elementwise_kernel[grid](a, b, a if c is None else c, out, sin, a.numel(), OP=OPS.index(op), BLOCK=1024)
    return (out, sin) if op == "cos_sin" else out


def bf16_operands(count: int, seed: int) -> torch.Tensor:
    """Random bf16 bit patterns (every class: subnormals, inf, NaN) and values near one another's scale."""
    generator = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**15), 2**15, (count,), generator=generator, dtype=torch.int32).to(torch.int16)
    near = torch.randn(count, generator=generator).to(torch.bfloat16)
    return torch.cat([bits.view(torch.bfloat16), near])


@pytest.mark.parametrize("op", OPS[:5])
def test_bf16_arithmetic_is_torch(op):
    """In fp32, rounded once: torch's bf16 ops bit for bit (NaN stays NaN)."""
    a, b = bf16_operands(50_000, 1).to(DEVICE), bf16_operands(50_000, 2).to(DEVICE)
    expected = {
        "add": lambda: a + b,
        "sub": lambda: a - b,
        "mul": lambda: a * b,
        "max": lambda: torch.maximum(a, b),
        "less": lambda: torch.where(a < b, a, b),
    }[op]()
    actual = elementwise(op, a, b)
    nan = expected.isnan()
    assert actual[nan].isnan().all()
    assert_bit_identical(actual[~nan], expected[~nan])


@triton.jit
def _dot_kernel(a_ptr, b_ptr, out_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    rows, cols, ks = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
    a = tl.load(a_ptr + rows[:, None] * K + ks[None, :])
    b = tl.load(b_ptr + ks[:, None] * N + cols[None, :])
    acc = tl.dot(a, b, tl.full((M, N), 1.0, tl.float32))
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc)


@launcher
def dot_plus_one(a, b):
    out = torch.full((a.shape[0], b.shape[1]), float("nan"), device=a.device)
    _dot_kernel[(1,)](a, b, out, M=a.shape[0], N=b.shape[1], K=a.shape[1])
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_dots_accumulate_in_fp32(dtype):
    """acc + a @ b on the half values, in fp32: as the fp64 product to fp32's accumulation error."""
    a = (torch.randn(32, 64) * 4).to(dtype).to(DEVICE)
    b = torch.randn(64, 16).to(dtype).to(DEVICE)
    exact = a.double() @ b.double() + 1
    terms = a.double().abs() @ b.double().abs() + 1
    actual = dot_plus_one(a, b).double()
    assert ((actual - exact).abs() <= 64 * 2**-24 * terms).all(), (actual - exact).abs().max()


def correctly_rounded_fma(x: float, y: float, z: float) -> float:
    """x * y + z in exact rationals, rounded to fp32 to nearest even."""
    exact = Fraction(x) * Fraction(y) + Fraction(z)
    candidate = torch.tensor(float(exact), dtype=torch.float64).float()  # within one fp32 step of the answer
    neighbours = [torch.nextafter(candidate, torch.tensor(d)) for d in (-math.inf, math.inf)]
    best = min([candidate, *neighbours], key=lambda v: (abs(Fraction(v.item()) - exact), v.view(torch.int32) & 1))
    return best.item()


def test_fp32_fma_rounds_once():
    """Against exact rationals on products that cancel their addend, where rounding the product first errs."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(2000, generator=generator)
    y = torch.randn(2000, generator=generator)
    z = -(x.double() * y.double()).float() + torch.randn(2000, generator=generator) * 2**-30
    actual = elementwise("fma", x.to(DEVICE), y.to(DEVICE), z.to(DEVICE)).cpu()
    expected = torch.tensor([correctly_rounded_fma(*v) for v in zip(x.tolist(), y.tolist(), z.tolist())])
    assert_bit_identical(actual, expected)


def test_fast_dividef_within_two_ulp():
    """Within 2 ulp for |y| in [2**-126, 2**126]; 0 past 2**126, as the GPU's documented fast divide."""
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(20_000, generator=generator) * torch.logspace(-30, 30, 20_000)
    y = torch.randn(20_000, generator=generator).abs() * torch.logspace(-35, 35, 20_000) + 1
    actual = elementwise("fast_dividef", x.to(DEVICE), y.to(DEVICE)).cpu().double()
    exact = x.double() / y.double()
    normal = exact.abs() >= 2**-126
    ulp = 2.0 ** (torch.floor(torch.log2(exact[normal].abs())) - 23)
    assert ((actual[normal] - exact[normal]).abs() <= 2 * ulp).all()
    huge = torch.tensor([2.0**126 * 1.5, -(2.0**127)], device=DEVICE)
    assert (elementwise("fast_dividef", torch.full_like(huge, 3.0), huge) == 0).all()


def test_rint_rounds_half_to_even():
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 2.4999998, 1e10, -3.7], device=DEVICE)
    assert_bit_identical(elementwise("rint", x), torch.round(x))


def test_scoped_to_fused_vision_launches():
    """After a launch Triton is as it ships: no builder method replaced, the libdevice stubs back."""
    elementwise("rint", torch.ones(4, device=DEVICE))
    if DEVICE.type == "cpu":
        from triton.runtime.interpreter import interpreter_builder

        assert not set(vars(interpreter_builder)) & set(_interpreter._BUILDER)
    for name in _interpreter._LIBDEVICE:
        assert getattr(libdevice, name).__module__ == "triton.language.extra.libdevice", name


def test_an_unknown_triton_fails_loudly(monkeypatch):
    monkeypatch.setattr(triton, "__version__", "3.10.0")
    with pytest.raises(RuntimeError, match="Triton 3.10.0's is unknown"):
        with _interpreter.hardware_arithmetic():
            pass


def rope_angles_near_zeros() -> torch.Tensor:
    """fp32 angles within 64 steps of every multiple of pi / 2 up to 1024 (the rotary angles' range: positions
    below 1024 times inverse frequencies up to 1), where cos or sin is near zero and most sensitive."""
    multiples = torch.arange(1, 652, dtype=torch.float64) * (math.pi / 2)  # 0 itself: in the linspace
    centre = multiples.float()
    steps = torch.arange(-64, 65, dtype=torch.int32)
    bits = centre.view(torch.int32)[:, None] + steps[None, :]
    return torch.cat([bits.flatten().view(torch.float32), torch.linspace(-1024, 1024, 100_001)])


# The fast pair's whole error against float64 (reduction and approximation): the GPU documents 2**-21.19 (cos)
# and 2**-21.41 (sin) on [-pi, pi]; the reduction by 2 pi adds up to 2**-24 * |turns| * 2 pi's low part's error.
FAST_TRIG_BOUND = 2**-20.5


def test_fast_cos_sin_near_their_zeros():
    """qkv_norm_rope's fast cos and sin against float64's of the same fp32 angle, near every zero."""
    angle = rope_angles_near_zeros().to(DEVICE)
    cos, sin = elementwise("cos_sin", angle)
    exact = angle.cpu().double()
    cos_error = (cos.cpu().double() - exact.cos()).abs().max().item()
    sin_error = (sin.cpu().double() - exact.sin()).abs().max().item()
    assert max(cos_error, sin_error) <= FAST_TRIG_BOUND, (math.log2(cos_error), math.log2(sin_error))
