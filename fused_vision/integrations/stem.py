"""The stem of Gemma 4's vision tower (patch embedder, position lookup, pooler) as patched forwards, shared
by the integrations whose towers are built of transformers' stem modules or their 5.5-5.9 form:
``fused_vision.integrations.transformers`` and ``fused_vision.integrations.sglang`` (its embedder).

Each forward runs the fused op where it computes what stock does, else stock's own code: when, in
docs/transformers.md and docs/sglang.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

from .. import patching
from .._dispatch import BACKENDS
from .._validation import FLOAT_DTYPES, INDEX_DTYPES
from ..ops.patch_embed import patch_embed as _fused_patch_embed
from ..ops.position_embeddings import position_embeddings as _fused_position_embeddings

__all__ = [
    "EMBEDDER_OPS",
    "FusedOp",
    "broadcast_rows",
    "check_keywords",
    "embedder_runs_stock",
    "lookup_is_onehot",
    "plain_linear",
    "pooler_runs_fused",
    "tower_targets",
]

# What ``embedder=`` takes: the whole embedder in one kernel, or the lookup alone inside the stock one.
EMBEDDER_OPS = ("patch_embed", "position_embeddings")


@dataclasses.dataclass(frozen=True)
class FusedOp:
    """The state a patched module runs with: its op and backend, and its release family."""

    op: str  # "patch_embed", "position_embeddings", "pool_by_positions", "packed_encoder" or "fused_encoder"
    backend: str
    # The release family, told once at patch time so that forwards (and torch.compile) see constants.
    onehot_lookup: bool = dataclasses.field(default=False, compare=False)
    pooler_float32: bool = dataclasses.field(default=True, compare=False)

    def __str__(self) -> str:
        return f"{self.op}(backend={self.backend})"


def lookup_is_onehot(embedder_cls: type) -> bool:
    """Whether the class's stock lookup is the one-hot matmul of 5.5-5.9 (else the F.embedding of 5.10+)."""
    lookup = patching.stock_attribute(embedder_cls, "_position_embeddings")
    return lookup is not patching.MISSING and "one_hot" in lookup.__code__.co_names


# ---- the embedder's patched methods, and when the pooler's run fused -------------------------------


def plain_linear(linear: nn.Module) -> bool:
    """An ``nn.Linear`` whose weight the fused embedder may read directly (no bias, hooks or quantization)."""
    if not isinstance(linear, nn.Linear) or linear.bias is not None:
        return False
    if linear._forward_hooks or linear._forward_pre_hooks or hasattr(linear, "_hf_hook"):
        return False
    weight = linear.weight
    return type(weight) in (torch.Tensor, nn.Parameter) and weight.dtype in FLOAT_DTYPES


def _autocast_enabled(device_type: str) -> bool:
    """``torch.is_autocast_enabled``, False on the meta device, where it raises. (Not through
    ``torch.amp.is_autocast_available``: torch 2.11's dynamo breaks the graph on it.)"""
    return device_type != "meta" and torch.is_autocast_enabled(device_type)


def _lookup_runs_stock(embedder: nn.Module, pixel_position_ids) -> bool:
    """Whether the embedder's lookup runs stock code: it is not patched, or a dtype is one the fused op
    does not take (a float64 table, say)."""
    return (
        patching.fused_state(embedder) is None
        or embedder.position_embedding_table.dtype not in FLOAT_DTYPES
        or not isinstance(pixel_position_ids, torch.Tensor)
        or pixel_position_ids.dtype not in INDEX_DTYPES
    )


def embedder_runs_stock(embedder: nn.Module, pixel_values, pixel_position_ids) -> bool:
    """Whether the embedder hands these inputs to its stock forward: its lookup does, or the pixels are of a
    dtype the fused ops do not take (float64, say)."""
    return (
        _lookup_runs_stock(embedder, pixel_position_ids)
        or not isinstance(pixel_values, torch.Tensor)
        or pixel_values.dtype not in FLOAT_DTYPES
    )


def _lookup_table(embedder: nn.Module, fused: FusedOp) -> torch.Tensor:
    """The position table in the dtype whose rows the stock lookup returns."""
    table = embedder.position_embedding_table
    device_type = table.device.type
    if fused.onehot_lookup and _autocast_enabled(device_type):
        # 5.5-5.9's one-hot matmul runs in the autocast dtype: its rows come out rounded to it
        table = table.to(torch.get_autocast_dtype(device_type))
    return table


def broadcast_rows(features, position_ids, padding_positions):
    """(B, N, ·) features, (B, N, 2) ids and (B, N) padding (None passes through) expanded to one batch, as
    stock's arithmetic broadcasts a batch of one (an engine may pair (1, N, 2) ids with (B, N, K) pixels);
    or None where they are not such rows of one N: stock then runs, and broadcasts or raises as it does."""
    present = [(t, ndim) for t, ndim in ((features, 3), (position_ids, 3), (padding_positions, 2)) if t is not None]
    if any(not isinstance(t, torch.Tensor) or t.dim() != ndim for t, ndim in present):
        return None
    if len({t.shape[1] for t, _ in present}) != 1:
        return None
    batches = {t.shape[0] for t, _ in present} - {1}
    if len(batches) > 1:
        return None
    batch = batches.pop() if batches else 1
    return tuple(
        t if t is None or t.shape[0] == batch else t.expand(batch, *t.shape[1:])
        for t in (features, position_ids, padding_positions)
    )


