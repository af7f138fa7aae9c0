"""residual_rms_norm against the reference and the reference against transformers' Gemma4RMSNorm.

The reference is stock's layer code: bit-identical to ``residual + post_norm(x)`` and ``next_norm(h)``. The
kernel rounds where stock rounds but sums the squares in another order: post_norm's output and y within one
rounding of the hidden dtype of stock's (given the same h), plus in fp32 the sum order's own error (at most
D * 2**-25 relative), and h within that of post_norm's output plus its own rounding.
Where the sums are exact in any order, bit-identical.
"""

import pytest
import torch

import fused_vision
from fused_vision import reference

from helpers import DEVICE, FLOAT_DTYPES, assert_bit_identical, dtype_id
from op_cases import EPS, ULP, assert_within, exactly_summable, sum_order_error

BACKENDS = ["triton", "reference"]


def make_case(shape, dtype):
    x, residual = (torch.randn(shape).to(DEVICE, dtype) for _ in range(2))
    weights = [(1 + 0.3 * torch.randn(shape[-1])).to(DEVICE, dtype) for _ in range(2)]
    return x, residual, *weights


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", [(3, 23, 96), (41, 200), (5, 1)], ids=str)
@pytest.mark.parametrize("last_layer", [False, True], ids=["next_norm", "last_layer"])
def test_matches_reference(poisoned, backend, dtype, shape, last_layer):
    x, residual, post_weight, next_weight = make_case(shape, dtype)
    next_weight = None if last_layer else next_weight
    h, y = fused_vision.residual_rms_norm(x, residual, post_weight, next_weight, eps=EPS, backend=backend)
    expected_h, expected_y = reference.residual_rms_norm(x, residual, post_weight, next_weight, EPS)
    assert h.is_contiguous() and (y is None) == last_layer
    if backend == "reference":
        assert_bit_identical(h, expected_h, "h")
        if not last_layer:
            assert_bit_identical(y, expected_y, "y")
        return
    ulp, norm_error = ULP[dtype], ULP[dtype] + sum_order_error(shape[-1])
    normed = reference.rms_norm(x, post_weight, EPS).double()
    assert_within(h, expected_h, norm_error * normed.abs() + ulp * expected_h.double().abs(), "h")
    if not last_layer:
        own = reference.rms_norm(h, next_weight, EPS)  # y of the kernel's own h, as stock computes it
        assert y.is_contiguous()
        assert_within(y, own, norm_error * own.double().abs(), "y")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_only_the_inverse_rms_differs_where_the_sums_are_exact(poisoned, dtype):
    """Exactly summable x: what is left to differ is the inverse RMS (the hardware's rsqrt, not torch's
    correctly rounded power), within 4 of fp32's ulps, which may move a rounding by one unit: no allowance
    for the sums' order. With post_norm's weight 0, h is the residual bit for bit."""
    x, residual, post_weight, next_weight = make_case((37, 72), dtype)
    x = exactly_summable(37, 72, dtype=dtype)
    h, _ = fused_vision.residual_rms_norm(x, residual, post_weight, next_weight, eps=EPS, backend="triton")
    expected_h, _ = reference.residual_rms_norm(x, residual, post_weight, next_weight, EPS)
    normed = reference.rms_norm(x, post_weight, EPS).double().abs()
    inverse_error = 4 * ULP[torch.float32]
    assert_within(h, expected_h, (ULP[dtype] + inverse_error) * normed + ULP[dtype] * expected_h.double().abs(), "h")
    residual = exactly_summable(37, 72, dtype=dtype)
    h, y = fused_vision.residual_rms_norm(x, residual, 0 * post_weight, next_weight, eps=EPS, backend="triton")
    assert_bit_identical(h, residual, "h")
    own = reference.rms_norm(h, next_weight, EPS)
    assert_within(y, own, (ULP[dtype] + inverse_error) * own.double().abs(), "y")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_reference_is_stock_layer(dtype):
    """Gemma4VisionEncoderLayer's ``residual + post_attention_layernorm(x)``, then
    ``pre_feedforward_layernorm``, with transformers' own norms: bit for bit."""
    modeling = pytest.importorskip("transformers.models.gemma4.modeling_gemma4")
    post, pre = modeling.Gemma4RMSNorm(64, eps=EPS), modeling.Gemma4RMSNorm(64, eps=EPS)
    with torch.no_grad():
        for norm in (post, pre):
            norm.weight.copy_(1 + 0.3 * torch.randn(64))
    post, pre = post.to(DEVICE, dtype), pre.to(DEVICE, dtype)
    x, residual = (torch.randn(2, 19, 64, device=DEVICE).to(dtype) for _ in range(2))
    with torch.no_grad():
        stock_h = residual + post(x)
        h, y = reference.residual_rms_norm(x, residual, post.weight, pre.weight, EPS)
        assert_bit_identical(h, stock_h, "h")
        assert_bit_identical(y, pre(stock_h), "y")


