"""gate_up_gelu, the gate/up GEMM with the GELU gate in its epilogue, against stock's two steps and float64.

Stock runs the concatenated linear, rounds its output, then the gate; the kernel rounds its accumulators
where the linear's output rounds, then runs the gate kernel's own code. Only the GEMM's summation order
differs, so the output is as accurate as stock's against the float64 result, and within a few units in
the last place of stock's where the gate is not steep.
"""

import pytest
import torch

import fused_vision
from fused_vision import reference

from helpers import DEVICE, FLOAT_DTYPES, assert_as_accurate_as_stock, assert_bit_identical, dtype_id
from op_cases import CLAMPS

# (rows, D, I): blocks that pass the matrix (D not a multiple of the K block, I below the column block),
# and blocks shifted back to end at the last row and column (rows 130, I 200 over 64 x 128 tiles).
SHAPES = [(5, 48, 40), (130, 64, 200), (67, 128, 96)]


def inputs(rows, hidden, intermediate, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    y = torch.randn(rows, hidden, generator=generator)
    weight = torch.randn(2 * intermediate, hidden, generator=generator) * 2 / hidden**0.5
    return y.to(DEVICE, dtype), weight.to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("clipped", [False, True], ids=["plain", "clipped"])
def test_as_accurate_as_stock_against_float64(poisoned, dtype, shape, clipped):
    y, weight = inputs(*shape, dtype, seed=sum(shape))
    clamps = torch.tensor(CLAMPS, device=DEVICE) if clipped else None
    actual = fused_vision.gate_up_gelu(y, weight, clamps, backend="triton")
    stock = reference.gelu_gate(torch.nn.functional.linear(y, weight), clamps)
    exact = reference.gate_up_gelu(y.double(), weight.double(), clamps)
    assert actual.dtype == dtype and actual.shape == (shape[0], shape[2]) and actual.is_contiguous()
    assert_as_accurate_as_stock(actual, stock, exact, floor=2**-20)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("clipped", [False, True], ids=["plain", "clipped"])
def test_exact_sums_give_the_gate_kernels_bits(poisoned, dtype, clipped):
    """Where every sum is exact in fp32 in any order (y of -1, 0 and 1, weights k / 1024 with |k| < 128,
    over D = 48) but needs more bits than bf16 and fp16 hold, the accumulators round as the linear's output
    does and the epilogue sees what the separate gate kernel sees: its output, bit for bit."""
    generator = torch.Generator().manual_seed(6)
    y = torch.randint(-1, 2, (70, 48), generator=generator).to(DEVICE, dtype)
    weight = (torch.randint(-127, 128, (2 * 40, 48), generator=generator) / 1024).to(DEVICE, dtype)
    clamps = torch.tensor(CLAMPS, device=DEVICE) if clipped else None
    actual = fused_vision.gate_up_gelu(y, weight, clamps, backend="triton")
    expected = fused_vision.gelu_gate(torch.nn.functional.linear(y, weight), clamps, backend="triton")
    assert_bit_identical(actual, expected)


# The GEMM kernel's dtypes: float32 takes F.linear, whose blocking may follow the shape.
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
def test_leading_dimensions_and_a_strided_input(poisoned, dtype):
    y, weight = inputs(2 * 37, 64, 72, dtype, seed=3)
    strided = y.view(2, 37, 64).transpose(0, 1)  # (37, 2, 64), not contiguous
    actual = fused_vision.gate_up_gelu(strided, weight, backend="triton")
    rows = fused_vision.gate_up_gelu(strided.contiguous().view(-1, 64), weight, backend="triton")
    assert actual.shape == (37, 2, 72)
    assert_bit_identical(actual, rows.view(37, 2, 72), "the same rows, flattened")


def test_the_reference_is_stocks_two_steps(poisoned):
    y, weight = inputs(9, 48, 40, torch.bfloat16, seed=4)
    clamps = torch.tensor(CLAMPS, device=DEVICE)
    actual = fused_vision.gate_up_gelu(y, weight, clamps, backend="reference")
    assert_bit_identical(actual, reference.gelu_gate(torch.nn.functional.linear(y, weight), clamps))


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_gradients_are_stock_autograds(backend):
    y, weight = inputs(11, 48, 40, torch.float32, seed=5)
    clamps = torch.tensor(CLAMPS, device=DEVICE)
    cotangent = torch.randn(11, 40, device=DEVICE)
    leaves = [t.clone().requires_grad_() for t in (y, weight)]
    (fused_vision.gate_up_gelu(*leaves, clamps, backend=backend) * cotangent).sum().backward()
    stock = [t.clone().requires_grad_() for t in (y, weight)]
    (reference.gate_up_gelu(*stock, clamps) * cotangent).sum().backward()
    for name, got, wanted in zip(("y", "weight"), leaves, stock):
        assert_bit_identical(got.grad, wanted.grad, f"grad of {name}")


@pytest.mark.parametrize(
    "y_shape, weight_shape, weight_dtype, error, match",
    [
        ((4, 8), (6, 7), torch.float32, ValueError, r"weight: expected shape \(2 \* I, D\) = \(2 \* I, 8\)"),
        ((4, 8), (5, 8), torch.float32, ValueError, r"weight: expected shape \(2 \* I, D\)"),
        ((4, 0), (2, 0), torch.float32, ValueError, r"y: expected shape \(..., D\) with D >= 1"),
        ((4, 8), (6, 8), torch.bfloat16, TypeError, r"weight: expected y's dtype torch.float32"),
        ((4, 8), (6, 8, 1), torch.float32, ValueError, r"weight: expected 2 dimensions"),
    ],
)
def test_bad_inputs_name_the_argument(y_shape, weight_shape, weight_dtype, error, match):
    y = torch.randn(y_shape, device=DEVICE)
    weight = torch.randn(weight_shape, device=DEVICE).to(weight_dtype)
    with pytest.raises(error, match=match):
        fused_vision.gate_up_gelu(y, weight)
