"""The packed encoder's embedder and layers in CUDA graphs, one per token bucket (opt-in).

vLLM captures its encoder's CUDA graphs on padded batches; this captures the packed sequence. A call of T
real patches replays the graph of the smallest bucket of at least T rows: the items' rows first, then the
bucket's remaining rows split evenly into padding items, each attending only to itself, then items of no
rows up to the graph's item count. The items' offsets are a device buffer that each replay reads, and the longest
item is taken to be the bucket, so one graph serves any items that fit it. The pooler and the split into
items run eagerly after the replay, from the items' counts: a call syncs once to count its items, and
not at all given the counts. The attention must be a path that reads only the offsets (``GRAPH_PATHS``).
Details: docs/encoders.md, "CUDA graphs".
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .._dispatch import warn_once
from .._validation import positive_int
from ..encoder import fused_layer, varlen
from ..encoder.attention import Packing
from ..encoder.packed import ItemCounts, check_attention, encoded_rows, pack_items, pooled_items
from ..integrations.encoder import fused_backend
from ..integrations.transformers import pooler_returns_float32
from ._inputs import Items, item_counts, resolve_tower, split_items

# The paths whose kernels read the items from the offsets on the device, not from host lengths.
GRAPH_PATHS = ("flash_attn_3", "flash_attn_4", "vllm_flash_attn", "flash_attn", "torch_varlen", "cudnn")


@dataclass
class _Bucket:
    """One bucket's static inputs and output, and the graph that reads and writes them (None off CUDA)."""

    pixels: torch.Tensor  # (rows, K)
    ids: torch.Tensor  # (rows, 2)
    offsets: torch.Tensor  # (2 * max_items + 1,) int32: the items', the padding items', then empty items'
    rows: torch.Tensor | None = None  # (rows, D), written by the graph
    graph: torch.cuda.CUDAGraph | None = None


def bucket_lengths(lengths: Sequence[int], rows: int, max_items: int) -> list[int]:
    """The 2 * ``max_items`` item lengths of a bucket of ``rows`` holding ``lengths`` items: theirs, then
    ``max_items`` padding items that split the remaining rows evenly, then empty items.

    A padding item's attention grows with the square of its rows: split ``max_items`` ways, the padding
    attends (rows - T)**2 / max_items pairs in all, and no padding item is longer than the longest real
    one wherever rows - T <= T (a call that fills at least half its bucket)."""
    pieces, longer = divmod(rows - sum(lengths), max_items)
    padding = [pieces + 1] * longer + [pieces] * (max_items - longer)
    return [*lengths, *padding, *[0] * (max_items - len(lengths))]


def bucket_offsets(lengths: Sequence[int], rows: int, max_items: int) -> list[int]:
    """The items' offsets in the layout ``bucket_lengths`` gives, the device buffer each replay reads."""
    return [0, *itertools.accumulate(bucket_lengths(lengths, rows, max_items))]


