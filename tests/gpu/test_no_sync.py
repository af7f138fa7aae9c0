"""The ops as vLLM runs the patched embedder with VLLM_GPU_SYNC_CHECK=error: no device-to-host sync, and a
bad id's row NaN rather than an error."""

import contextlib
import os
from unittest import mock

import pytest
import torch

import fused_vision
from fused_vision import _dispatch

from .conftest import SIZES, P, image_ids, sync_debug_mode
from helpers import DEVICE, assert_bit_identical

pytestmark = pytest.mark.gpu


@contextlib.contextmanager
def syncs_forbidden():
    """A device-to-host sync raises, as under VLLM_GPU_SYNC_CHECK=error (torch's sync debug mode). Without
    CUDA (smoke mode) there is no such mode: the id checks are switched off instead, to test the rest."""
    if DEVICE.type != "cuda":
        with mock.patch.dict(os.environ, {"FUSED_VISION_CHECK_IDS": "0"}):
            yield
        return
    with sync_debug_mode("error"):
        yield


@pytest.mark.parametrize("op_name", ["patch_embed", "position_embeddings"])
def test_no_sync_where_syncs_are_forbidden(op_name):
    ids = image_ids(SIZES.batch, SIZES.soft_tokens)
    bad_ids = ids.clone()
    bad_ids[0, 0] = P  # a real patch (the grid comes first), out of range on both axes
    others = torch.ones(ids.shape[:2], dtype=torch.bool, device=DEVICE)
    others[0, 0] = False
    pixels = torch.rand(*ids.shape[:2], SIZES.features, device=DEVICE)
    weight = (torch.randn(SIZES.hidden, SIZES.features, device=DEVICE) / SIZES.features**0.5).bfloat16()
    table = torch.randn(2, P, SIZES.hidden, device=DEVICE, dtype=torch.bfloat16)
    residual = torch.randn(*ids.shape[:2], SIZES.hidden, device=DEVICE, dtype=torch.bfloat16)
    op = {  # backend "auto", as the patched Gemma 4 embedder calls them
        "patch_embed": lambda position_ids: fused_vision.patch_embed(pixels, weight, table, position_ids),
        "position_embeddings": lambda position_ids: fused_vision.position_embeddings(
            table, position_ids, residual=residual
        ),
    }[op_name]
    expected = op(ids)  # and the warm-up: autotuning syncs, once per shape, as in vLLM's profile run
    with syncs_forbidden():
        good = op(ids)
        if _dispatch._failed:  # the reference would index the table with the bad id: a device-side assert
            pytest.fail(f"{op_name}: 'auto' fell back to the reference, which must not meet out-of-range ids")
        unchecked = op(bad_ids)
    assert_bit_identical(good, expected)
    assert unchecked[0, 0].isnan().all(), "the row of the bad id"
    assert_bit_identical(unchecked[others], expected[others], "the rows of good ids")
