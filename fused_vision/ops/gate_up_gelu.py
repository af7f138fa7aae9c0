"""The public gate/up GEMM with the GELU gate in its epilogue: validation, dispatch, autograd and
torch.library registration."""

import torch
import torch.nn.functional as F

from .. import reference
from .._dispatch import dispatch, route, untiled, warn_once
from .._validation import FLOAT_DTYPES, check_clamps, check_same_device, check_tensor
from ._recompute import reference_grads


def _check_inputs(y, weight, clamps):
    check_tensor("y", y, y.dim() if isinstance(y, torch.Tensor) else 1, FLOAT_DTYPES)
    check_tensor("weight", weight, 2, FLOAT_DTYPES)
    if y.dim() == 0 or y.shape[-1] == 0:
        raise ValueError(f"y: expected shape (..., D) with D >= 1, got {tuple(y.shape)}")
    if weight.shape[0] == 0 or weight.shape[0] % 2 or weight.shape[1] != y.shape[-1]:
        raise ValueError(
            f"weight: expected shape (2 * I, D) = (2 * I, {y.shape[-1]}) with I >= 1, got {tuple(weight.shape)}"
        )
    if weight.dtype != y.dtype:
        raise TypeError(f"weight: expected y's dtype {y.dtype}, got {weight.dtype}")
    check_clamps(clamps, 3, "gate, up, down input")
    check_same_device(y=y, weight=weight, clamps=clamps)


def _triton(y, weight, clamps):
    from ..kernels.gate_up_gelu import gate_up_gelu as launch
    from ..kernels.gate_up_gelu import gpu_configs

    # ieee dots in a Triton GEMM lose to cuBLAS's fp32 GEMM: it stays. So does the GEMM of a device without a
    # tile for the dtype (a T4, whose tensor cores cuBLAS uses and Triton does not: bench/NOTES.md).
    why = None if y.dtype == torch.float32 else untiled(gpu_configs, y.dtype, y.device)
    if y.dtype == torch.float32 or why:
        from ..kernels.gelu_gate import gelu_gate as launch_gate  # inputs checked here: the launcher alone

        if why:
            warn_once(f"fused_vision.gate_up_gelu: its kernel {why}: cuBLAS's GEMM and the gate kernel run it", 4)
        return launch_gate(F.linear(y, weight), clamps)

    rows = launch(y.reshape(-1, y.shape[-1]).contiguous(), weight.contiguous(), clamps)
    return rows.view(*y.shape[:-1], weight.shape[0] // 2)


def _reference(y, weight, clamps):
    return reference.gate_up_gelu(y, weight, clamps).contiguous()


def _forward(y, weight, clamps, backend):
    return dispatch("gate_up_gelu", backend, y.device, _triton, _reference, y, weight, clamps)


@torch.library.custom_op("fused_vision::gate_up_gelu", mutates_args=())
def _gate_up_gelu_op(y: torch.Tensor, weight: torch.Tensor, clamps: torch.Tensor | None, backend: str) -> torch.Tensor:
    return _forward(y, weight, clamps, backend)


@_gate_up_gelu_op.register_fake
def _(y, weight, clamps, backend):
    return y.new_empty((*y.shape[:-1], weight.shape[0] // 2))


def _setup_context(ctx, inputs, output):
    y, weight, clamps, backend = inputs
    ctx.save_for_backward(y, weight, clamps)


def _backward(ctx, grad):
    """Autograd through the reference, recomputed (no backward kernel): stock autograd's gradients."""
    return *reference_grads(lambda *t: (reference.gate_up_gelu(*t),), ctx, ctx.saved_tensors, (grad,)), None


_gate_up_gelu_op.register_autograd(_backward, setup_context=_setup_context)


def gate_up_gelu(
    y: torch.Tensor, weight: torch.Tensor, clamps: torch.Tensor | None = None, *, backend: str = "auto"
) -> torch.Tensor:
    """Gemma 4 vision MLP's ``gelu_tanh(gate_proj(y)) * up_proj(y)``, the GEMM and the gate in one kernel.

    Args:
        y: (..., D) float32, float16 or bfloat16: the MLP's input (after gate's and up's input clamps).
        weight: (2 I, D) in y's dtype: gate_proj's and up_proj's weights stacked, gate first.
        clamps: optional (3, 2) float32 (min, max) of gate_proj's and up_proj's output clamps and
            down_proj's input clamp (Gemma4ClippableLinear, E2B/E4B); none without.
        backend: "auto", "triton" or "reference" (see ``fused_vision._dispatch``).

    Returns:
        A new contiguous (..., I) tensor in y's dtype, down_proj's input: ``gelu_gate(F.linear(y, weight),
        clamps)`` up to the GEMM's summation order (each accumulator rounds to the dtype, as the linears'
        outputs, before the gate). bf16 and fp16 run one Triton GEMM whose epilogue is the gate; float32,
        and a dtype the device has no tile for (docs/compatibility.md), run cuBLAS's GEMM and the gate
        kernel, the latter warned once. Differentiable in y and weight.
    """
    _check_inputs(y, weight, clamps)
    return route(
        "gate_up_gelu", backend, (y, weight, clamps), reference=_reference, registered=_gate_up_gelu_op, direct=_forward
    )
