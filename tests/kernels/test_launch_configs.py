"""The tile shapes the launchers pick on a GPU, run here under the interpreter.

CPU runs use the interpreter's own large tiles, so without this the GPU tiles (and the autotune configs
of the patch embedder and the gate/up GEMM) would first meet a test on the GPU. Every dtype runs the GPU's
code: the interpreter computes bf16 as the GPU does (fused_vision/_interpreter.py).
"""

import pytest
import torch

import fused_vision
from fused_vision import reference
from fused_vision.kernels import gate_up_gelu as gate_up_gelu_kernels
from fused_vision.kernels import patch_embed as patch_embed_kernels
from fused_vision.kernels import pool_by_positions as pool_by_positions_kernels
from fused_vision.kernels import position_embeddings as position_embeddings_kernels
from fused_vision.ops.pool_by_positions import pool_by_positions_backward

from helpers import DEVICE, assert_bit_identical, assert_close, dtype_id
from op_cases import assert_matches_stock, make_batch, make_ids, make_inputs

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="on a GPU the real configs run in every test")


@pytest.fixture
def gpu_tiles(monkeypatch):
    """Make the launchers choose the tiles they would choose on a GPU."""
    for module in (position_embeddings_kernels, pool_by_positions_kernels, patch_embed_kernels, gate_up_gelu_kernels):
        monkeypatch.setattr(module, "interpreting", lambda: False)


def test_lookup_gpu_tiles(poisoned, gpu_tiles):
    table = torch.randn(2, 40, 200, dtype=torch.bfloat16)  # D = 200: a partial second 128-column tile
    ids = make_ids(3, 50, 40, padded_tail=7, half_padded=2)  # 150 rows: a partial last 32-row tile
    residual = torch.randn(3, 50, 200, dtype=torch.bfloat16)
    expected = residual + reference.onehot_position_embeddings(table, ids, reference.default_padding_positions(ids))
    assert_bit_identical(fused_vision.position_embeddings(table, ids, residual=residual, backend="triton"), expected)


def test_pooler_backward_gpu_tiles(poisoned, gpu_tiles):
    hidden_states, ids, padding = make_batch([(30, 24), (12, 9)], 3, 80, 200, torch.bfloat16)  # 720 rows, D = 200
    grad_pooled = torch.randn(2, 80, 200)
    actual = pool_by_positions_backward(grad_pooled, ids, padding, 80, torch.bfloat16, True, "triton")
    expected = reference.pool_by_positions_backward(grad_pooled, ids, padding, 80, torch.bfloat16)
    assert_bit_identical(actual, expected, "grad of hidden_states")


class _FixedConfig:
    """Stands in for an autotuner: launches its kernel with one of its configs."""

    def __init__(self, kernel, config):
        self.kernel, self.config = kernel, config

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            meta = dict(self.config.kwargs, num_warps=self.config.num_warps, num_stages=self.config.num_stages)
            return self.kernel[lambda _: grid(meta)](*args, **kwargs, **meta)

        return launch


def candidates(module):
    dtypes = (torch.bfloat16, torch.float16, torch.float32)
    return [(dtype, config) for dtype in dtypes for config in module.gpu_configs(dtype)]


def candidate_id(value):
    return dtype_id(value) if isinstance(value, torch.dtype) else str(value)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=dtype_id)
def test_pooler_gpu_tiles(poisoned, gpu_tiles, dtype):
    # 160 slots over two items: partial slot and column blocks (D = 200), a padded tail, and a third item
    # whose ids repeat a position, which takes the walk over all its patches.
    hidden_states, ids, padding = make_batch([(36, 36), (15, 12), (12, 15)], 3, 160, 200, dtype)
    ids[2, 3] = ids[2, 100]
    pooled, mask = fused_vision.pool_by_positions(hidden_states, ids, padding, 160, backend="triton")
    expected, expected_mask = reference.onehot_pool_by_positions(hidden_states, ids, padding, 160)
    assert_bit_identical(mask, expected_mask, "mask")
    tol = 2**-7 if dtype == torch.bfloat16 else 1e-6
    assert_close(pooled, expected, atol=tol * 200**0.5, rtol=tol)


