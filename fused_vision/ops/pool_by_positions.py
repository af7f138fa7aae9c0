"""The public Gemma 4 pooler: k x k averages by patch position without the (B, N, L) one-hot."""

import torch

from .. import reference
from .._dispatch import dispatch, every_item, route
from .._validation import (
    FLOAT_DTYPES,
    check_ids_and_padding,
    check_same_device,
    check_shape,
    check_tensor,
    id_checks_enabled,
)


def _check_inputs(
    hidden_states: torch.Tensor,
    position_ids: torch.Tensor,
    padding_positions: torch.Tensor,
    output_length,
    round_average,
) -> None:
    check_tensor("hidden_states", hidden_states, 3, FLOAT_DTYPES)
    if not isinstance(round_average, bool):
        raise TypeError(f"round_average: expected a bool, got {type(round_average).__name__}")
    batch, seq_len = check_ids_and_padding(position_ids, padding_positions)
    if padding_positions is None:
        raise TypeError("padding_positions: expected a (B, N) bool tensor, got None")
    check_shape("hidden_states", hidden_states, (batch, seq_len, hidden_states.shape[2]), "(B, N, D) like position_ids")
    # A SymInt under torch.compile with dynamic shapes (transformers computes L from a tensor's shape).
    if isinstance(output_length, bool) or not isinstance(output_length, (int, torch.SymInt)) or output_length < 1:
        raise ValueError(f"output_length: expected a positive int, got {output_length!r}")
    check_same_device(hidden_states=hidden_states, position_ids=position_ids, padding_positions=padding_positions)


def _triton(hidden_states, position_ids, padding_positions, output_length, round_average):
    from ..kernels.pool_by_positions import pool_by_positions as launch

    seq_len = hidden_states.shape[1]
    if seq_len == output_length:  # no pooling: stock's masked scale, nothing for a kernel to fuse
        return reference.pool_by_positions(hidden_states, position_ids, padding_positions, output_length)
    k = reference.pooling_kernel_size(seq_len, output_length)
    pooled, mask, overflow = launch(
        hidden_states, position_ids, padding_positions, output_length, k, round_average=round_average
    )
    if id_checks_enabled(position_ids, guarded=True) and overflow.any():  # on a GPU, a device-to-host sync
        raise reference.slot_overflow_error(k, output_length)
    return pooled, mask


def _reference(hidden_states, position_ids, padding_positions, output_length, round_average):
    seq_len = hidden_states.shape[1]
    if seq_len != output_length and id_checks_enabled(position_ids, guarded=True):
        k = reference.pooling_kernel_size(seq_len, output_length)
        # One device-to-host sync; unchecked, the reference makes an overflowing item NaN, as the kernel does.
        if every_item(reference.pooling_slots(position_ids, k) >= output_length).any():
            raise reference.slot_overflow_error(k, output_length)
    return reference.pool_by_positions(hidden_states, position_ids, padding_positions, output_length, round_average)


def _forward(hidden_states, position_ids, padding_positions, output_length, round_average, backend):
    pooled, mask = dispatch(
        "pool_by_positions",
        backend,
        hidden_states.device,
        _triton,
        _reference,
        hidden_states,
        position_ids,
        padding_positions,
        output_length,
        round_average,
    )
    # Contiguous on every path, as the op's fake: when N == L both follow the inputs' strides.
    return pooled.contiguous(), mask.contiguous()


