"""The stem ops at one case: their providers, and the bytes and FLOPs each op must move at the least.

Providers: ``onehot`` is transformers 5.5-5.9's code, ``embedding`` the 5.10+ code (two F.embedding),
``compiled`` that code through ``torch.compile(dynamic=False)``, ``reference`` fused_vision's public op with
its PyTorch backend (what ``backend="auto"`` runs on a CPU), ``fused`` the public op with the Triton backend,
and ``fused_kernel`` its Triton launcher alone: none of the public op's input checks, so none of their
device-to-host synchronisation (the lookup's id range, the pooler's slot overflow), which a call of a few
microseconds cannot hide.

Byte models count each input read once and each output written once; a lookup reads only the table
rows its ids name. They are the floor of the op, not what any provider moves: the one-hot reads the
whole (2, P, D) table and writes a (B, N, 2, P) int64 one-hot on top.
"""

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

import fused_vision
from fused_vision import reference

from .workloads import PATCH_FEATURES, POSITION_EMBEDDING_SIZE, Case, distinct_table_rows, pixel_values, position_ids

ID_BYTES = torch.int64.itemsize  # stock's ids are int64
BOOL_BYTES = torch.bool.itemsize


class Unsupported(Exception):
    """A provider that cannot run here; the bench logs why and goes on."""


def position_embeddings_bytes(patches: int, hidden: int, table_rows: int, dtype: torch.dtype) -> int:
    """ids (B, N, 2) + padding (B, N) read, ``table_rows`` rows of D read, (B, N, D) written."""
    return patches * (2 * ID_BYTES + BOOL_BYTES) + (table_rows + patches) * hidden * dtype.itemsize


def patch_embed_bytes(patches: int, hidden: int, table_rows: int, dtype: torch.dtype) -> int:
    """The lookup's bytes plus the (B, N, K) float32 pixels and the (D, K) weight."""
    pixels = patches * PATCH_FEATURES * torch.float32.itemsize
    weight = hidden * PATCH_FEATURES * dtype.itemsize
    return pixels + weight + position_embeddings_bytes(patches, hidden, table_rows, dtype)


def patch_embed_flops(patches: int, hidden: int) -> int:
    return 2 * patches * PATCH_FEATURES * hidden


def pool_by_positions_bytes(case: Case, hidden: int, dtype: torch.dtype) -> int:
    """(B, N, D) hidden states, ids and padding read; (B, L, D) float32 pooled and (B, L) mask written."""
    patches, slots = case.patches, case.items * case.soft_tokens
    read = patches * (hidden * dtype.itemsize + 2 * ID_BYTES + BOOL_BYTES)
    return read + slots * (hidden * torch.float32.itemsize + BOOL_BYTES)


def position_embeddings_backward_bytes(patches: int, hidden: int, dtype: torch.dtype) -> int:
    """(B, N, D) output gradient, ids and padding read; the dense (2, P, D) table gradient written."""
    read = patches * (hidden * dtype.itemsize + 2 * ID_BYTES + BOOL_BYTES)
    return read + 2 * POSITION_EMBEDDING_SIZE * hidden * dtype.itemsize


def patch_embed_backward_bytes(patches: int, hidden: int, dtype: torch.dtype) -> int:
    """The lookup's backward bytes plus the (B, N, K) float32 pixels read and the (D, K) weight gradient written."""
    pixels = patches * PATCH_FEATURES * torch.float32.itemsize
    return (
        pixels + hidden * PATCH_FEATURES * dtype.itemsize + position_embeddings_backward_bytes(patches, hidden, dtype)
    )


def pool_by_positions_backward_bytes(case: Case, hidden: int, dtype: torch.dtype) -> int:
    """(B, L, D) float32 pooled gradient, ids and padding read; the (B, N, D) hidden-state gradient written."""
    slots = case.items * case.soft_tokens
    return slots * hidden * torch.float32.itemsize + case.patches * (
        hidden * dtype.itemsize + 2 * ID_BYTES + BOOL_BYTES
    )


def onehot_patch_embed(pixel_values, weight, table, position_ids, padding_positions):
    """Transformers 5.5-5.9's ``Gemma4VisionPatchEmbedder.forward``: the projection plus the one-hot lookup."""
    hidden_states = F.linear(reference.prescale_pixels(pixel_values, weight.dtype), weight)
    return hidden_states + reference.onehot_position_embeddings(table, position_ids, padding_positions)