@pytest.mark.parametrize("dtype,config", candidates(patch_embed_kernels), ids=candidate_id)
def test_patch_embed_autotune_configs(poisoned, gpu_tiles, monkeypatch, dtype, config):
    tuned = _FixedConfig(patch_embed_kernels._patch_embed_tuned.autotuner.fn, config)  # its heuristics, then the kernel
    monkeypatch.setattr(patch_embed_kernels, "_patch_embed_tuned", tuned)
    pixels, weight, table, ids = make_inputs(2, 150, 96, 144, 30, dtype, torch.float32, 11)
    actual = fused_vision.patch_embed(pixels, weight, table, ids, backend="triton")
    assert_matches_stock(actual, pixels, weight, table, ids)


# float32 has no candidate: cuBLAS and the gate kernel run it.
@pytest.mark.parametrize("dtype,config", candidates(gate_up_gelu_kernels), ids=candidate_id)
@pytest.mark.parametrize("rows", [70, 200], ids=["rows_below_a_block", "a_shifted_last_block"])
def test_gate_up_gelu_autotune_configs(poisoned, gpu_tiles, monkeypatch, dtype, config, rows):
    """Each GPU tile on 200 columns of I (a shifted last column block) over D = 96 (K blocks of 32 or 64,
    one partial): bit-identical to cuBLAS's order where every sum is exact, as accurate as stock elsewhere."""
    tuned = _FixedConfig(gate_up_gelu_kernels._gate_up_gelu_tuned.autotuner.fn, config)
    monkeypatch.setattr(gate_up_gelu_kernels, "_gate_up_gelu_tuned", tuned)
    generator = torch.Generator().manual_seed(rows)
    y = torch.randint(-1, 2, (rows, 96), generator=generator).to(dtype)
    weight = (torch.randint(-127, 128, (400, 96), generator=generator) / 1024).to(dtype)
    clamps = torch.tensor([[-1.5, 1.5], [-2.0, 2.0], [-0.75, 0.75]])
    actual = fused_vision.gate_up_gelu(y, weight, clamps, backend="triton")
    expected = fused_vision.gelu_gate(torch.nn.functional.linear(y, weight), clamps, backend="triton")
    assert_bit_identical(actual, expected)


@pytest.mark.parametrize(
    "module,tuner,pointer",
    [(patch_embed_kernels, "_patch_embed_tuned", "weight_ptr"), (gate_up_gelu_kernels, "_gate_up_gelu_tuned", "y_ptr")],
    ids=["patch_embed", "gate_up_gelu"],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=dtype_id)
def test_autotuner_offers_the_candidates_of_the_dtype(module, tuner, pointer, dtype):
    """On a GPU each autotuner prunes its list to the spill-free candidates of its operand dtype."""
    if module is gate_up_gelu_kernels and dtype == torch.float32:
        assert module.gpu_configs(dtype) == [], "float32 is cuBLAS's and the gate kernel's: never tuned"
        return
    tuner = getattr(module, tuner).autotuner
    tuner.nargs = dict(zip(tuner.arg_names, [torch.empty(0)] * len(tuner.arg_names)))
    tuner.nargs[pointer] = torch.empty(0, dtype=dtype)
    try:
        offered = tuner.prune_configs({})
    finally:
        tuner.nargs = None
    assert offered == module.gpu_configs(dtype)


# CUDA's limits on a launch grid: 2**31 - 1 programs on the first axis, 65,535 on the others.
GRID_LIMITS = (2**31 - 1, 65_535, 65_535)


class _GridRecorder:
    """Stands in for a kernel or an autotuner: records each launch's grid for every candidate config
    (a launcher's grid may depend on the tile) and runs nothing."""

    def __init__(self, configs=(None,)):
        self.configs, self.grids = configs, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            for config in self.configs:
                meta = kwargs | (config.kwargs if config else {})
                self.grids.append(tuple(grid(meta) if callable(grid) else grid))

        return launch


