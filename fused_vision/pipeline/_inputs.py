"""The inputs of ``encode_images`` and ``GraphedEncoder``, checked by one code for both: the tower found in a
model, the items split, paired and checked against the tower, and the counts the packed encoder needs."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import torch
from torch import nn

from ..encoder import packed

_TOWER_SUBMODULES = ("patch_embedder", "encoder", "pooler")
# Where the tower sits in the models that build one (Gemma4ForConditionalGeneration, Gemma4Model,
# EmbeddingGemma2Model, DiffusionGemma's models): looked up before walking every module of the LLM.
_TOWER_PATHS = ("vision_tower", "model.vision_tower", "encoder.vision_tower", "model.encoder.vision_tower")


def _is_tower(module) -> bool:
    return (
        isinstance(module, nn.Module)
        and all(name in module._modules for name in _TOWER_SUBMODULES)
        and hasattr(module, "config")
    )


def resolve_tower(model: nn.Module, name: str = "vision_tower") -> nn.Module:
    """The Gemma4VisionModel itself, or the first one inside ``model``; else a TypeError naming ``name``."""
    if _is_tower(model):
        return model
    for path in _TOWER_PATHS:
        candidate = functools.reduce(lambda module, attr: getattr(module, attr, None), path.split("."), model)
        if _is_tower(candidate):
            return candidate
    if isinstance(model, nn.Module):
        tower = next((module for module in model.modules() if _is_tower(module)), None)
        if tower is not None:
            return tower
    raise TypeError(
        f"{name}: expected a Gemma4VisionModel (with patch_embedder, encoder, pooler and config) "
        f"or a model containing one, got {type(model).__name__}"
    )


@dataclasses.dataclass(frozen=True)
class Items:
    """The inputs, checked once: per-item (N_i, K) pixels and (N_i, 2) ids, and the (B, N, K) and (B, N, 2)
    tensors they are rows of where the caller gave those."""

    pixels: list[torch.Tensor]
    ids: list[torch.Tensor]
    stacked: tuple[torch.Tensor, torch.Tensor] | None

    def chunk(self, selected: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Items ``selected`` (N alike) as (n, N, K) pixels and (n, N, 2) ids on ``device``: a slice of the
        stacked input, whose one bucket holds every item in order, else a stack."""
        if self.stacked is not None:
            pixels, ids = (t[selected[0] : selected[-1] + 1] for t in self.stacked)
        else:
            pixels, ids = torch.stack([self.pixels[i] for i in selected]), torch.stack([self.ids[i] for i in selected])
        return pixels.to(device), ids.to(device)


def split_items(tower: nn.Module, pixel_values, pixel_position_ids) -> Items:
    """``pixel_values`` and ``pixel_position_ids`` checked against ``tower`` and split per item: two (B, N, K)
    and (B, N, 2) tensors, or two lists of (N_i, K) / (1, N_i, K) and (N_i, 2) / (1, N_i, 2) tensors."""
    stacked = isinstance(pixel_values, torch.Tensor)
    if stacked:
        if not isinstance(pixel_position_ids, torch.Tensor):
            raise TypeError("pixel_position_ids: expected a tensor like pixel_values")
        if pixel_values.dim() != 3 or pixel_position_ids.dim() != 3:
            raise ValueError(
                f"pixel_values (B, N, K) and pixel_position_ids (B, N, 2) expected, got shapes "
                f"{tuple(pixel_values.shape)} and {tuple(pixel_position_ids.shape)}"
            )
    elif not isinstance(pixel_values, Sequence) or not isinstance(pixel_position_ids, Sequence):
        raise TypeError("pixel_values, pixel_position_ids: expected two tensors or two lists of per-item tensors")
    if len(pixel_position_ids) != len(pixel_values):  # zip would drop the extra items silently
        raise ValueError(
            f"pixel_position_ids: expected {len(pixel_values)} items like pixel_values, got {len(pixel_position_ids)}"
        )
    features = 3 * tower.config.patch_size**2  # the patch embedder's input: RGB patches, flattened
    pixels, ids = [], []
    for i, (p, q) in enumerate(zip(pixel_values, pixel_position_ids)):
        if not isinstance(p, torch.Tensor) or not isinstance(q, torch.Tensor):
            raise TypeError(
                f"pixel_values, pixel_position_ids: item {i} is {type(p).__name__} and {type(q).__name__}, "
                "expected tensors"
            )
        p, q = (t[0] if t.dim() == 3 and t.shape[0] == 1 else t for t in (p, q))  # a listed item's batch of one
        if p.dim() != 2 or q.dim() != 2 or q.shape[-1] != 2 or p.shape[0] != q.shape[0] or p.shape[0] == 0:
            raise ValueError(
                f"item {i}: expected pixels (N, K) and position ids (N, 2) with the same N >= 1, got "
                f"{tuple(p.shape)} and {tuple(q.shape)}"
            )
        if q.dtype not in (torch.int32, torch.int64):  # the fused ops' (5.5-5.9's one-hot takes only int64)
            raise TypeError(f"pixel_position_ids: item {i}: expected dtype int32 or int64, got {q.dtype}")
        if not p.is_floating_point():
            raise TypeError(f"pixel_values: item {i}: expected a floating-point dtype, got {p.dtype}")
        if p.shape[1] != features:
            raise ValueError(
                f"pixel_values: item {i}: expected {features} features (3 x patch_size**2, patch_size "
                f"{tower.config.patch_size}), got {p.shape[1]}"
            )
        pixels.append(p)
        ids.append(q)
    return Items(pixels, ids, (pixel_values, pixel_position_ids) if stacked else None)


def item_counts(tower: nn.Module, items: Items, counts: packed.ItemCounts | None = None) -> packed.ItemCounts:
    """Every item's ``packed.count_items`` (one sync for all; ``counts``: the caller's, not recounted), checked
    as the packed encoder needs them."""
    kernel = tower.config.pooling_kernel_size
    table_rows = tower.config.position_embedding_size
    for index, item_pixels in enumerate(items.pixels):
        if item_pixels.shape[0] % kernel**2:
            raise ValueError(
                f"pixel_values: item {index}: {item_pixels.shape[0]} patches, not a multiple of the pooling "
                f"kernel's {kernel**2}"
            )
    if counts is None:
        counts = packed.count_items(items.ids, kernel, table_rows)
    elif not isinstance(counts, packed.ItemCounts):
        raise TypeError(f"counts: expected the items' ItemCounts (packed.count_items), got {type(counts).__name__}")
    elif not len(counts.real) == len(counts.pooled) == len(counts.outside_table) == len(items.ids):
        raise ValueError(f"counts: expected the counts of {len(items.ids)} items, got {len(counts.real)}")
    for index, (real, outside) in enumerate(zip(counts.real, counts.outside_table)):
        if real > items.ids[index].shape[0]:
            raise ValueError(
                f"counts: item {index}: {real} real patches, more than its {items.ids[index].shape[0]} rows"
            )
        if real == 0:
            raise ValueError(f"pixel_position_ids: item {index}: no real patch (every id is (-1, -1))")
        if outside:
            raise ValueError(
                f"pixel_position_ids: item {index}: real patch ids outside the position table's [0, {table_rows})"
            )
    return counts