def compile_static(fn: Callable) -> Callable:
    """``torch.compile`` with static shapes: each case gets its own specialised kernels, as a fixed budget would."""
    return torch.compile(fn, dynamic=False)


class StemBench:
    """One op at one case and width: its inputs, its floor terms, and the call each provider times."""

    name: str
    providers: tuple[str, ...]
    model_bytes: int
    flops: int = 0

    def __init__(self, case: Case, hidden: int, dtype: torch.dtype, device: torch.device):
        self.case = case
        self.ids = position_ids(case, device)
        self.padding = reference.default_padding_positions(self.ids)

    def call(self, provider: str) -> Callable[[], object]:
        """The timed call of ``provider``; any one-off work (a forward to differentiate) happens here."""
        return getattr(self, provider)()


class _TableBench(StemBench):
    """An op that reads the (2, P, D) position table."""

    def __init__(self, case, hidden, dtype, device):
        super().__init__(case, hidden, dtype, device)
        self.table = torch.randn(2, POSITION_EMBEDDING_SIZE, hidden, device=device).to(dtype)
        self.table_rows = distinct_table_rows(self.ids, self.padding)


class PositionEmbeddings(_TableBench):
    name = "position_embeddings"
    providers = ("onehot", "embedding", "compiled", "reference", "fused", "fused_kernel")

    def __init__(self, case, hidden, dtype, device):
        super().__init__(case, hidden, dtype, device)
        self.model_bytes = position_embeddings_bytes(case.patches, hidden, self.table_rows, dtype)
        self.args = (self.table, self.ids, self.padding)

    def onehot(self):
        return partial(reference.onehot_position_embeddings, *self.args)

    def embedding(self):
        return partial(reference.position_embeddings, *self.args)

    def compiled(self):
        return partial(compile_static(reference.position_embeddings), *self.args)

    def reference(self):
        return partial(fused_vision.position_embeddings, *self.args, backend="reference")

    def fused(self):
        return partial(fused_vision.position_embeddings, *self.args, backend="triton")

    def fused_kernel(self):
        from fused_vision.kernels.position_embeddings import position_embeddings

        return partial(position_embeddings, *self.args)


class PatchEmbed(_TableBench):
    name = "patch_embed"
    providers = ("onehot", "embedding", "compiled", "reference", "fused", "fused_kernel")

    def __init__(self, case, hidden, dtype, device):
        super().__init__(case, hidden, dtype, device)
        weight = (torch.randn(hidden, PATCH_FEATURES, device=device) / PATCH_FEATURES**0.5).to(dtype)
        self.args = (pixel_values(self.ids), weight, self.table, self.ids, self.padding)
        self.model_bytes = patch_embed_bytes(case.patches, hidden, self.table_rows, dtype)
        self.flops = patch_embed_flops(case.patches, hidden)

    def onehot(self):
        return partial(onehot_patch_embed, *self.args)

    def embedding(self):
        return partial(reference.patch_embed, *self.args)

    def compiled(self):
        return partial(compile_static(reference.patch_embed), *self.args)

    def reference(self):
        return partial(fused_vision.patch_embed, *self.args, backend="reference")

    def fused(self):
        return partial(fused_vision.patch_embed, *self.args, backend="triton")

    def fused_kernel(self):
        from fused_vision.kernels.patch_embed import patch_embed

        return partial(patch_embed, *self.args)


class PoolByPositions(StemBench):
    """The pooler never had an F.embedding era: every release builds the (B, N, L) one-hot."""

    name = "pool_by_positions"
    providers = ("onehot", "compiled", "reference", "fused", "fused_kernel")

    def __init__(self, case, hidden, dtype, device):
        super().__init__(case, hidden, dtype, device)
        hidden_states = torch.randn(case.items, case.patches_per_item, hidden, device=device).to(dtype)
        self.args = (hidden_states, self.ids, self.padding, case.soft_tokens)
        self.model_bytes = pool_by_positions_bytes(case, hidden, dtype)

    def onehot(self):
        return partial(reference.onehot_pool_by_positions, *self.args)

    def compiled(self):
        return partial(compile_static(reference.onehot_pool_by_positions), *self.args)

    def reference(self):
        return partial(fused_vision.pool_by_positions, *self.args, backend="reference")

    def fused(self):
        return partial(fused_vision.pool_by_positions, *self.args, backend="triton")

    def fused_kernel(self):
        from fused_vision.kernels.pool_by_positions import pool_by_positions

        k = reference.pooling_kernel_size(self.case.patches_per_item, self.case.soft_tokens)
        return partial(pool_by_positions, *self.args, k)