def test_launch_grids_stay_within_cuda_limits(gpu_tiles, monkeypatch):
    """At 100,000 items (video frames, say) no kernel may put the items on a grid axis capped at
    65,535: such a launch fails on a GPU, and under the interpreter, which has no limits, nothing else
    would notice."""
    items, seq_len, hidden = 100_000, 4, 8
    recorders = {}
    for module, kernel, tuner in [
        (position_embeddings_kernels, "_position_embeddings_kernel", None),
        (position_embeddings_kernels, "_position_embeddings_backward_kernel", None),
        (pool_by_positions_kernels, "_patch_slots_kernel", None),
        (pool_by_positions_kernels, "_pool_by_positions_backward_kernel", None),
        (pool_by_positions_kernels, "_pool_by_positions_kernel", None),
        (patch_embed_kernels, "_patch_embed_tuned", torch.float16),
    ]:
        recorder = _GridRecorder(module.gpu_configs(tuner) if tuner else (None,))
        monkeypatch.setattr(module, kernel, recorder)
        recorders[kernel] = recorder
    ids = torch.zeros(items, seq_len, 2, dtype=torch.int32, device=DEVICE)
    padding = torch.zeros(items, seq_len, dtype=torch.bool, device=DEVICE)
    rows = torch.zeros(items, seq_len, hidden, dtype=torch.float16, device=DEVICE)
    table = torch.zeros(2, 4, hidden, dtype=torch.float16, device=DEVICE)
    position_embeddings_kernels.position_embeddings(table, ids, padding)
    position_embeddings_kernels.position_embeddings_backward(rows, ids, padding, 4)
    pool_by_positions_kernels.pool_by_positions(rows, ids, padding, 1, 2)
    pool_by_positions_kernels.pool_by_positions_backward(
        torch.zeros(items, 1, hidden, device=DEVICE), ids, padding, 2, torch.float16
    )
    pixels = torch.zeros(items, seq_len, 12, device=DEVICE)
    weight = torch.zeros(hidden, 12, dtype=torch.float16, device=DEVICE)
    patch_embed_kernels.patch_embed(pixels, weight, table, ids, padding)
    for kernel, recorder in recorders.items():
        assert recorder.grids, f"{kernel}: not launched"
        for grid in recorder.grids:
            beyond = [axis for axis, (size, limit) in enumerate(zip(grid, GRID_LIMITS)) if size > limit]
            assert not beyond, f"{kernel}: grid {grid} exceeds CUDA's limit on axes {beyond}"


def test_layer_kernels_gpu_tiles(poisoned, monkeypatch):
    """qkv_norm_rope, residual_rms_norm and gelu_gate at the tiles a GPU gets: partial token, row and column
    tiles (d = 72 quarters of 18 in 32-wide blocks, D = 200, I = 200 over two 128-column tiles)."""
    from fused_vision.kernels import gelu_gate, qkv_norm_rope, residual_rms_norm

    for module in (gelu_gate, qkv_norm_rope, residual_rms_norm):
        monkeypatch.setattr(module, "interpreting", lambda: False)
    qkv = torch.randn(45, 4 * 72, dtype=torch.float16)
    ids, weight, inv_freq = torch.randint(0, 30, (45, 2)), torch.randn(72, dtype=torch.float16), torch.rand(18)
    actual = fused_vision.qkv_norm_rope(qkv, ids, weight, weight, inv_freq, 2, 1, backend="triton")
    expected = reference.qkv_norm_rope(qkv, ids, weight, weight, inv_freq, 2, 1)
    for a, e in zip(actual, expected):
        assert_close(a, e, atol=2e-3, rtol=2**-10)
    x, residual, norm_weight = torch.randn(37, 200), torch.randn(37, 200), torch.randn(200)
    actual = fused_vision.residual_rms_norm(x, residual, norm_weight, norm_weight, backend="triton")
    for a, e in zip(actual, reference.residual_rms_norm(x, residual, norm_weight, norm_weight)):
        assert_close(a, e, atol=1e-5, rtol=1e-5)
    gate_up = 3 * torch.randn(37, 400)
    assert_close(fused_vision.gelu_gate(gate_up, backend="triton"), reference.gelu_gate(gate_up), atol=1e-5, rtol=1e-5)
