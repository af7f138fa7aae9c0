"""The public q/k/v epilogue of Gemma 4 vision attention: validation, dispatch, autograd and torch.library
registration."""

import torch

from .. import reference
from .._dispatch import check_backend, dispatch, reference_only, through_dispatcher
from .._validation import check_qkv_norm_rope_inputs
from ._recompute import reference_grads


def _triton(*args):
    from ..kernels.qkv_norm_rope import qkv_norm_rope as launch

    return launch(*args)


def _forward(qkv, position_ids, q_weight, k_weight, inv_freq, num_heads, num_kv_heads, eps, clamps, backend):
    args = (qkv, position_ids, q_weight, k_weight, inv_freq, num_heads, num_kv_heads, eps, clamps)
    return dispatch("qkv_norm_rope", backend, qkv.device, _triton, reference.qkv_norm_rope, *args)


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
    check_qkv_norm_rope_inputs(*args)
    check_backend(backend)
    tensors = (qkv, position_ids, q_weight, k_weight, inv_freq, clamps)
    if reference_only("qkv_norm_rope", backend, *tensors):
        return reference.qkv_norm_rope(*args)
    if through_dispatcher(*tensors):
        return _qkv_norm_rope_op(*args, backend)
    return _forward(*args, backend)
