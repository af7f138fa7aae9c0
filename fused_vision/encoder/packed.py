"""The packed Gemma 4 vision encoder: every item's real patches in one sequence, attention within each item.

Each item's padding rows are dropped before the patch embedder; the real patches run as one (1, T, D)
sequence through the tower's own embedder and layers, attention within each item
(``fused_vision.encoder.attention``); the pooler runs on the rows scattered back to their padded places.
Each item's soft tokens are stock's up to the attention kernel's summation order. Used by
``encode_images(..., packed=True)`` and ``apply_fused_vision_to_gemma4(model, encoder="packed")``.
Details: docs/encoders.md.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .. import reference
from . import attention, fused_layer
from .attention import SUPPORTED_ATTENTION, Packing, attention_supported

__all__ = [
    "ItemCounts",
    "attention_supported",
    "check_attention",
    "count_items",
    "encode",
    "encoded_rows",
    "pack_items",
    "padded_batch",
    "pooled_items",
    "run_packed",
    "scatter_rows",
    "soft_tokens",
    "true_rows",
]


def check_attention(config, argument: str = "encoder") -> None:
    if not attention_supported(config):
        raise ValueError(
            f"{argument}: the packed encoder replaces {SUPPORTED_ATTENTION} attention only; this tower is "
            f"configured with {config._attn_implementation!r} (use encoder='stock')"
        )


def soft_tokens(tower, hidden_states, position_ids, padding, output_length, dtype, pooler_float32, counts=None):
    """The release's tail of ``Gemma4VisionModel.forward``: the tower's pooler, its filled slots, the
    standardization; returns the (sum T_i, D) soft tokens and each item's count. ``counts``: the items'
    filled slots where the caller has them (``count_items``), else read off the device (one sync)."""
    pooled, mask = tower.pooler(
        hidden_states=hidden_states,
        pixel_position_ids=position_ids,
        padding_positions=padding,
        output_length=output_length,
    )
    counts = mask.sum(dim=1).tolist() if counts is None else list(counts)
    tokens = pooled.flatten(0, 1).index_select(0, true_rows(mask.flatten(), sum(counts)))  # pooled[mask]
    if pooler_float32:  # 5.10+: standardize in float32, then back to the working dtype
        if tower.config.standardize:
            tokens = (tokens - tower.std_bias.float()) * tower.std_scale.float()
        tokens = tokens.to(dtype)
    elif tower.config.standardize:  # 5.5-5.9: in the pooled dtype
        tokens = (tokens - tower.std_bias) * tower.std_scale
    return tokens, counts


@dataclass(frozen=True)
class ItemCounts:
    """What packing needs to know of each item, in item order: its real patches (ids other than (-1, -1)),
    the pooler slots it fills (stock's pooler mask), and whether a real id lies outside the position table."""

    real: tuple[int, ...]
    pooled: tuple[int, ...]
    outside_table: tuple[bool, ...]

    def part(self, start: int, end: int) -> ItemCounts:
        """The counts of items ``start`` to ``end``."""
        return ItemCounts(*(values[start:end] for values in dataclasses.astuple(self)))


def count_items(position_ids: Sequence[torch.Tensor], kernel: int, table_rows: int) -> ItemCounts:
    """``ItemCounts`` of items of (N_i, 2) ids pooled ``kernel`` x ``kernel``: one pass per patch count on
    the device, one device-to-host sync for all items. An N_i that is not a multiple of ``kernel**2``
    counts -1 pooled slots (stock's pooler raises on it)."""
    groups: dict[tuple[torch.device, int], list[int]] = {}
    for index, ids in enumerate(position_ids):
        groups.setdefault((ids.device, ids.shape[0]), []).append(index)
    columns: dict[torch.device, list[torch.Tensor]] = {}
    order: dict[torch.device, list[int]] = {}
    for (device, patches), members in groups.items():
        ids = torch.stack([position_ids[m] for m in members])
        real = ~(ids == -1).all(dim=-1)
        outside = (real & ((ids < 0) | (ids >= table_rows)).any(dim=-1)).any(dim=-1)
        slots_per_item, remainder = divmod(patches, kernel * kernel)
        if remainder or slots_per_item == 0:
            pooled = torch.full_like(outside, -1, dtype=torch.int64)
        elif kernel == 1:  # no pooling: stock's mask is then the padding's
            pooled = (~real).sum(dim=1)
        else:  # as the reference pooler: a slot past the output counts at slot 0, the item is NaN there
            slots = reference.pooling_slots(ids, kernel)
            slots = slots.masked_fill(slots >= slots_per_item, 0)
            filled = torch.zeros(len(members), slots_per_item, dtype=torch.bool, device=device)
            pooled = filled.scatter_(1, slots, True).sum(dim=1)
        column = torch.stack([real.sum(dim=1), pooled, outside.long()], dim=1)
        columns.setdefault(device, []).append(column)
        order.setdefault(device, []).extend(members)
    rows: list = [None] * len(position_ids)
    for device, parts in columns.items():  # the one sync (per device the items are on)
        for member, row in zip(order[device], torch.cat(parts).tolist()):
            rows[member] = row
    real, pooled, outside = zip(*rows) if rows else ((),) * 3
    return ItemCounts(real, pooled, tuple(map(bool, outside)))


def true_rows(mask: torch.Tensor, count: int) -> torch.Tensor:
    """The indices of a (R,) mask's ``count`` True rows, in order; unlike boolean indexing, no sync."""
    return torch.nonzero_static(mask, size=count).squeeze(1)


def pack_items(
    pixel_values: Sequence[torch.Tensor], position_ids: Sequence[torch.Tensor], lengths: Sequence[int] | None = None
):
    """Each item's real patches (ids not (-1, -1)), concatenated: its (N_i,) real-row masks, their counts,
    and the (1, T, K) pixels and (1, T, 2) ids of the packed sequence, in item order. ``lengths``: the
    counts, where the caller has them; otherwise they are read off the device (one sync for all items)."""
    real = [~(ids == -1).all(dim=-1) for ids in position_ids]
    rows = torch.cat(real)
    if lengths is None:
        running = torch.cat([rows.new_zeros(1, dtype=torch.int64), rows.cumsum(0)])
        ends = torch.stack([running[end] for end in itertools.accumulate((mask.shape[0] for mask in real), initial=0)])
        lengths = ends.diff().tolist()
    kept = true_rows(rows, sum(lengths))
    pixels = torch.cat(list(pixel_values)).index_select(0, kept)[None]
    ids = torch.cat(list(position_ids)).index_select(0, kept)[None]
    return real, list(lengths), pixels, ids


def scatter_rows(rows: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(sum of mask, D) rows put back at the True slots of a (B, N) mask, zeros elsewhere: (B, N, D)."""
    return rows.new_zeros(*mask.shape, rows.shape[-1]).masked_scatter(mask[..., None], rows)


def run_packed(encoder: nn.Module, rows, ids, packing: Packing, backend: str | None) -> torch.Tensor:
    """The encoder's layers on (T, D) packed ``rows`` with (T, 2) ``ids``, each layer handed the items'
    ``packing`` as its attention mask (so its attention stays within each item, in every replay of the
    call); fused (``fused_vision.encoder.fused_layer``) with a ``backend``, else stock's."""
    attention.install()
    stock_kwargs = lambda: dict(attention_mask=packing)  # the fallback layers' attention mask
    return fused_layer.run_layers(encoder, rows, ids, packing.attend, (1, rows.shape[0]), stock_kwargs, backend)


def encode(
    tower: nn.Module,
    pixel_values: Sequence[torch.Tensor],
    position_ids: Sequence[torch.Tensor],
    pooler_float32: bool,
    counts: ItemCounts | None = None,
    backend: str | None = None,
) -> list[torch.Tensor]:
    """Soft tokens of each item, (N_i, K) pixels and (N_i, 2) ids on the tower's device, in one packed
    forward: a list of (T_i, D) tensors as the release's ``Gemma4VisionModel.forward`` returns them.
    ``backend``: the fused layers' (``fused_vision.encoder.fused_layer``); None runs the tower's own.
    ``counts``: the items' ``count_items``, where the caller has them; without them the call counts
    them itself, its one device-to-host sync. Given them, it syncs nowhere."""
    if counts is None:
        counts = count_items(position_ids, tower.config.pooling_kernel_size, tower.config.position_embedding_size)
    real, lengths, pixels, ids = pack_items(pixel_values, position_ids, counts.real)
    rows = encoded_rows(tower, pixels[0], ids[0], Packing.of(lengths, ids.device), backend)
    return pooled_items(tower, rows, real, position_ids, counts, pooler_float32)


def encoded_rows(tower: nn.Module, pixels, ids, packing: Packing, backend: str | None) -> torch.Tensor:
    """The tower's embedder and layers on (T, K) packed pixels with (T, 2) ids, items as ``packing`` has
    them, the layers fused with a ``backend``: the (T, D) rows, in the working dtype."""
    no_padding = torch.zeros(1, ids.shape[0], dtype=torch.bool, device=ids.device)
    inputs_embeds = tower.patch_embedder(pixels[None], ids[None], no_padding)
    return run_packed(tower.encoder, inputs_embeds[0], ids, packing, backend)


def pooled_items(tower, rows, real, position_ids, counts: ItemCounts, pooler_float32) -> list[torch.Tensor]:
    """Each item's soft tokens from the (T, D) encoded ``rows`` of its ``real`` (N_i,) rows, in item order:
    items of one N share a pooler call, on their rows scattered back to their padded places, as in stock's
    batch; split by ``counts.pooled``, no sync."""
    segments = torch.split(rows, list(counts.real))
    groups: dict[int, list[int]] = {}
    for index, item_ids in enumerate(position_ids):
        groups.setdefault(item_ids.shape[0], []).append(index)
    kernel = tower.config.pooling_kernel_size
    outputs: list[torch.Tensor | None] = [None] * len(position_ids)
    for patches, members in groups.items():
        mask = torch.stack([real[m] for m in members])
        rows = torch.cat([segments[m] for m in members])
        padded = scatter_rows(rows, mask)
        group_ids = torch.stack([position_ids[m] for m in members])
        pooled = [counts.pooled[m] for m in members]
        output_length = patches // (kernel * kernel)
        tokens, pooled = soft_tokens(tower, padded, group_ids, ~mask, output_length, rows.dtype, pooler_float32, pooled)
        for member, item_tokens in zip(members, torch.split(tokens, pooled)):
            outputs[member] = item_tokens
    return outputs


def padded_batch(pixel_values, pixel_position_ids) -> bool:
    """Whether the inputs are a padded batch as a tower's forward takes it: (B, N, K) pixels and (B, N, 2)
    integer ids."""
    if not isinstance(pixel_values, torch.Tensor) or not isinstance(pixel_position_ids, torch.Tensor):
        return False
    if pixel_values.dim() != 3 or pixel_position_ids.dim() != 3 or pixel_position_ids.shape[-1] != 2:
        return False
    return pixel_values.shape[:2] == pixel_position_ids.shape[:2] and not pixel_position_ids.is_floating_point()
