"""The public residual add between Gemma 4's RMS norms: validation, dispatch, autograd and torch.library
registration."""

import torch

from .. import reference
from .._dispatch import dispatch, route
from .._validation import FLOAT_DTYPES, check_eps, check_norm_weight, check_same_device, check_shape, check_tensor
from ._recompute import reference_grads


def _check_inputs(x, residual, post_weight, next_weight, eps):
    check_tensor("x", x, x.dim() if isinstance(x, torch.Tensor) else 1, FLOAT_DTYPES)
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"x: expected shape (..., D) with D >= 1, got {tuple(x.shape)}")
    check_tensor("residual", residual, x.dim(), (x.dtype,))
    check_shape("residual", residual, x.shape, "x's shape")
    check_tensor("post_weight", post_weight, 1, FLOAT_DTYPES)
    check_norm_weight("post_weight", post_weight, x.shape[-1], "(D,)")
    check_norm_weight("next_weight", next_weight, x.shape[-1], "(D,)")
    check_eps(eps)
    check_same_device(x=x, residual=residual, post_weight=post_weight, next_weight=next_weight)


def _triton(*args):
    from ..kernels.residual_rms_norm import residual_rms_norm as launch

    return launch(*args)


def _reference(x, residual, post_weight, next_weight, eps):
    h, y = reference.residual_rms_norm(x, residual, post_weight, next_weight, eps)
    # Contiguous, as the kernel's outputs and the op's fake, whatever the inputs' strides.
    return h.contiguous(), None if y is None else y.contiguous()


def _forward(x, residual, post_weight, next_weight, eps, backend):
    args = (x, residual, post_weight, next_weight, eps)
    return dispatch("residual_rms_norm", backend, x.device, _triton, _reference, *args)


@torch.library.custom_op("fused_vision::residual_rms_norm", mutates_args=())
def _residual_rms_norm_op(
    x: torch.Tensor,
    residual: torch.Tensor,
    post_weight: torch.Tensor,
    next_weight: torch.Tensor | None,
    eps: float,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    h, y = _forward(x, residual, post_weight, next_weight, eps, backend)
    # Without a next norm, an empty y: a custom op returns tensors only.
    return h, x.new_empty((0,)) if y is None else y


@_residual_rms_norm_op.register_fake
def _(x, residual, post_weight, next_weight, eps, backend):
    return x.new_empty(x.shape), x.new_empty((0,) if next_weight is None else x.shape)


def _setup_context(ctx, inputs, output):
    x, residual, post_weight, next_weight, eps, backend = inputs
    ctx.save_for_backward(x, residual, post_weight, next_weight)
    ctx.eps = eps


def _backward(ctx, grad_h, grad_y):
    """Autograd through the reference, recomputed (no backward kernel yet): stock autograd's gradients."""

    def recompute(x, residual, post_weight, next_weight):
        return reference.residual_rms_norm(x, residual, post_weight, next_weight, ctx.eps)

    return *reference_grads(recompute, ctx, ctx.saved_tensors, (grad_h, grad_y)), None, None


_residual_rms_norm_op.register_autograd(_backward, setup_context=_setup_context)


def _through_op(x, residual, post_weight, next_weight, eps, backend):
    """The registered op, whose y is an empty tensor without ``next_weight`` (an op returns no None)."""
    h, y = _residual_rms_norm_op(x, residual, post_weight, next_weight, eps, backend)
    return h, None if next_weight is None else y


def residual_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    post_weight: torch.Tensor,
    next_weight: torch.Tensor | None = None,
    *,
    eps: float = 1e-6,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gemma 4's ``h = residual + post_norm(x)``, then ``y = next_norm(h)``, in one pass.

    Args:
        x: (..., D) float32, float16 or bfloat16: the attention's or the MLP's output.
        residual: x's shape and dtype: the layer's residual stream.
        post_weight: (D,) post_attention_layernorm's or post_feedforward_layernorm's weight.
        next_weight: optional (D,) weight of the norm that reads h next (pre_feedforward_layernorm, or the
            next layer's input_layernorm); None after the tower's last layer.
        eps: the norms' epsilon (config.rms_norm_eps).
        backend: "auto", "triton" or "reference" (see ``fused_vision._dispatch``).

    Returns:
        New contiguous (h, y) in x's dtype (y None without ``next_weight``), fp32 inside and rounded as
        stock's layer rounds: within one rounding of the hidden dtype (the norms' fp32 sum order).
        Differentiable in x, residual and both weights.
    """
    _check_inputs(x, residual, post_weight, next_weight, eps)
    args = (x, residual, post_weight, next_weight, eps)
    return route("residual_rms_norm", backend, args, reference=_reference, registered=_through_op, direct=_forward)
