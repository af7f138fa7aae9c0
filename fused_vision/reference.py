"""Plain PyTorch versions of every op: the semantic definition, the benchmark baselines, and the
fallback on devices Triton does not drive.

These functions do not validate their inputs; ``fused_vision``'s public ops do, then call them.
"""

import torch
import torch.nn.functional as F


def onehot_position_embeddings(
    table: torch.Tensor, position_ids: torch.Tensor, padding_positions: torch.Tensor
) -> torch.Tensor:
    """The lookup exactly as transformers 5.5-5.9 shipped it in ``Gemma4VisionPatchEmbedder``.

    Materialises an int64 one-hot of (B, N, 2, P) -- 160 KiB per patch at P = 10240 -- and multiplies
    it with the (2, P, D) table. Kept as the definition the fast paths are tested against and as the
    benchmark baseline; never use it for real work. ``position_ids`` must be int64 (``F.one_hot``).
    """
    clamped = position_ids.clamp(min=0)
    one_hot = F.one_hot(clamped, num_classes=table.shape[1])
    one_hot = one_hot.permute(0, 2, 1, 3).to(table)
    position_embeddings = (one_hot @ table).sum(dim=1)
    return torch.where(padding_positions.unsqueeze(-1), 0.0, position_embeddings)


def default_padding_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """Gemma 4's rule: a patch is padding only when both coordinates are -1."""
    return (position_ids == -1).all(dim=-1)


def position_embeddings(
    table: torch.Tensor,
    position_ids: torch.Tensor,
    padding_positions: torch.Tensor | None = None,
    *,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """The lookup as two gathers (the transformers 5.10+ formulation); bit-identical to the one-hot.

    ``table[0][x] + table[1][y]`` rounds once, as the one-hot's ``sum(dim=1)`` does, and
    ``residual + pe`` rounds once more, as the stock ``hidden_states + position_embeddings``.
    """
    if padding_positions is None:
        padding_positions = default_padding_positions(position_ids)
    clamped = position_ids.clamp(min=0)
    pe = F.embedding(clamped[..., 0], table[0]) + F.embedding(clamped[..., 1], table[1])
    pe = pe.masked_fill(padding_positions.unsqueeze(-1), 0.0)
    return pe if residual is None else residual + pe
