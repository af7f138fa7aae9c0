"""``encode_images``: many images or video frames through a Gemma 4 vision tower in memory-safe chunks.

    import fused_vision

    soft_tokens = fused_vision.encode_images(model, pixel_values, pixel_position_ids, max_batch=16)

vLLM's batched pattern: items are bucketed by patch count, each bucket runs in chunks that
``fused_vision.pipeline.planner`` sizes, and each item's soft tokens come back stripped of padding and
standardized as the release's ``Gemma4VisionModel.forward`` does. A patched and a stock tower both work.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from .._dispatch import warn_once
from .._validation import positive_int
from ..encoder import packed
from ..encoder.attention import configured_attention
from ..integrations import transformers
from ..integrations.encoder import fused_backend
from ..integrations.stem import embedder_runs_stock
from . import planner
from ._chunks import HalvingChunks
from ._inputs import Items, item_counts, resolve_tower, split_items

__all__ = ["encode_images"]


def planner_path(tower: nn.Module, items: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> str:
    """The planner's path for ``tower`` on ``items``, (pixels, position ids) pairs: "onehot" where a 5.5-5.9
    embedder runs its stock one-hot lookup on any of them (unpatched, or given a dtype the fused ops do
    not take: one float64 item makes a stacked chunk float64), "fused" otherwise."""
    if not transformers.onehot_lookup():
        return "fused"
    embedder = tower.patch_embedder
    return "onehot" if any(embedder_runs_stock(embedder, p, i) for p, i in items) else "fused"


def planner_attention(vision_config) -> str | None:
    """The attention implementation ``fused_vision.pipeline.planner`` prices for a tower's config, or None where the
    config names none (the planner's default then applies)."""
    # The planner prices sdpa and eager. transformers' paged variants compute as their base kernels
    # do (paged eager holds eager's (N, N) scores); the flash-style kernels hold none: priced as sdpa.
    attention = configured_attention(vision_config)
    if not isinstance(attention, str):
        return None
    return attention if attention in planner.ATTENTION_IMPLEMENTATIONS else "sdpa"


def _plan_chunk(
    num_items: int,
    patches_per_item: int,
    tower: nn.Module,
    path: str,
    device: torch.device,
    dtype: torch.dtype,
    input_bytes_per_item: int,
) -> int:
    """Items per encoder call, from ``fused_vision.pipeline.planner``."""
    return planner.plan(
        num_items,
        patches_per_item,
        tower.config,
        path=path,
        device=device,
        dtype=dtype,
        attn_implementation=planner_attention(tower.config),
        extra_bytes_per_item=input_bytes_per_item,
    )


def _encode_chunk(tower: nn.Module, pixel_values: torch.Tensor, position_ids: torch.Tensor) -> list[torch.Tensor]:
    """``Gemma4VisionModel.forward`` on one chunk, with the padding stripped per item instead of flattened."""
    k = tower.config.pooling_kernel_size
    output_length = pixel_values.shape[-2] // (k * k)
    padding = (position_ids == -1).all(dim=-1)
    inputs_embeds = tower.patch_embedder(pixel_values, position_ids, padding)
    hidden_states = tower.encoder(
        inputs_embeds=inputs_embeds, attention_mask=~padding, pixel_position_ids=position_ids
    ).last_hidden_state
    pooler_float32 = transformers.pooler_returns_float32()
    tokens, counts = packed.soft_tokens(
        tower, hidden_states, position_ids, padding, output_length, inputs_embeds.dtype, pooler_float32
    )
    return list(torch.split(tokens, counts))


def encode_images(
    vision_tower: nn.Module,
    pixel_values: torch.Tensor | Sequence[torch.Tensor],
    pixel_position_ids: torch.Tensor | Sequence[torch.Tensor],
    *,
    max_batch: int | None = None,
    packed: bool = True,
) -> list[torch.Tensor]:
    """Encode many images (or video frames) in memory-safe batches, as vLLM does; one tensor per item.

    ``packed=True``: items of any patch counts share a call of the packed encoder (``fused_vision.encoder.packed``:
    their padding dropped, attention per item), each call filled in input order up to
    ``fused_vision.pipeline.planner.plan_tokens(...)`` real patches (and ``max_batch`` items). Where the tower's
    attention implementation is one it does not replace, the padded path runs, with one warning.
    ``packed=False``: items are bucketed by patch count; each bucket runs in chunks of
    ``fused_vision.pipeline.planner.plan(...)`` items (at most ``max_batch``) through the tower's own patch embedder,
    encoder and pooler. A patched and a stock tower both work. Each item's pooled tokens are stripped of
    padding and standardized as the release's ``Gemma4VisionModel.forward`` does.

    Args:
        vision_tower: a ``Gemma4VisionModel``, or a model that contains one (``Gemma4Model``,
            ``Gemma4ForConditionalGeneration``, ``EmbeddingGemma2Model``, DiffusionGemma's models, ...).
        pixel_values: (B, N, K) as the image processor returns it, or a list of (N_i, K) / (1, N_i, K).
        pixel_position_ids: (B, N, 2) int32 or int64 (int64 where a 5.5-5.9 tower runs its stock one-hot),
            or a list of (N_i, 2) / (1, N_i, 2); (-1, -1) marks padding.
        max_batch: cap on the items per encoder call.
        packed: the packed encoder (default) or stock's padded one.

    A chunk that runs out of memory (``torch.OutOfMemoryError``) is retried at half its size, down to one
    item, whose error reaches the caller; the bucket's (packed: the call's) later chunks keep the smaller
    size, and one ``RuntimeWarning`` per bucket names the sizes. No item is lost or reordered.

    Raises:
        ValueError, TypeError: inputs the tower cannot take, naming the argument; on the packed path also an
            item with no real patch, real ids outside the position table or a patch count that is not a
            multiple of the pooling kernel's area.

    Returns:
        A list of (T_i, D) soft tokens in the input order, equal (within floating-point tolerance) to
        running the tower on each item alone. Inputs are moved to the tower's device. Inference only:
        it runs without autograd, whose saved activations the planner's chunks do not budget for.
    """
    with torch.no_grad():
        return _encode_images(resolve_tower(vision_tower), pixel_values, pixel_position_ids, max_batch, packed)


def _max_batch(value) -> int | None:
    """``max_batch`` as an int (numpy integers too), or None."""
    return None if value is None else positive_int("max_batch", value, "a positive int or None")


def _encode_images(tower, pixel_values, pixel_position_ids, max_batch, packed_encoder) -> list[torch.Tensor]:
    max_batch = _max_batch(max_batch)
    items = split_items(tower, pixel_values, pixel_position_ids)
    table = tower.patch_embedder.position_embedding_table
    device, dtype = table.device, table.dtype
    if packed_encoder and not packed.attention_supported(tower.config):
        warn_once(
            f"encode_images: the packed encoder does not replace {tower.config._attn_implementation!r} "
            "attention; the padded path runs",
            stacklevel=3,
        )
    elif packed_encoder:
        return _encode_packed(tower, items, max_batch, device, dtype)

    buckets: dict[int, list[int]] = {}
    for index, item in enumerate(items.pixels):
        buckets.setdefault(item.shape[0], []).append(index)
    outputs: list[torch.Tensor | None] = [None] * len(items.pixels)
    # Each chunk's inputs are copied (stacked, or moved to the device) unless they are slices of one
    # stacked tensor already there: the copy is the chunk's too.
    copies_inputs = items.stacked is None or items.stacked[0].device != device
    for patches, indices in buckets.items():
        first = indices[0]
        input_bytes = patches * (items.pixels[first][0].nbytes + items.ids[first][0].nbytes) if copies_inputs else 0
        path = _checked_path(tower, items, indices)
        chunk = int(_plan_chunk(len(indices), patches, tower, path, device, dtype, input_bytes))
        if max_batch is not None:
            chunk = min(chunk, max_batch)
        chunks = HalvingChunks(max(1, min(chunk, len(indices))), device)
        encoded = chunks.run_consecutive(
            len(indices),
            lambda start, size: min(len(indices), start + size),
            lambda start, end: _encode_chunk(tower, *items.chunk(indices[start:end], device)),
        )
        for index, tokens in zip(indices, encoded, strict=True):
            outputs[index] = tokens
        chunks.warn("encode_images", f"call of {patches} patches", stacklevel=3)
    return outputs  # type: ignore[return-value]


def _checked_path(tower, items: Items, indices) -> str:
    """``planner_path`` for the items ``indices``, whose ids must be int64 where it is the stock one-hot."""
    path = planner_path(tower, [(items.pixels[i], items.ids[i]) for i in indices])
    not_int64 = [i for i in indices if items.ids[i].dtype != torch.int64] if path == "onehot" else []
    if not_int64:
        raise TypeError(
            f"pixel_position_ids: item {not_int64[0]}: the tower runs transformers 5.5-5.9's stock one-hot "
            "lookup, which takes int64 ids only"
        )
    return path


def _encode_packed(tower, items: Items, max_batch, device, dtype) -> list[torch.Tensor]:
    """Packed calls filled in input order up to the planner's token budget; halved on out-of-memory."""
    if not items.pixels:
        return []
    counts = item_counts(tower, items)
    real = counts.real
    path = _checked_path(tower, items, range(len(real)))
    # Each call copies its items' real rows (concatenated, and moved to the device).
    input_bytes = items.pixels[0][0].nbytes + items.ids[0][0].nbytes
    budget = planner.plan_tokens(
        max(real),
        tower.config,
        path=path,
        device=device,
        dtype=dtype,
        extra_bytes_per_patch=input_bytes,
        attn_implementation=planner_attention(tower.config),
    )

    def fill(start: int, cap: int | None) -> int:
        """The end of the call from ``start``: items in order while they fit the budget and the cap."""
        end, tokens = start + 1, real[start]
        while end < len(real) and (cap is None or end - start < cap) and tokens + real[end] <= budget:
            tokens += real[end]
            end += 1
        return end

    pooler_float32, backend = transformers.pooler_returns_float32(), fused_backend(tower)

    def encode(start: int, end: int) -> list[torch.Tensor]:
        pixels = [p.to(device) for p in items.pixels[start:end]]
        ids = [i.to(device) for i in items.ids[start:end]]
        return packed.encode(tower, pixels, ids, pooler_float32, counts.part(start, end), backend)

    chunks = HalvingChunks(max_batch, device)
    outputs = chunks.run_consecutive(len(real), fill, encode)
    chunks.warn("encode_images", "packed call", stacklevel=4)
    return outputs
