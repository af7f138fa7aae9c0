"""Every GPU family gets tiles: each autotuned kernel is asked for its configs on the limits a device of
each family reports (docs/compatibility.md's table), and a device no list names gets its family's.

The launchers that pick a config per architecture are the two autotuned GEMMs; the others pick theirs
from the shapes alone, or per vendor (qkv_norm_rope's FAST_TRIG, which the build matrix applies per target).
"""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import fused_vision
from fused_vision import _device, _dispatch
from fused_vision.kernels import gate_up_gelu as gate_up_gelu_kernels
from fused_vision.kernels import patch_embed as patch_embed_kernels
from fused_vision.ops import patch_embed as patch_embed_op

from helpers import DEVICE, assert_bit_identical, dtype_id, reverting_to_stock
from op_cases import make_inputs

sys.path.insert(0, str(Path(__file__).parents[2] / "bench" / "tools"))
from targets import TARGETS  # the build matrix's targets: one table of limits

stock_after_each_test = reverting_to_stock(fresh_warnings=True)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
KIB = 1024
# Each autotuned kernel and the dtypes its op runs it in (float32 gate/up: cuBLAS and the gate kernel).
TUNED = {
    "patch_embed": (patch_embed_kernels.gpu_configs, DTYPES),
    "gate_up_gelu": (gate_up_gelu_kernels.gpu_configs, (torch.bfloat16, torch.float16)),
}
# (device, dtype) pairs no tensor-core dot serves: the ops' documented fallbacks instead of a tile. Triton
# builds Turing's dots on the FMA units (fp32's tiles serve it as everywhere).
LACKING = {("sm_75", torch.bfloat16), ("sm_75", torch.float16)}
# Devices of a known family that no tile list names, as they report themselves: each gets tiles, those of
# the named device of its family with the same shared memory (less any that device's generation alone gets).
UNNAMED = {
    "Jetson AGX Thor under CUDA 12": (_device.DeviceLimits("sm_101", 227 * KIB), "sm_110a"),
    "a GeForce RTX 50 laptop variant": (_device.DeviceLimits("sm_122", 99 * KIB), "sm_121"),
    "Jetson Orin Nano": (_device.DeviceLimits("sm_87", 163 * KIB), "sm_87"),
    "a later Ampere part": (_device.DeviceLimits("sm_88", 99 * KIB), "sm_86"),
    "MI300A": (_device.DeviceLimits("gfx940", 64 * KIB), "gfx942"),
    "Ryzen AI Max (Strix Halo)": (_device.DeviceLimits("gfx1151", 64 * KIB), "gfx1100"),
    "RX 9060 XT": (_device.DeviceLimits("gfx1200", 64 * KIB), "gfx1201"),
}
# Devices outside every family: Volta, Jetson Xavier, Vega, RDNA 2, and a generation not yet released.
OUTSIDE = ("sm_70", "sm_72", "gfx906", "gfx1030", "sm_130")


@pytest.mark.parametrize("target", TARGETS.values(), ids=lambda target: target.name)
@pytest.mark.parametrize("kernel", TUNED, ids=str)
def test_every_family_gets_tiles(target, kernel):
    gpu_configs, dtypes = TUNED[kernel]
    limits = target.limits
    assert limits.family is not None, f"{limits.arch}: no tensor-core family"
    for dtype in dtypes:
        offered = gpu_configs(dtype, limits)
        if (limits.arch, dtype) in LACKING:
            assert offered == [] and not limits.multiplies(dtype)
        else:
            assert offered, f"{kernel}: no {dtype} tile for {limits.arch} ({limits.shared_memory // KIB} KiB)"
            assert set(offered) <= set(gpu_configs(dtype)), dtype


def test_the_build_matrix_lists_turing_half_precision_as_fallbacks():
    """bench/tools/build_matrix.py fails a (target, dtype) whose dots take the dtype and get no GEMM tile, and
    lists the ones no tensor-core dot serves as the ops' fallbacks: here, Turing's bf16 and fp16 alone."""
    import build_matrix

    failures, fallbacks = build_matrix.unserved(list(TARGETS.values()))
    assert failures == []
    assert fallbacks == [
        f"sm_75: fused_vision.kernels.{kernel} offers no {dtype} candidate"
        for kernel in ("patch_embed", "gate_up_gelu")
        for dtype in ("bfloat16", "float16")
    ]


@pytest.mark.parametrize("name", UNNAMED, ids=str)
def test_an_unnamed_device_gets_its_familys_tiles(name):
    limits, named = UNNAMED[name]
    assert limits.family == TARGETS[named].limits.family
    for gpu_configs, dtypes in TUNED.values():
        for dtype in dtypes:
            offered = gpu_configs(dtype, limits)
            assert offered and set(offered) <= set(gpu_configs(dtype, TARGETS[named].limits)), (name, dtype)