@torch.library.custom_op("fused_vision::pool_by_positions", mutates_args=())
def _pool_by_positions_op(
    hidden_states: torch.Tensor,
    position_ids: torch.Tensor,
    padding_positions: torch.Tensor,
    output_length: int,
    round_average: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    pooled, mask = _forward(hidden_states, position_ids, padding_positions, output_length, round_average, backend)
    # A custom op may not return one of its inputs, which is stock's mask when N == L.
    return pooled, mask.clone(memory_format=torch.contiguous_format) if mask is padding_positions else mask


@_pool_by_positions_op.register_fake
def _(hidden_states, position_ids, padding_positions, output_length, round_average, backend):
    batch, _, hidden = hidden_states.shape
    pooled = hidden_states.new_empty((batch, output_length, hidden), dtype=torch.float32)
    return pooled, padding_positions.new_empty((batch, output_length))


def _triton_backward(grad_pooled, position_ids, padding_positions, output_length, hidden_dtype, round_average):
    from ..kernels.pool_by_positions import pool_by_positions_backward as launch

    seq_len = position_ids.shape[1]
    if seq_len == output_length:  # no pooling: a scale and a mask, nothing for a kernel to fuse
        return reference.pool_by_positions_backward(
            grad_pooled, position_ids, padding_positions, output_length, hidden_dtype
        )
    k = reference.pooling_kernel_size(seq_len, output_length)
    return launch(grad_pooled, position_ids, padding_positions, k, hidden_dtype, round_average=round_average)


@torch.library.custom_op("fused_vision::pool_by_positions_backward", mutates_args=())
def pool_by_positions_backward(
    grad_pooled: torch.Tensor,
    position_ids: torch.Tensor,
    padding_positions: torch.Tensor,
    output_length: int,
    hidden_dtype: torch.dtype,
    round_average: bool,
    backend: str,
) -> torch.Tensor:
    """The (B, N, D) gradient of ``pool_by_positions``'s hidden states from its pooled output's, in
    ``hidden_dtype``: bit-identical to autograd through the stock pooler."""
    return dispatch(
        "pool_by_positions_backward",
        backend,
        grad_pooled.device,
        _triton_backward,
        reference.pool_by_positions_backward,
        grad_pooled,
        position_ids,
        padding_positions,
        output_length,
        hidden_dtype,
        round_average,
    )


@pool_by_positions_backward.register_fake
def _(grad_pooled, position_ids, padding_positions, output_length, hidden_dtype, round_average, backend):
    return grad_pooled.new_empty((*position_ids.shape[:2], grad_pooled.shape[2]), dtype=hidden_dtype)


def _backward_setup_context(ctx, inputs, output):
    grad_pooled, position_ids, padding_positions, output_length, hidden_dtype, round_average, backend = inputs
    ctx.save_for_backward(position_ids, padding_positions)
    ctx.output_length, ctx.grad_dtype = output_length, grad_pooled.dtype
    ctx.round_average, ctx.backend = round_average, backend


def _backward_backward(ctx, grad_of_grad_hidden):
    """Double backward: the hidden-state gradient is linear in the pooled one, and its transpose is the
    pooler itself (the same k x k sums and sqrt(D) / k^2 scale, through the pooler's one rounding)."""
    position_ids, padding_positions = ctx.saved_tensors
    pooled, _ = pool_by_positions(
        grad_of_grad_hidden,
        position_ids,
        padding_positions,
        ctx.output_length,
        round_average=ctx.round_average,
        backend=ctx.backend,
    )
    return pooled.to(ctx.grad_dtype), None, None, None, None, None, None


pool_by_positions_backward.register_autograd(_backward_backward, setup_context=_backward_setup_context)


def _setup_context(ctx, inputs, output):
    hidden_states, position_ids, padding_positions, output_length, round_average, backend = inputs
    ctx.save_for_backward(position_ids, padding_positions)
    ctx.output_length, ctx.hidden_dtype = output_length, hidden_states.dtype
    ctx.round_average, ctx.backend = round_average, backend


def _backward(ctx, grad_pooled, grad_mask):
    position_ids, padding_positions = ctx.saved_tensors
    grad = pool_by_positions_backward(
        grad_pooled,
        position_ids,
        padding_positions,
        ctx.output_length,
        ctx.hidden_dtype,
        ctx.round_average,
        ctx.backend,
    )
    return grad, None, None, None, None, None


_pool_by_positions_op.register_autograd(_backward, setup_context=_setup_context)


def pool_by_positions(
    hidden_states: torch.Tensor,
    position_ids: torch.Tensor,
    padding_positions: torch.Tensor,
    output_length: int,
    *,
    round_average: bool = True,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``Gemma4VisionPooler.forward``: zero the padding rows, average k x k blocks of positions, scale.

    Args:
        hidden_states: (B, N, D) float32, float16 or bfloat16, the encoder output.
        position_ids: (B, N, 2) int32 or int64 (x, y), -1 for padding. padding_positions: (B, N) bool.
        output_length: L, the soft tokens per item; N must equal k * k * L for an integer k.
        round_average: round each fp32 average to the hidden dtype before the fp32 sqrt(D) scale, as
            transformers' pooler does; False scales the fp32 average itself, as SGLang's
            ``EmbeddingGemma2VisionPooler`` does (the same for float32 hidden states).

    Returns:
        ``(pooled, mask)``: (B, L, D) float32 averages (rounded through the hidden dtype) scaled by
        sqrt(D) in fp32 (transformers 5.10+; cast to the hidden dtype for 5.5-5.9's semantics), and the
        (B, L) bool mask of slots that received a patch. When N == L the mask is ``padding_positions``
        (a copy of it when autograd or torch.compile is involved), as stock returns it.
        Differentiable in ``hidden_states``.
    """
    _check_inputs(hidden_states, position_ids, padding_positions, output_length, round_average)
    # Stock's errors for lengths that do not divide; traced sizes may be symbolic, and the op checks them at run time.
    if not torch.compiler.is_compiling():
        reference.pooling_kernel_size(hidden_states.shape[1], output_length)
    args = (hidden_states, position_ids, padding_positions, output_length, round_average)
    return route(
        "pool_by_positions", backend, args, reference=_reference, registered=_pool_by_positions_op, direct=_forward
    )