def _embedder_position_embeddings(self, pixel_position_ids, padding_positions, *args, **kwargs):
    """``Gemma4VisionPatchEmbedder._position_embeddings`` as ``fused_vision.position_embeddings``, bit-identical.

    Our forward never calls it; vLLM 0.34+ does: its ``_embed_patches`` inlines the embedder's forward
    around its own ``input_proj`` and asks the module for the lookup alone.
    """
    rows = None if args or kwargs else broadcast_rows(None, pixel_position_ids, padding_positions)
    if rows is None or _lookup_runs_stock(self, pixel_position_ids):
        return patching.stock_method(self, "_position_embeddings")(
            pixel_position_ids, padding_positions, *args, **kwargs
        )
    fused = patching.fused_state(self)
    return _fused_position_embeddings(_lookup_table(self, fused), *rows[1:], backend=fused.backend)


def _embedder_forward(self, pixel_values, pixel_position_ids, padding_positions=None, *args, **kwargs):
    """``Gemma4VisionPatchEmbedder.forward`` with the fused patch embedder, or the fused lookup alone."""
    # args, kwargs: arguments of a newer stock signature; let stock handle them
    rows = None if args or kwargs else broadcast_rows(pixel_values, pixel_position_ids, padding_positions)
    if rows is None or embedder_runs_stock(self, pixel_values, pixel_position_ids):
        return patching.stock_method(self, "forward")(
            pixel_values, pixel_position_ids, padding_positions, *args, **kwargs
        )
    pixel_values, pixel_position_ids, padding_positions = rows

    fused, table, weight = patching.fused_state(self), self.position_embedding_table, self.input_proj.weight
    if (
        fused.op == "patch_embed"
        and plain_linear(self.input_proj)
        and weight.dtype == table.dtype
        and not _autocast_enabled(pixel_values.device.type)
    ):
        return _fused_patch_embed(
            pixel_values, weight, table, pixel_position_ids, padding_positions, backend=fused.backend
        )

    # The lookup alone, fused with the residual add; the projection stays the module's own.
    pixel_values = 2 * (pixel_values - 0.5)
    if weight.dtype.is_floating_point:
        pixel_values = pixel_values.to(weight.dtype)
    hidden_states = self.input_proj(pixel_values)
    table, backend = _lookup_table(self, fused), fused.backend
    if hidden_states.dtype == table.dtype:
        return _fused_position_embeddings(
            table, pixel_position_ids, padding_positions, residual=hidden_states, backend=backend
        )
    # e.g. autocast: keep stock's type promotion of `hidden_states + position_embeddings`
    return hidden_states + _fused_position_embeddings(table, pixel_position_ids, padding_positions, backend=backend)


def pooler_runs_fused(pooler: nn.Module, hidden_states, pixel_position_ids, padding_positions, output_length) -> bool:
    """Whether the pooler is patched and ``pool_by_positions`` takes these inputs as stock reads them; else
    stock runs, and raises its own errors."""
    return (
        patching.fused_state(pooler) is not None
        and not isinstance(output_length, bool)
        and isinstance(output_length, int)
        and isinstance(hidden_states, torch.Tensor)
        and hidden_states.dim() == 3
        and hidden_states.dtype in FLOAT_DTYPES
        and hidden_states.shape[-1] == pooler.hidden_size
        and 1 <= output_length <= hidden_states.shape[1]
        and isinstance(pixel_position_ids, torch.Tensor)
        and pixel_position_ids.dtype in INDEX_DTYPES
        and isinstance(padding_positions, torch.Tensor)
        and padding_positions.dtype == torch.bool
        and not _autocast_enabled(hidden_states.device.type)  # stock's matmul would run in low precision
    )


# ---- what an apply_… call patches ------------------------------------------------------------------


def check_keywords(
    caller: str,
    model,
    *,
    embedder: str | None,
    pooler: bool,
    encoder: str,
    backend: str,
    encoders: Sequence[str],
) -> None:
    """The checks every ``apply_…`` makes before it imports its engine or patches anything, so that the same
    bad input raises the same error in each (docs/integrations.md); ``encoders``: what this engine's
    ``encoder=`` takes."""
    patching.check_model(model)
    if embedder is not None and embedder not in EMBEDDER_OPS:
        raise ValueError(f"embedder: expected one of {EMBEDDER_OPS} or None, got {embedder!r}")
    if encoder not in encoders:
        raise ValueError(f"encoder: expected one of {tuple(encoders)}, got {encoder!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if embedder is None and not pooler and encoder == "stock":
        raise ValueError(f"{caller}: nothing selected (embedder=None, pooler=False, encoder='stock')")


def tower_targets(
    embedder_cls: type,
    poolers: Sequence[tuple[type, object]],
    release: dict,
    *,
    embedder: str | None,
    pooler: bool,
    backend: str,
    encoder: patching.Target | None = None,
) -> list[patching.Target]:
    """What an ``apply_…`` call patches, its keywords checked (``check_keywords``): a tower's embedder class
    (its forward and its lookup) with the op ``embedder`` names, its pooler classes (``poolers``: (class,
    forward) pairs) when ``pooler``, and the ``encoder`` target when given."""
    targets = [] if encoder is None else [encoder]
    if embedder is not None:
        methods = {"forward": _embedder_forward, "_position_embeddings": _embedder_position_embeddings}
        targets.append(patching.Target(embedder_cls, methods, FusedOp(embedder, backend, **release)))
    if pooler:
        state = FusedOp("pool_by_positions", backend, **release)
        targets += [patching.Target(cls, {"forward": forward}, state) for cls, forward in poolers]
    return targets
