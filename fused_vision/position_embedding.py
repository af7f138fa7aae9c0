"""The public 2-D position-embedding lookup: validation, then the Triton kernel or the reference."""

import torch

from . import reference
from ._dispatch import dispatch
from ._validation import check_position_inputs


def _triton(table, position_ids, padding_positions, residual):
    from .kernels.position_embedding import position_embeddings as launch

    return launch(table, position_ids, padding_positions, residual)


def _reference(table, position_ids, padding_positions, residual):
    return reference.position_embeddings(table, position_ids, padding_positions, residual=residual)


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
        position_ids: (B, N, 2) int32 or int64 (x, y) in [-1, P); -1 marks padding.
        padding_positions: (B, N) bool; defaults to ``(position_ids == -1).all(-1)``.
        residual: optional (B, N, D) in the table's dtype; the result is then ``residual + pe``,
            rounded as the stock ``hidden_states + position_embeddings``, without a (B, N, D) temporary.
        backend: "auto", "triton" or "reference" (see ``fused_vision._dispatch``).

    Returns:
        A new (B, N, D) tensor in the table's dtype, bit-identical to the one-hot formulation.
        Padding rows hold 0 (or the residual row).
    """
    check_position_inputs(table, position_ids, padding_positions, residual)
    if padding_positions is None:
        padding_positions = reference.default_padding_positions(position_ids)
    return dispatch(
        "position_embeddings", backend, table.device, _triton, _reference, table, position_ids, padding_positions, residual
    )
