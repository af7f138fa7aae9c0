"""The patch embedder, the lookup and the pooler captured in one CUDA graph, as vLLM captures Gemma 4's vision
tower, and replayed on new inputs: bit-identical to eager calls on those inputs. Without CUDA (smoke mode)
there are no graphs: eager calls on the captured buffers stand in, to test the rest."""

import pytest
import torch

import fused_vision
from fused_vision import reference

from .conftest import SIZES, P, image_ids
from helpers import DEVICE, assert_bit_identical

pytestmark = pytest.mark.gpu


def stem(weight, table, pixels, ids, residual, hidden_states):
    """The three ops with backend "auto", as the patched Gemma 4 modules call them."""
    padding = reference.default_padding_positions(ids)
    embedded = fused_vision.patch_embed(pixels, weight, table, ids, padding)
    looked_up = fused_vision.position_embeddings(table, ids, padding, residual=residual)
    pooled, mask = fused_vision.pool_by_positions(hidden_states, ids, padding, SIZES.soft_tokens)
    return dict(embedded=embedded, looked_up=looked_up, pooled=pooled, mask=mask)


def inputs(items, seed):
    generator = torch.Generator().manual_seed(seed)  # new grids, so new padding, on each seed
    ids = image_ids(items, SIZES.soft_tokens, generator=generator)
    return dict(
        pixels=torch.rand(*ids.shape[:2], SIZES.features, generator=generator).to(DEVICE),
        ids=ids,
        residual=torch.randn(*ids.shape[:2], SIZES.hidden, generator=generator).to(DEVICE, torch.bfloat16),
        hidden_states=torch.randn(*ids.shape[:2], SIZES.hidden, generator=generator).to(DEVICE, torch.bfloat16),
    )


def assert_replay_matches_eager(items, warm_up_items):
    """The stem warmed up on ``warm_up_items`` items, captured on ``items`` items, replayed on new inputs."""
    weight = (torch.randn(SIZES.hidden, SIZES.features, device=DEVICE) / SIZES.features**0.5).bfloat16()
    table = torch.randn(2, P, SIZES.hidden, device=DEVICE, dtype=torch.bfloat16)
    static, new = inputs(items, 1), inputs(items, 2)
    stem(weight, table, **inputs(warm_up_items, 0))  # autotuning and compilation cannot be captured
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # a sync in any op fails the capture
            captured = stem(weight, table, **static)
    for name, value in new.items():
        static[name].copy_(value)
    if DEVICE.type == "cuda":
        graph.replay()
    else:
        captured = stem(weight, table, **static)
    for name, expected in stem(weight, table, **new).items():
        assert_bit_identical(captured[name], expected, name)


def test_replay_on_new_inputs_matches_eager():
    assert_replay_matches_eager(SIZES.batch, warm_up_items=SIZES.batch)


def test_capture_at_a_new_batch_size_matches_eager():
    """Captured at half the batch it was warmed up at, as a server meets a new batch size: nothing may
    compile, autotune or sync (the tiles are tuned per D, not per batch size)."""
    assert_replay_matches_eager(max(1, SIZES.batch // 2), warm_up_items=SIZES.batch)