@pytest.mark.parametrize("arch", OUTSIDE, ids=str)
def test_a_device_outside_every_family_gets_a_decision(arch):
    limits = _device.DeviceLimits(arch, 96 * KIB)
    assert limits.family is None
    for gpu_configs, dtypes in TUNED.values():
        for dtype in dtypes:
            assert gpu_configs(dtype, limits) == []


@pytest.fixture
def device_reports(monkeypatch):
    """Make every device report the given limits, as ``_device.device_limits`` reads them off a GPU."""

    def report(arch: str, shared: int):
        monkeypatch.setattr(_device, "device_limits", lambda device: _device.DeviceLimits(arch, shared))

    return report


def test_untiled_names_the_device_and_why(device_reports):
    gpu = torch.device("cuda", 0)
    device_reports("sm_75", 64 * KIB)
    assert _dispatch.untiled(patch_embed_kernels.gpu_configs, torch.float32, gpu) is None
    why = _dispatch.untiled(patch_embed_kernels.gpu_configs, torch.bfloat16, gpu)
    assert why == "has no torch.bfloat16 tile for sm_75, where Triton builds its dots on the FMA units"
    device_reports("sm_70", 96 * KIB)
    assert "outside every tensor-core family" in _dispatch.untiled(patch_embed_kernels.gpu_configs, torch.float16, gpu)
    device_reports("sm_80", 16 * KIB)
    why = _dispatch.untiled(gate_up_gelu_kernels.gpu_configs, torch.float16, gpu)
    assert why == "has no torch.float16 tile within the 16 KiB of shared memory of sm_80"


@pytest.mark.skipif(DEVICE.type != "cpu", reason="reports a T4's limits for the interpreter's CPU tensors")
def test_turing_bf16_embedder_runs_the_reference(device_reports, poisoned):
    """On a T4, bf16 has no tile: "auto" warns once and runs the reference, "triton" says why."""
    device_reports("sm_75", 64 * KIB)
    pixels, weight, table, ids = make_inputs(2, 20, 48, 64, 16, torch.bfloat16, torch.float32, 3)
    with pytest.warns(RuntimeWarning, match="no torch.bfloat16 tile for sm_75.*the PyTorch reference runs it"):
        actual = fused_vision.patch_embed(pixels, weight, table, ids)
    assert_bit_identical(actual, fused_vision.patch_embed(pixels, weight, table, ids, backend="reference"))
    with pytest.raises(RuntimeError, match="backend='triton': fused_vision.patch_embed's kernel has no"):
        fused_vision.patch_embed(pixels, weight, table, ids, backend="triton")
    assert patch_embed_op._untiled(pixels, weight.float(), table, ids, None) is None


@pytest.mark.skipif(DEVICE.type != "cpu", reason="reports a T4's limits for the interpreter's CPU tensors")
@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_turing_bf16_gate_up_runs_cublas_and_the_gate_kernel(device_reports, poisoned, monkeypatch, backend):
    device_reports("sm_75", 64 * KIB)
    launched = []
    monkeypatch.setattr(gate_up_gelu_kernels, "gate_up_gelu", lambda *args: launched.append(args))
    y, weight = torch.randn(37, 48, dtype=torch.bfloat16), torch.randn(2 * 40, 48, dtype=torch.bfloat16)
    clamps = torch.tensor([[-1.5, 1.5], [-2.0, 2.0], [-0.75, 0.75]])
    with pytest.warns(RuntimeWarning, match="no torch.bfloat16 tile for sm_75.*cuBLAS's GEMM and the gate kernel"):
        actual = fused_vision.gate_up_gelu(y, weight, clamps, backend=backend)
    expected = fused_vision.gelu_gate(torch.nn.functional.linear(y, weight), clamps, backend="triton")
    assert_bit_identical(actual, expected)
    assert not launched, "the fused kernel launched without a tile"


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_limits_read_off_a_rocm_device_pick_the_wmma_tiles(monkeypatch, dtype):
    """A Radeon RX 9070 XT as torch reports it under ROCm: gcnArchName with its features, 64 KiB of LDS."""
    properties = SimpleNamespace(gcnArchName="gfx1201", shared_memory_per_block_optin=64 * KIB)
    monkeypatch.setattr(torch.version, "hip", "7.0.0")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: properties)
    _device._cuda_device_limits.cache_clear()
    try:
        limits = _device.device_limits(torch.device("cuda", 0))
    finally:
        _device._cuda_device_limits.cache_clear()
    assert limits == TARGETS["gfx1201"].limits and limits.family == _device.WMMA
    assert patch_embed_kernels.gpu_configs(dtype, limits)
