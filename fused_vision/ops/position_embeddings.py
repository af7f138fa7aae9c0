"""The public 2-D position-embedding lookup: validation, dispatch, autograd and torch.library registration."""

import torch

from .. import reference
from .._dispatch import dispatch, route
from .._validation import (
    check_ids_and_padding,
    check_position_ids_range,
    check_same_device,
    check_shape,
    check_table,
    check_tensor,
)


def _check_inputs(
    table: torch.Tensor,
    position_ids: torch.Tensor,
    padding_positions: torch.Tensor | None,
    residual: torch.Tensor | None,
) -> None:
    check_table(table)
    batch, seq_len = check_ids_and_padding(position_ids, padding_positions)
    if residual is not None:
        check_tensor("residual", residual, 3, (table.dtype,))
        check_shape("residual", residual, (batch, seq_len, table.shape[2]), "(B, N, D)")
    check_same_device(table=table, position_ids=position_ids, padding_positions=padding_positions, residual=residual)


def _triton(table, position_ids, padding_positions, residual):
    from ..kernels.position_embeddings import position_embeddings as launch

    out = launch(table, position_ids, padding_positions, residual)
    # Checked after the launch, which bad ids cannot lead astray: the device runs the kernel meanwhile.
    check_position_ids_range(position_ids, table.shape[1], guarded=True)
    return out


def _reference(table, position_ids, padding_positions, residual):
    check_position_ids_range(position_ids, table.shape[1])  # before: the reference indexes with the ids
    # Contiguous, as the kernel's output and the op's fake, whatever the residual's strides.
    return reference.position_embeddings(table, position_ids, padding_positions, residual=residual).contiguous()


def _forward(table, position_ids, padding_positions, residual, backend):
    return dispatch(
        "position_embeddings",
        backend,
        table.device,
        _triton,
        _reference,
        table,
        position_ids,
        padding_positions,
        residual,
    )


@torch.library.custom_op("fused_vision::position_embeddings", mutates_args=())
def _position_embeddings_op(
    table: torch.Tensor,
    position_ids: torch.Tensor,
    padding_positions: torch.Tensor,
    residual: torch.Tensor | None,
    backend: str,
) -> torch.Tensor:
    return _forward(table, position_ids, padding_positions, residual, backend)


@_position_embeddings_op.register_fake
def _(table, position_ids, padding_positions, residual, backend):
    return table.new_empty((*position_ids.shape[:2], table.shape[2]))


def _triton_backward(grad, position_ids, padding_positions, num_positions):
    from ..kernels.position_embeddings import position_embeddings_backward as launch

    return launch(grad, position_ids, padding_positions, num_positions)


@torch.library.custom_op("fused_vision::position_embeddings_backward", mutates_args=())
def position_embeddings_backward(
    grad: torch.Tensor,
    position_ids: torch.Tensor,
    padding_positions: torch.Tensor,
    num_positions: int,
    dtype: torch.dtype,
    backend: str,
) -> torch.Tensor:
    """Gradient of the lookup's (2, P, D) table, accumulated in fp32 and returned in ``dtype``.

    The Triton path adds with fp32 atomics (run-to-run order may differ); with
    ``torch.use_deterministic_algorithms(True)`` the deterministic scatter of the reference is used.
    """
    args = (grad, position_ids, padding_positions, num_positions)
    if torch.are_deterministic_algorithms_enabled():
        return reference.position_embeddings_backward(*args).to(dtype)
    return dispatch(
        "position_embeddings_backward",
        backend,
        grad.device,
        _triton_backward,
        reference.position_embeddings_backward,
        *args,
    ).to(dtype)


@position_embeddings_backward.register_fake
def _(grad, position_ids, padding_positions, num_positions, dtype, backend):
    return grad.new_empty((2, num_positions, grad.shape[2]), dtype=dtype)


def _backward_setup_context(ctx, inputs, output):
    grad, position_ids, padding_positions, num_positions, dtype, backend = inputs
    ctx.save_for_backward(position_ids, padding_positions)
    ctx.grad_dtype, ctx.backend = grad.dtype, backend


def _backward_backward(ctx, grad_of_grad_table):
    """Double backward: the table gradient is linear in the output gradient, and its transpose is the
    lookup itself (the two rows of each non-padding patch, summed and rounded once)."""
    position_ids, padding_positions = ctx.saved_tensors
    rows = grad_of_grad_table.to(ctx.grad_dtype)
    return position_embeddings(rows, position_ids, padding_positions, backend=ctx.backend), None, None, None, None, None


position_embeddings_backward.register_autograd(_backward_backward, setup_context=_backward_setup_context)


def _setup_context(ctx, inputs, output):
    table, position_ids, padding_positions, residual, backend = inputs
    ctx.save_for_backward(position_ids, padding_positions)
    ctx.num_positions, ctx.table_dtype, ctx.backend = table.shape[1], table.dtype, backend


def _backward(ctx, grad):
    position_ids, padding_positions = ctx.saved_tensors
    grad_table = grad_residual = None
    if ctx.needs_input_grad[0]:
        grad_table = position_embeddings_backward(
            grad, position_ids, padding_positions, ctx.num_positions, ctx.table_dtype, ctx.backend
        )
    if ctx.needs_input_grad[3]:
        grad_residual = grad
    return grad_table, None, None, grad_residual, None


_position_embeddings_op.register_autograd(_backward, setup_context=_setup_context)


def position_embeddings(
    table: torch.Tensor,
    position_ids: torch.Tensor,
    padding_positions: torch.Tensor | None = None,
    *,
    residual: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Gemma 4's 2-D position embeddings for every patch, without the one-hot.

    Args:
        table: (2, P, D) float32, float16 or bfloat16; ``table[0]`` holds x rows, ``table[1]`` y rows.
        position_ids: (B, N, 2) int32 or int64 (x, y) below P; negative ids read row 0
            (stock's clamp) and (-1, -1) marks padding.
        padding_positions: (B, N) bool; defaults to ``(position_ids == -1).all(-1)``.
        residual: optional (B, N, D) in the table's dtype; the result is then ``residual + pe``,
            rounded as the stock ``hidden_states + position_embeddings``, without a (B, N, D) temporary.
        backend: "auto", "triton" or "reference" (see ``fused_vision._dispatch``).

    Returns:
        A new (B, N, D) tensor in the table's dtype, bit-identical to the one-hot formulation.
        Padding rows hold 0 (or the residual row). Differentiable in ``table`` and ``residual``.
    """
    _check_inputs(table, position_ids, padding_positions, residual)
    if padding_positions is None:
        padding_positions = reference.default_padding_positions(position_ids)
    args = (table, position_ids, padding_positions, residual)
    return route(
        "position_embeddings", backend, args, reference=_reference, registered=_position_embeddings_op, direct=_forward
    )
