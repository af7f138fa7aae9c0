"""The checks every op shares: when the id checks run (a sync on a GPU), and the int32 offsets every launcher
guards. Each op's own bad inputs are tested beside it, in tests/ops/."""

import types

import pytest
import torch

from fused_vision._validation import id_checks_enabled
from fused_vision.reference import default_padding_positions

from helpers import DEVICE
from op_cases import grid_ids


@pytest.mark.parametrize(
    "capturing, sync_debug_mode, checked",
    [(False, 0, True), (True, 0, False), (False, 1, False), (False, 2, False)],
    ids=["plain", "graph_capture", "sync_debug_warn", "sync_debug_error"],
)
def test_id_checks_skip_where_a_cuda_sync_is_unwanted(monkeypatch, capturing, sync_debug_mode, checked):
    """The id checks synchronise the device: not while a CUDA graph is captured, nor while torch's sync
    debug mode is armed (as vLLM's VLLM_GPU_SYNC_CHECK arms it); the kernels' NaN rows stand in there.
    tests/gpu/test_no_sync.py runs the ops under the real mode on a GPU."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: sync_debug_mode)
    assert id_checks_enabled(types.SimpleNamespace(is_cuda=True)) is checked  # the decision reads the device only
    assert id_checks_enabled(torch.zeros(1, 1, 2, dtype=torch.int64))  # host ids: no device to stall


@pytest.mark.parametrize(
    "requested, on_gpu, on_gpu_unguarded, on_host",
    [(None, False, True, True), ("1", True, True, True), ("0", False, False, False)],
    ids=["default", "requested", "off"],
)
def test_gpu_kernels_check_ids_only_on_request(monkeypatch, requested, on_gpu, on_gpu_unguarded, on_host):
    """On a GPU the kernels' paths (guarded: they write NaN for bad ids) skip the syncing checks unless
    FUSED_VISION_CHECK_IDS=1; paths that would index out of bounds, and host ids, check by default."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    if requested is None:
        monkeypatch.delenv("FUSED_VISION_CHECK_IDS", raising=False)
    else:
        monkeypatch.setenv("FUSED_VISION_CHECK_IDS", requested)
    gpu_ids, host_ids = types.SimpleNamespace(is_cuda=True), torch.zeros(1, 1, 2, dtype=torch.int64)
    assert id_checks_enabled(gpu_ids, guarded=True) is on_gpu
    assert id_checks_enabled(gpu_ids) is on_gpu_unguarded
    assert id_checks_enabled(host_ids, guarded=True) is on_host
    assert id_checks_enabled(host_ids) is on_host


def test_kernels_copy_the_strided_views_their_int32_offsets_cannot_reach():
    """The kernels offset rows in int64 and columns in int32: a view whose last dimension spans 2**31
    elements or more is made contiguous first; any other tensor, however large, is passed as it is.
    Meta tensors: strides without memory."""
    from fused_vision.kernels.common import int32_inner_offsets

    def meta(shape, stride):
        return torch.empty_strided(shape, stride, dtype=torch.bfloat16, device="meta")

    large_contiguous = meta((800, 2520, 1152), (2520 * 1152, 1152, 1))  # 2.3e9 elements
    every_other_item = meta((400, 2520, 1152), (2 * 2520 * 1152, 1152, 1))
    items_transposed = meta((800, 2520, 1152), (1152, 800 * 1152, 1))  # (N, B, D) memory
    small_columns_transposed = meta((2, 1000, 1152), (1152 * 1000, 1, 1000))  # (B, D, N) memory
    large_columns_transposed = meta((1, 2**21, 1152), (1152 * 2**21, 1, 2**21))
    for kept in (large_contiguous, every_other_item, items_transposed, small_columns_transposed):
        assert int32_inner_offsets(kept) is kept
    copied = int32_inner_offsets(large_columns_transposed)
    assert copied.is_contiguous() and copied.shape == large_columns_transposed.shape


def test_every_launcher_guards_the_tensors_it_indexes_in_int32(monkeypatch):
    """Each launcher passes every tensor it indexes through int32_inner_offsets (the pooler's: a copy where
    int32 column offsets would overflow; the test above checks the helper itself) or offset_dtype (the
    others': int64 offsets where any operand's span needs them); ids and padding have none."""
    from fused_vision.kernels import patch_embed as patch_embed_kernels
    from fused_vision.kernels import pool_by_positions as pool_by_positions_kernels
    from fused_vision.kernels import position_embeddings as position_embeddings_kernels
    from fused_vision.kernels.common import offset_dtype

    guarded = []

    def record(tensor):
        guarded.append(tensor)
        return tensor

    def covers(seen, tensor):
        return seen is tensor or (seen.data_ptr() == tensor.data_ptr() and seen.numel() == tensor.numel())

    def record_offsets(*tensors):
        guarded.extend(tensors)
        return offset_dtype(*tensors)

    monkeypatch.setattr(pool_by_positions_kernels, "int32_inner_offsets", record)
    for module in (position_embeddings_kernels, patch_embed_kernels, pool_by_positions_kernels):
        monkeypatch.setattr(module, "offset_dtype", record_offsets)
    table = torch.randn(2, 20, 8, device=DEVICE)
    ids = torch.randint(0, 20, (2, 5, 2), device=DEVICE)
    padding = default_padding_positions(ids)
    rows = torch.randn(2, 5, 8, device=DEVICE)
    pixels, weight = torch.rand(2, 5, 12, device=DEVICE), torch.randn(8, 12, device=DEVICE)
    pool_ids, pool_padding = grid_ids(2, 2, 4)[None].to(DEVICE), torch.zeros(1, 4, dtype=torch.bool, device=DEVICE)
    hidden_states, grad_pooled = torch.randn(1, 4, 8, device=DEVICE), torch.randn(1, 1, 8, device=DEVICE)
    launches = {
        "position_embeddings": (
            lambda: position_embeddings_kernels.position_embeddings(table, ids, padding, rows),
            [table, rows],
        ),
        "position_embeddings_backward": (
            lambda: position_embeddings_kernels.position_embeddings_backward(rows, ids, padding, 20),
            [rows],
        ),
        "patch_embed": (
            lambda: patch_embed_kernels.patch_embed(pixels, weight, table, ids, padding),
            [pixels, weight, table],
        ),
        "pool_by_positions": (
            lambda: pool_by_positions_kernels.pool_by_positions(hidden_states, pool_ids, pool_padding, 1, 2),
            [hidden_states],
        ),
        "pool_by_positions_backward": (
            lambda: pool_by_positions_kernels.pool_by_positions_backward(
                grad_pooled, pool_ids, pool_padding, 2, torch.float32
            ),
            [grad_pooled],
        ),
    }
    for name, (launch, tensors) in launches.items():
        guarded.clear()
        launch()
        # The tensor itself, or a view of all of it (a launcher's rows of a (B, N, D) tensor).
        missed = [i for i, tensor in enumerate(tensors) if not any(covers(seen, tensor) for seen in guarded)]
        assert not missed, f"{name}: arguments {missed} reach the kernel unguarded"
