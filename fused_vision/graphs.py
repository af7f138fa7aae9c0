"""The packed encoder's embedder and layers in CUDA graphs, one per token bucket (opt-in).

vLLM captures its encoder's CUDA graphs on padded batches; this captures the packed sequence. A call of T
real patches replays the graph of the smallest bucket of at least T rows: the items' rows first, then one
padding item of the bucket's remaining rows, which attends only to itself, then items of no rows up to
the graph's item count. The items' offsets are a device buffer that each replay reads, and the longest
item is taken to be the bucket, so one graph serves any items that fit it. The pooler and the split into
items run eagerly after the replay, from the items' counts: a call syncs once to count its items, and
not at all given the counts. The attention must be a path that reads only the offsets (``GRAPH_PATHS``).
Details: docs/encoders.md, "CUDA graphs".
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ._dispatch import warn_once
from ._validation import positive_int
from .encoder import varlen
from .encoder.attention import Packing
from .encoder.packed import ItemCounts, check_attention, count_items, encoded_rows, pack_items, pooled_items
from .integrations.encoder import fused_backend
from .integrations.transformers import pooler_returns_float32

# The paths whose kernels read the items from the offsets on the device, not from host lengths.
GRAPH_PATHS = ("flash_attn_3", "flash_attn_4", "vllm_flash_attn", "flash_attn", "torch_varlen", "cudnn")


@dataclass
class _Bucket:
    """One bucket's static inputs and output, and the graph that reads and writes them (None off CUDA)."""

    pixels: torch.Tensor  # (rows, K)
    ids: torch.Tensor  # (rows, 2)
    offsets: torch.Tensor  # (max_items + 2,) int32: the items', the padding item's, then empty items'
    rows: torch.Tensor | None = None  # (rows, D), written by the graph
    graph: torch.cuda.CUDAGraph | None = None


def bucket_offsets(lengths: Sequence[int], rows: int, max_items: int) -> list[int]:
    """The offsets of ``lengths`` items in a bucket of ``rows``: theirs, the padding item's end, then the
    same end for each empty item up to ``max_items`` items."""
    offsets = [0, *itertools.accumulate(lengths)]
    return offsets + [rows] * (max_items + 2 - len(offsets))


class GraphedEncoder:
    """``packed.encode`` with the tower's embedder and layers replayed from CUDA graphs, one per bucket.

    Args:
        tower: a ``Gemma4VisionModel`` (patched with ``encoder="fused"`` for the fused layers) on a CUDA
            device, with an attention the packed encoder replaces.
        token_buckets: the row counts to capture, each a positive int: a call takes the smallest that holds
            its items' real patches. Each bucket's graph is captured on its first call.
        max_items: the most items one call may hold.

    Off CUDA there are no graphs: each call runs the same bucketed layout eagerly, with one warning.
    Inference only: calls run without autograd.
    """

    def __init__(self, tower: nn.Module, token_buckets: Sequence[int], max_items: int):
        buckets = sorted({positive_int("token_buckets", value, "positive ints") for value in token_buckets})
        if not buckets:
            raise ValueError("token_buckets: expected at least one positive int")
        check_attention(tower.config, "tower")
        self.tower, self.buckets, self.max_items = tower, tuple(buckets), positive_int("max_items", max_items)
        self._captured: dict[int, _Bucket] = {}
        self._pool = None  # one memory pool for every bucket's graph: only one replays at a time

    def __call__(
        self,
        pixel_values: Sequence[torch.Tensor],
        position_ids: Sequence[torch.Tensor],
        counts: ItemCounts | None = None,
    ) -> list[torch.Tensor]:
        """Soft tokens of each item, (N_i, K) pixels and (N_i, 2) ids on the tower's device, as
        ``packed.encode`` returns them; ``counts``: the items' ``count_items``, where the caller has them."""
        config = self.tower.config
        if len(position_ids) > self.max_items:
            raise ValueError(f"pixel_position_ids: {len(position_ids)} items, more than max_items={self.max_items}")
        with torch.no_grad():
            if counts is None:
                counts = count_items(position_ids, config.pooling_kernel_size, config.position_embedding_size)
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
                encoded = self._run(bucket, (*lengths, rows - total))
            return pooled_items(self.tower, encoded[:total], real, position_ids, counts, pooler_returns_float32())

    def _run(self, bucket: _Bucket, lengths: tuple[int, ...]) -> torch.Tensor:
        packing = Packing(bucket.offsets, lengths, bucket.pixels.shape[0])
        return encoded_rows(self.tower, bucket.pixels, bucket.ids, packing, fused_backend(self.tower))

    def _bucket(self, rows: int, pixels: torch.Tensor) -> _Bucket:
        """The bucket of ``rows``, its graph captured on its first call on a CUDA device."""
        if rows in self._captured:
            return self._captured[rows]
        device, features = pixels.device, pixels.shape[-1]
        bucket = _Bucket(
            pixels=torch.zeros(rows, features, dtype=pixels.dtype, device=device),
            ids=torch.zeros(rows, 2, dtype=torch.int64, device=device),
            offsets=torch.tensor(bucket_offsets([], rows, self.max_items), dtype=torch.int32, device=device),
        )
        if device.type != "cuda":
            warn_once(f"GraphedEncoder: no CUDA graphs on {device.type}: each call runs eagerly", 3)
            self._captured[rows] = bucket
            return bucket
        self._check_attention_path(device)
        # The padding item of all the rows: the layout the capture sees; any other replays alike.
        empty = (rows,) + (0,) * self.max_items
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
        self._captured[rows] = bucket
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
