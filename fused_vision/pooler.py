"""The public Gemma 4 pooler: k x k averages by patch position without the (B, N, L) one-hot."""

import torch

from . import reference
from ._dispatch import dispatch
from ._validation import check_pool_inputs


def _triton(hidden_states, position_ids, padding_positions, output_length):
    from .kernels.pooler import pool_by_positions as launch

    seq_len = hidden_states.shape[1]
    if seq_len == output_length:  # no pooling: stock's masked scale, nothing for a kernel to fuse
        return reference.pool_by_positions(hidden_states, position_ids, padding_positions, output_length)
    k = reference.pooling_kernel_size(seq_len, output_length)
    pooled, mask, overflow = launch(hidden_states, position_ids, padding_positions, output_length, k)
    if overflow.any():  # one device-to-host sync, as the reference's own check
        raise reference.slot_overflow_error(k, output_length)
    return pooled, mask


def pool_by_positions(
    hidden_states: torch.Tensor,
    position_ids: torch.Tensor,
    padding_positions: torch.Tensor,
    output_length: int,
    *,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``Gemma4VisionPooler.forward``: zero the padding rows, average k x k blocks of positions, scale.

    Args:
        hidden_states: (B, N, D) float32, float16 or bfloat16, the encoder output.
        position_ids: (B, N, 2) int32 or int64 (x, y), -1 for padding. padding_positions: (B, N) bool.
        output_length: L, the soft tokens per item; N must equal k * k * L for an integer k.

    Returns:
        ``(pooled, mask)``: (B, L, D) float32 averages rounded through the hidden dtype and scaled by
        sqrt(D) in fp32 (transformers 5.10+; cast to the hidden dtype for 5.5-5.9's semantics), and the
        (B, L) bool mask of slots that received a patch. When N == L the mask is ``padding_positions``
        itself, as stock returns it.
    """
    check_pool_inputs(hidden_states, position_ids, padding_positions, output_length)
    seq_len = hidden_states.shape[1]
    reference.pooling_kernel_size(seq_len, output_length)  # stock's errors for lengths that do not divide
    return dispatch(
        "pool_by_positions",
        backend,
        hidden_states.device,
        _triton,
        reference.pool_by_positions,
        hidden_states,
        position_ids,
        padding_positions,
        output_length,
    )