class GraphedEncoder:
    """``packed.encode`` with the tower's embedder and layers replayed from CUDA graphs, one per bucket.

    Args:
        tower: a ``Gemma4VisionModel`` (patched with ``encoder="fused"`` for the fused layers) on a CUDA
            device, with an attention the packed encoder replaces, or a model that contains one (as
            ``encode_images`` takes it).
        token_buckets: the row counts to capture, a sequence of positive ints: a call takes the smallest that
            holds its items' real patches. Each bucket's graph is captured on its first call with that pixel
            dtype.
        max_items: the most items one call may hold.

    A graph reads the tower's weights where they were at its capture: after the tower's parameters or
    buffers move (``.to``, a weight replaced), or its fused backend changes, the next call drops every graph
    and captures again. Off CUDA there are no graphs: each call runs the same bucketed layout eagerly, with
    one warning. Inference only: calls run without autograd.
    """

    def __init__(self, tower: nn.Module, token_buckets: Sequence[int], max_items: int):
        if isinstance(token_buckets, (str, bytes)) or not isinstance(token_buckets, Iterable):
            raise TypeError(f"token_buckets: expected a sequence of positive ints, got {token_buckets!r}")
        buckets = sorted({positive_int("token_buckets", value, "positive ints") for value in token_buckets})
        if not buckets:
            raise ValueError("token_buckets: expected at least one positive int")
        self.tower = resolve_tower(tower, "tower")
        check_attention(self.tower.config, "tower")
        self.buckets, self.max_items = tuple(buckets), positive_int("max_items", max_items)
        self._captured: dict[tuple[int, torch.dtype], _Bucket] = {}
        self._captured_for: tuple | None = None  # the tower's state the captured graphs read
        self._modules_read: list[nn.Module] = []
        self._pool = None  # one memory pool for every bucket's graph: only one replays at a time

    def __call__(
        self,
        pixel_values: torch.Tensor | Sequence[torch.Tensor],
        pixel_position_ids: torch.Tensor | Sequence[torch.Tensor],
        counts: ItemCounts | None = None,
    ) -> list[torch.Tensor]:
        """Soft tokens of each item, as ``packed.encode`` returns them, from what ``encode_images`` takes:
        (B, N, K) and (B, N, 2) tensors, or lists of (N_i, K) / (1, N_i, K) pixels and (N_i, 2) /
        (1, N_i, 2) ids, moved to the tower's device; ``counts``: the items' ``count_items``, where the
        caller has them."""
        items = split_items(self.tower, pixel_values, pixel_position_ids)
        if len(items.ids) > self.max_items:
            raise ValueError(f"pixel_position_ids: {len(items.ids)} items, more than max_items={self.max_items}")
        if not items.ids:
            return []
        device = self.tower.patch_embedder.position_embedding_table.device
        pixel_values = [p.to(device) for p in items.pixels]
        position_ids = [i.to(device) for i in items.ids]
        with torch.no_grad():
            counts = item_counts(self.tower, Items(pixel_values, position_ids, None), counts)
            total = sum(counts.real)
            rows = next((bucket for bucket in self.buckets if bucket >= total), None)
            if rows is None:
                raise ValueError(
                    f"pixel_position_ids: {total} real patches, more than the largest of token_buckets "
                    f"({self.buckets[-1]})"
                )
            real, lengths, pixels, ids = pack_items(pixel_values, position_ids, counts.real)
            bucket = self._bucket(rows, pixels)
            bucket.pixels[:total].copy_(pixels[0])
            bucket.pixels[total:].zero_()
            bucket.ids[:total].copy_(ids[0])
            bucket.ids[total:].zero_()
            offsets = torch.tensor(bucket_offsets(lengths, rows, self.max_items), dtype=torch.int32)
            on_cuda = bucket.offsets.device.type == "cuda"
            bucket.offsets.copy_(offsets.pin_memory() if on_cuda else offsets, non_blocking=on_cuda)
            if bucket.graph is not None:
                bucket.graph.replay()
                encoded = bucket.rows
            else:  # no graph: the same layout, with the lengths sdpa reads on the host
                encoded = self._run(bucket, bucket_lengths(lengths, rows, self.max_items))
            return pooled_items(self.tower, encoded[:total], real, position_ids, counts, pooler_returns_float32())

    def _tower_state(self) -> tuple:
        """What a captured graph reads of the tower: its fused backend, its modules, and their tensors' storage
        and dtypes. Read off the module list of the last capture (a walk of the tower costs 30x more): a
        replaced module changes its parent's children, and the next capture walks the tower again."""
        state: list = [fused_backend(self.tower)]
        for module in self._modules_read:
            state += map(id, module._modules.values())
            tensors = itertools.chain(module._parameters.values(), module._buffers.values())
            state += ((t.data_ptr(), t.dtype) for t in tensors if t is not None)
        return tuple(state)

    def _run(self, bucket: _Bucket, lengths: Sequence[int]) -> torch.Tensor:
        packing = Packing(bucket.offsets, lengths, bucket.pixels.shape[0])
        return encoded_rows(self.tower, bucket.pixels, bucket.ids, packing, fused_backend(self.tower))

    def _bucket(self, rows: int, pixels: torch.Tensor) -> _Bucket:
        """The bucket of ``rows`` and the pixels' dtype, its graph captured on its first call on a CUDA device
        (and again once the tower's state has changed)."""
        state = self._tower_state()
        if state != self._captured_for:
            if state[0] is not None:  # the fused layers' joined weights, made now rather than in a capture
                fused_layer.prepare(self.tower)
            self._modules_read = list(self.tower.modules())
            state = self._tower_state()
            self._captured.clear()
            self._captured_for = state
        key = (rows, pixels.dtype)
        if key in self._captured:
            return self._captured[key]
        device, features = pixels.device, pixels.shape[-1]
        bucket = _Bucket(
            pixels=torch.zeros(rows, features, dtype=pixels.dtype, device=device),
            ids=torch.zeros(rows, 2, dtype=torch.int64, device=device),
            offsets=torch.tensor(bucket_offsets([], rows, self.max_items), dtype=torch.int32, device=device),
        )
        if device.type != "cuda":
            warn_once(f"GraphedEncoder: no CUDA graphs on {device.type}: each call runs eagerly", 3)
            self._captured[key] = bucket
            return bucket
        self._check_attention_path(device)
        # Padding items of all the rows: the layout the capture sees; any other replays alike.
        empty = bucket_lengths([], rows, self.max_items)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # compiles, autotunes and the clamps' first read stay out of the capture
            for _ in range(2):
                self._run(bucket, empty)
        torch.cuda.current_stream(device).wait_stream(side)
        bucket.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(bucket.graph, pool=self._pool):
            bucket.rows = self._run(bucket, empty)
        self._pool = bucket.graph.pool()
        self._captured[key] = bucket
        return bucket

    def _check_attention_path(self, device: torch.device) -> None:
        config = self.tower.config
        dtype = self.tower.patch_embedder.position_embedding_table.dtype
        query = torch.empty(1, config.num_attention_heads, config.head_dim, dtype=dtype, device=device)
        path = varlen.attention_path(query)
        if path not in GRAPH_PATHS:
            raise RuntimeError(
                f"GraphedEncoder: the attention path here is {path!r}, which reads the items' lengths on the host; "
                f"a graph needs one of {', '.join(GRAPH_PATHS)} (see {varlen.ENV_ATTENTION})"
            )
