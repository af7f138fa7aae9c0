"""gelu_gate against the reference and the reference against transformers' Gemma4VisionMLP.

The reference is stock's ops: bit-identical to the MLP's ``act_fn(gate) * up``, clamps included. The
kernel rounds where stock rounds (the GELU, then the product), but its tanh is not stock's: its GELU is
within one rounding of the hidden dtype of stock's, the product within two units in the last place. Where
stock's ``1 + tanh(u)`` cancels (gate below about -3) both sit up to 2**-23 |gate| from the exact GELU,
which the bound allows too. Clamped values are exact.
"""

import pytest
import torch

import fused_vision
from fused_vision import reference

from helpers import DEVICE, FLOAT_DTYPES, assert_bit_identical, dtype_id
from op_cases import CLAMPS, ULP, assert_within

BACKENDS = ["triton", "reference"]


def bound(gate_up, expected, units):
    gate, up = (t.double().abs() for t in gate_up.chunk(2, dim=-1))
    return units * ULP[gate_up.dtype] * expected.double().abs() + 2**-22 * gate * up + 2**-24


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", [(3, 29, 2 * 96), (77, 2 * 200), (4, 2)], ids=str)
@pytest.mark.parametrize("clipped", [False, True], ids=["plain", "clipped"])
def test_matches_reference(poisoned, backend, dtype, shape, clipped):
    gate_up = (3 * torch.randn(shape)).to(DEVICE, dtype)
    clamps = torch.tensor(CLAMPS, device=DEVICE) if clipped else None
    actual = fused_vision.gelu_gate(gate_up, clamps, backend=backend)
    expected = reference.gelu_gate(gate_up, clamps)
    assert actual.is_contiguous()
    if backend == "reference":
        assert_bit_identical(actual, expected)
    else:
        assert_within(actual, expected, bound(gate_up, expected, 2))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_gelu_within_one_rounding(poisoned, dtype):
    """With up = 1 the product is exact: what is left is the GELU's one rounding."""
    gate = torch.linspace(-12, 12, 4001).to(DEVICE, dtype)
    gate_up = torch.cat([gate, torch.ones_like(gate)])[None]
    expected = reference.gelu_gate(gate_up)
    assert_within(fused_vision.gelu_gate(gate_up, backend="triton"), expected, bound(gate_up, expected, 1))


@pytest.mark.parametrize("backend", BACKENDS)
def test_clamps_saturate_exactly(poisoned, backend):
    """Clamped outputs equal the bounds, rounded to the hidden dtype, bit for bit; NaN passes the clamps
    (as a NaN: its sign and payload are not kept)."""
    gate_up = torch.tensor([[50.0, -50.0, float("nan"), 1.0, 40.0, 2.0, 0.5, float("nan")]], device=DEVICE)
    gate_up = gate_up.to(torch.bfloat16)
    clamps = torch.tensor([[-1.0, 1.1], [-2.0, 3.3], [-0.7, 0.6]], device=DEVICE)
    actual = fused_vision.gelu_gate(gate_up, clamps, backend=backend)
    expected = reference.gelu_gate(gate_up, clamps)
    assert_bit_identical(actual[:, :2], expected[:, :2])
    assert actual[0, 0] == torch.tensor(0.6).to(torch.bfloat16) and actual[0, 2:].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_reference_is_stock_mlp(dtype):
    """Gemma4VisionMLP with clipped linears (E2B/E4B): down_proj of the reference on the concatenated
    gate and up projections is the MLP's output, bit for bit."""
    modeling = pytest.importorskip("transformers.models.gemma4.modeling_gemma4")
    config = modeling.Gemma4VisionConfig(hidden_size=32, intermediate_size=72, use_clipped_linears=True)
    mlp = modeling.Gemma4VisionMLP(config)
    with torch.no_grad():
        for parameter in mlp.parameters():
            parameter.copy_(torch.randn_like(parameter) * 0.5)
        for projection, bounds in zip((mlp.gate_proj, mlp.up_proj, mlp.down_proj), CLAMPS):
            projection.output_min.fill_(bounds[0])
            projection.output_max.fill_(bounds[1])
        mlp.down_proj.input_min.fill_(CLAMPS[2][0])
        mlp.down_proj.input_max.fill_(CLAMPS[2][1])
    mlp = mlp.to(DEVICE, dtype)
    x = torch.randn(3, 17, 32, device=DEVICE).to(dtype)
    with torch.no_grad():
        gate_up = torch.cat([mlp.gate_proj.linear(x), mlp.up_proj.linear(x)], dim=-1)
        clamps = torch.tensor([[p.output_min, p.output_max] for p in (mlp.gate_proj, mlp.up_proj)] + [CLAMPS[2]])
        hidden = reference.gelu_gate(gate_up, clamps.to(DEVICE))
        ours = torch.clamp(mlp.down_proj.linear(hidden), mlp.down_proj.output_min, mlp.down_proj.output_max)
        assert_bit_identical(ours, mlp(x))


@pytest.mark.parametrize(
    "gate_up,clamps,error",
    [
        (torch.zeros(4, 7), None, "gate_up: expected shape"),
        (torch.zeros(4, 8), torch.zeros(2, 2), "clamps: expected shape"),
        (torch.zeros(4, 8), torch.zeros(3, 2, dtype=torch.float16), "clamps: expected dtype"),
    ],
)
def test_errors(gate_up, clamps, error):
    with pytest.raises((ValueError, TypeError), match=error):
        fused_vision.gelu_gate(gate_up, clamps)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("clipped", [False, True], ids=["plain", "clipped"])
def test_backward_is_autograd_through_the_reference(backend, clipped):
    gate_up = (2 * torch.randn(5, 9, 2 * 24, device=DEVICE)).requires_grad_()
    clamps = torch.tensor(CLAMPS, device=DEVICE) if clipped else None
    grad = torch.randn(5, 9, 24, device=DEVICE)
    (actual,) = torch.autograd.grad(fused_vision.gelu_gate(gate_up, clamps, backend=backend), gate_up, grad)
    (expected,) = torch.autograd.grad(reference.gelu_gate(gate_up, clamps), gate_up, grad)
    assert_bit_identical(actual, expected)