@pytest.mark.parametrize("backend", BACKENDS)
def test_special_values_and_strides(poisoned, backend):
    """A NaN or inf in x spreads over its row only, as stock's; strided inputs are read through their strides."""
    x, residual, post_weight, next_weight = make_case((9, 40), torch.float16)
    x[2, 3], x[4, 0] = float("nan"), float("inf")
    x_strided = torch.cat([x, x], dim=-1)[:, :40]
    residual_strided = residual.t().contiguous().t()
    h, y = fused_vision.residual_rms_norm(x_strided, residual_strided, post_weight, next_weight, backend=backend)
    expected_h, expected_y = reference.residual_rms_norm(x, residual, post_weight, next_weight, EPS)
    assert torch.equal(h.isnan(), expected_h.isnan()) and torch.equal(y.isnan(), expected_y.isnan())
    assert h[2].isnan().all() and not h[[0, 1, 3]].isnan().any()


@pytest.mark.parametrize("last_layer", [False, True], ids=["next_norm", "last_layer"])
def test_strided_weights_past_a_masked_tail(last_layer):
    """Weights read through their strides where the row's tail passes D (100 = 64 + 64, masked past 100): the
    same h and y as from contiguous copies."""
    x, residual, *weights = make_case((5, 100), torch.float32)
    strided = [torch.stack([weight, -weight], dim=-1)[:, 0] for weight in weights]
    if last_layer:
        weights[1] = strided[1] = None
    h, y = fused_vision.residual_rms_norm(x, residual, *strided, backend="triton")
    expected_h, expected_y = fused_vision.residual_rms_norm(x, residual, *weights, backend="triton")
    assert_bit_identical(h, expected_h, "h")
    if not last_layer:
        assert_bit_identical(y, expected_y, "y")


@pytest.mark.parametrize(
    "change,error",
    [
        (dict(residual=torch.zeros(4, 7)), "residual: expected shape"),
        (dict(post_weight=torch.ones(7)), "post_weight: expected shape"),
        (dict(next_weight=torch.ones(1, 8)), "next_weight: expected 1 dimensions"),
        (dict(eps=-1.0), "eps: expected"),
    ],
)
def test_errors(change, error):
    args = dict(x=torch.zeros(4, 8), residual=torch.zeros(4, 8), post_weight=torch.ones(8), next_weight=None, eps=EPS)
    with pytest.raises((ValueError, TypeError), match=error):
        fused_vision.residual_rms_norm(**args | change)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("last_layer", [False, True], ids=["next_norm", "last_layer"])
def test_backward_is_autograd_through_the_reference(backend, last_layer):
    inputs = [t.clone().requires_grad_() for t in make_case((3, 11, 48), torch.float32)]
    if last_layer:
        inputs = inputs[:3]
    grads = [torch.randn(3, 11, 48, device=DEVICE) for _ in range(2 - last_layer)]

    def outputs(fn, **kwargs):
        return [t for t in fn(*inputs, **kwargs) if t is not None]

    actual = torch.autograd.grad(outputs(fused_vision.residual_rms_norm, backend=backend), inputs, grads)
    expected = torch.autograd.grad(outputs(reference.residual_rms_norm), inputs, grads)
    for name, a, e in zip(["x", "residual", "post_weight", "next_weight"], actual, expected):
        assert_bit_identical(a, e, f"grad of {name}")