def backward_call(forward: Callable, inputs: tuple[torch.Tensor, ...], grad_output: torch.Tensor) -> Callable:
    """Run ``forward`` once on ``inputs`` made leaves that require grad; the timed call is the gradient
    of its (first) output with respect to them. The peak then counts what the backward allocates
    beyond what the forward saved for it."""
    leaves = tuple(t.detach().requires_grad_() for t in inputs)
    output = forward(*leaves)
    output = output[0] if isinstance(output, tuple) else output
    if output.grad_fn is None:
        raise Unsupported("its output carries no autograd graph (the op has no backward)")
    return partial(torch.autograd.grad, output, leaves, grad_output, retain_graph=True)


class PositionEmbeddingsBackward(_TableBench):
    """The table gradient of the lookup: a dense matmul into the table for the one-hot."""

    name = "position_embeddings_backward"
    providers = ("onehot", "embedding", "reference", "fused")

    def __init__(self, case, hidden, dtype, device):
        super().__init__(case, hidden, dtype, device)
        self.grad_output = torch.randn(case.items, case.patches_per_item, hidden, device=device).to(dtype)
        self.model_bytes = position_embeddings_backward_bytes(case.patches, hidden, dtype)

    def _call(self, lookup: Callable) -> Callable[[], object]:
        return backward_call(lambda table: lookup(table, self.ids, self.padding), (self.table,), self.grad_output)

    def onehot(self):
        return self._call(reference.onehot_position_embeddings)

    def embedding(self):
        return self._call(reference.position_embeddings)

    def reference(self):
        return self._call(partial(fused_vision.position_embeddings, backend="reference"))

    def fused(self):
        return self._call(partial(fused_vision.position_embeddings, backend="triton"))


class PatchEmbedBackward(_TableBench):
    """The gradients a fine-tune needs from the embedder: weight and table (the pixels need none)."""

    name = "patch_embed_backward"
    providers = ("onehot", "embedding", "reference", "fused")

    def __init__(self, case, hidden, dtype, device):
        super().__init__(case, hidden, dtype, device)
        self.pixels = pixel_values(self.ids)
        self.weight = (torch.randn(hidden, PATCH_FEATURES, device=device) / PATCH_FEATURES**0.5).to(dtype)
        self.grad_output = torch.randn(case.items, case.patches_per_item, hidden, device=device).to(dtype)
        self.model_bytes = patch_embed_backward_bytes(case.patches, hidden, dtype)
        self.flops = patch_embed_flops(case.patches, hidden)  # the weight gradient's GEMM

    def _call(self, embed: Callable) -> Callable[[], object]:
        def forward(weight, table):
            return embed(self.pixels, weight, table, self.ids, self.padding)

        return backward_call(forward, (self.weight, self.table), self.grad_output)

    def onehot(self):
        return self._call(onehot_patch_embed)

    def embedding(self):
        return self._call(reference.patch_embed)

    def reference(self):
        return self._call(partial(fused_vision.patch_embed, backend="reference"))

    def fused(self):
        return self._call(partial(fused_vision.patch_embed, backend="triton"))


class PoolByPositionsBackward(StemBench):
    """The hidden states' gradient through the pooler."""

    name = "pool_by_positions_backward"
    providers = ("onehot", "reference", "fused")

    def __init__(self, case, hidden, dtype, device):
        super().__init__(case, hidden, dtype, device)
        self.hidden_states = torch.randn(case.items, case.patches_per_item, hidden, device=device).to(dtype)
        self.grad_output = torch.randn(case.items, case.soft_tokens, hidden, device=device)
        self.model_bytes = pool_by_positions_backward_bytes(case, hidden, dtype)

    def _call(self, pool: Callable) -> Callable[[], object]:
        def forward(hidden_states):
            return pool(hidden_states, self.ids, self.padding, self.case.soft_tokens)

        return backward_call(forward, (self.hidden_states,), self.grad_output)

    def onehot(self):
        return self._call(reference.onehot_pool_by_positions)

    def reference(self):
        return self._call(partial(fused_vision.pool_by_positions, backend="reference"))

    def fused(self):
        return self._call(partial(fused_vision.pool_by_positions, backend="triton"))


STEM_OPS: dict[str, type[StemBench]] = {
    op.name: op
    for op in (
        PositionEmbeddings,
        PatchEmbed,
        PoolByPositions,
        PositionEmbeddingsBackward,
        PatchEmbedBackward,
        PoolByPositionsBackward,
    )
}
