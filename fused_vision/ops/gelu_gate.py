"""The public Gemma 4 vision MLP activation: validation, dispatch, autograd and torch.library registration."""

import torch

from .. import reference
from .._dispatch import dispatch, route
from .._validation import FLOAT_DTYPES, check_clamps, check_same_device, check_tensor
from ._recompute import reference_grads


def _check_inputs(gate_up, clamps):
    check_tensor("gate_up", gate_up, gate_up.dim() if isinstance(gate_up, torch.Tensor) else 1, FLOAT_DTYPES)
    if gate_up.dim() == 0 or gate_up.shape[-1] == 0 or gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up: expected shape (..., 2 * I) with I >= 1, got {tuple(gate_up.shape)}")
    check_clamps(clamps, 3, "gate, up, down input")
    check_same_device(gate_up=gate_up, clamps=clamps)


def _triton(gate_up, clamps):
    from ..kernels.gelu_gate import gelu_gate as launch

    return launch(gate_up, clamps)


def _reference(gate_up, clamps):
    return reference.gelu_gate(gate_up, clamps).contiguous()


def _forward(gate_up, clamps, backend):
    return dispatch("gelu_gate", backend, gate_up.device, _triton, _reference, gate_up, clamps)


@torch.library.custom_op("fused_vision::gelu_gate", mutates_args=())
def _gelu_gate_op(gate_up: torch.Tensor, clamps: torch.Tensor | None, backend: str) -> torch.Tensor:
    return _forward(gate_up, clamps, backend)


@_gelu_gate_op.register_fake
def _(gate_up, clamps, backend):
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


def _setup_context(ctx, inputs, output):
    gate_up, clamps, backend = inputs
    ctx.save_for_backward(gate_up, clamps)


def _backward(ctx, grad):
    """Autograd through the reference, recomputed (no backward kernel yet): stock autograd's gradients."""
    return *reference_grads(lambda *t: (reference.gelu_gate(*t),), ctx, ctx.saved_tensors, (grad,)), None


_gelu_gate_op.register_autograd(_backward, setup_context=_setup_context)


def gelu_gate(gate_up: torch.Tensor, clamps: torch.Tensor | None = None, *, backend: str = "auto") -> torch.Tensor:
    """Gemma 4 vision MLP's ``gelu_tanh(gate) * up`` in one pass.

    Args:
        gate_up: (..., 2 I) float32, float16 or bfloat16: gate_proj's and up_proj's outputs side by side,
            gate first (one fused GEMM's output, or ``torch.cat`` of the two).
        clamps: optional (3, 2) float32 (min, max) of gate_proj's and up_proj's output clamps and
            down_proj's input clamp (Gemma4ClippableLinear, E2B/E4B); none without.
        backend: "auto", "triton" or "reference" (see ``fused_vision._dispatch``).

    Returns:
        A new contiguous (..., I) tensor in gate_up's dtype, down_proj's input. The GELU rounds to the
        hidden dtype and the product rounds again, as stock: within one rounding of stock's GELU (another
        tanh), so within two units in the last place of stock's product. Differentiable in gate_up.
    """
    _check_inputs(gate_up, clamps)
    return route(
        "gelu_gate", backend, (gate_up, clamps), reference=_reference, registered=_gelu_gate_op, direct=_forward
    )
