"""The public Gemma 4 patch embedder: prescale, projection, lookup, padding mask and add in one kernel."""

import torch

from . import reference
from ._dispatch import dispatch
from ._validation import check_patch_embed_inputs


def _triton(pixel_values, weight, table, position_ids, padding_positions):
    from .kernels.patch_embed import patch_embed as launch

    return launch(pixel_values, weight, table, position_ids, padding_positions)


def patch_embed(
    pixel_values: torch.Tensor,
    weight: torch.Tensor,
    table: torch.Tensor,
    position_ids: torch.Tensor,
    padding_positions: torch.Tensor | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """``Gemma4VisionPatchEmbedder.forward``: ``input_proj((2 * (pixels - 0.5)).to(W.dtype)) + pe``.

    Args:
        pixel_values: (B, N, K) float32, float16 or bfloat16, K = 3 * patch_size**2, features (py, px, c).
        weight: (D, K), the ``input_proj`` weight (no bias); its dtype is the output dtype.
        table: (2, P, D) in the weight's dtype. position_ids, padding_positions: as in
            ``fused_vision.position_embeddings``.

    Returns:
        (B, N, D) in the weight's dtype. Padding rows hold what stock writes there: the projection of
        their (prescaled) pixels, with no position embedding added.
    """
    check_patch_embed_inputs(pixel_values, weight, table, position_ids, padding_positions)
    if padding_positions is None:
        padding_positions = reference.default_padding_positions(position_ids)
    return dispatch(
        "patch_embed",
        backend,
        weight.device,
        _triton,
        reference.patch_embed,
        pixel_values,
        weight,
        table,
        position_ids,
        padding_positions,
    )
