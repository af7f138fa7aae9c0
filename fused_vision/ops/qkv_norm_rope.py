"""The public q/k/v epilogue of Gemma 4 vision attention: validation, dispatch, autograd and torch.library
registration."""

import torch

from .. import reference
from .._dispatch import dispatch, route
from .._validation import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_clamps,
    check_eps,
    check_norm_weight,
    check_same_device,
    check_shape,
    check_tensor,
)
from ._recompute import reference_grads


def _check_inputs(qkv, position_ids, q_weight, k_weight, inv_freq, num_heads, num_kv_heads, eps, clamps):
    check_tensor("qkv", qkv, 2, FLOAT_DTYPES)
    check_tensor("q_weight", q_weight, 1, FLOAT_DTYPES)
    head_dim = q_weight.shape[0]
    if head_dim == 0 or head_dim % 4:
        raise ValueError(f"q_weight: expected shape (head_dim,) with head_dim a positive multiple of 4, got {head_dim}")
    check_norm_weight("k_weight", k_weight, head_dim, "(head_dim,)")
    for name, heads in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
        if isinstance(heads, bool) or not isinstance(heads, (int, torch.SymInt)) or heads < 1:
            raise ValueError(f"{name}: expected a positive int, got {heads!r}")
    columns = (num_heads + 2 * num_kv_heads) * head_dim
    check_shape("qkv", qkv, (qkv.shape[0], columns), "(T, (num_heads + 2 * num_kv_heads) * head_dim)")
    check_tensor("position_ids", position_ids, 2, INDEX_DTYPES)
    check_shape("position_ids", position_ids, (qkv.shape[0], 2), "(T, 2)")
    check_tensor("inv_freq", inv_freq, 1, (torch.float32,))
    check_shape("inv_freq", inv_freq, (head_dim // 4,), "(head_dim // 4,)")
    check_eps(eps)
    check_clamps(clamps, 3, "q, k, v")
    check_same_device(
        qkv=qkv, position_ids=position_ids, q_weight=q_weight, k_weight=k_weight, inv_freq=inv_freq, clamps=clamps
    )


def _triton(*args):
    from ..kernels.qkv_norm_rope import qkv_norm_rope as launch

    return launch(*args)


def _reference(*args):
    # Contiguous, as the kernel's outputs and the op's fake, on every path.
    return tuple(t.contiguous() for t in reference.qkv_norm_rope(*args))


def _forward(qkv, position_ids, q_weight, k_weight, inv_freq, num_heads, num_kv_heads, eps, clamps, backend):
    args = (qkv, position_ids, q_weight, k_weight, inv_freq, num_heads, num_kv_heads, eps, clamps)
    return dispatch("qkv_norm_rope", backend, qkv.device, _triton, _reference, *args)


@torch.library.custom_op("fused_vision::qkv_norm_rope", mutates_args=())
def _qkv_norm_rope_op(
    qkv: torch.Tensor,
    position_ids: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    inv_freq: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    eps: float,
    clamps: torch.Tensor | None,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward(qkv, position_ids, q_weight, k_weight, inv_freq, num_heads, num_kv_heads, eps, clamps, backend)


@_qkv_norm_rope_op.register_fake
def _(qkv, position_ids, q_weight, k_weight, inv_freq, num_heads, num_kv_heads, eps, clamps, backend):
    tokens, head_dim = qkv.shape[0], q_weight.shape[0]
    kv = qkv.new_empty((tokens, num_kv_heads, head_dim))
    return qkv.new_empty((tokens, num_heads, head_dim)), kv, torch.empty_like(kv)


def _setup_context(ctx, inputs, output):
    qkv, position_ids, q_weight, k_weight, inv_freq, num_heads, num_kv_heads, eps, clamps, backend = inputs
    ctx.save_for_backward(qkv, position_ids, q_weight, k_weight, inv_freq, clamps)
    ctx.heads, ctx.eps = (num_heads, num_kv_heads), eps


def _backward(ctx, grad_q, grad_k, grad_v):
    """Autograd through the reference, recomputed (no backward kernel yet): stock autograd's gradients."""
    qkv, position_ids, q_weight, k_weight, inv_freq, clamps = ctx.saved_tensors
    num_heads, num_kv_heads = ctx.heads

    def recompute(qkv, position_ids, q_weight, k_weight, inv_freq, clamps):
        return reference.qkv_norm_rope(qkv, position_ids, q_weight, k_weight, inv_freq, *ctx.heads, ctx.eps, clamps)

    inputs = (qkv, position_ids, q_weight, k_weight, inv_freq, clamps)
    grads = reference_grads(recompute, ctx, inputs, (grad_q, grad_k, grad_v))
    return *grads[:5], None, None, None, grads[5], None


_qkv_norm_rope_op.register_autograd(_backward, setup_context=_setup_context)


def qkv_norm_rope(
    qkv: torch.Tensor,
    position_ids: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    inv_freq: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    *,
    eps: float = 1e-6,
    clamps: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gemma 4 vision attention from its projections to the attention call, in one pass.

    Args:
        qkv: (T, (H + 2 Hkv) d) float32, float16 or bfloat16: q, k and v projections side by side (one
            fused QKV GEMM's output, or ``torch.cat`` of the three), tokens packed.
        position_ids: (T, 2) int32 or int64 (x, y) patch positions, used as stock uses them (padding's
            (-1, -1) included).
        q_weight, k_weight: (d,) q_norm's and k_norm's weights (multiplied as ``weight``, not 1 + weight);
            v_norm has none. d must be a multiple of 4.
        inv_freq: (d // 4,) float32, the vision rotary embedding's inverse frequencies.
        num_heads, num_kv_heads: H and Hkv.
        eps: the norms' epsilon (config.rms_norm_eps).
        clamps: optional (3, 2) float32 (min, max) of q_proj's, k_proj's and v_proj's output clamps
            (Gemma4ClippableLinear, E2B/E4B).
        backend: "auto", "triton" or "reference" (see ``fused_vision._dispatch``).

    Returns:
        New contiguous q (T, H, d), k and v (T, Hkv, d) in qkv's dtype, the layout varlen attention takes:
        within one rounding of the hidden dtype of stock's (the norm's fp32 sum order, cos and sin).
        Differentiable in qkv, the weights and inv_freq.
    """
    args = (qkv, position_ids, q_weight, k_weight, inv_freq, num_heads, num_kv_heads, eps, clamps)
    _check_inputs(*args)
    return route("qkv_norm_rope", backend, args, reference=_reference, registered=_qkv_norm_rope_op, direct=_forward)
