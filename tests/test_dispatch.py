"""The backend rule: which path "auto" takes, the environment override, and the warn-once fallback."""

import dataclasses
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import fused_vision
from fused_vision import _device, _dispatch
from fused_vision.encoder import varlen
from fused_vision.kernels import patch_embed as patch_embed_kernels
from fused_vision.kernels import position_embeddings as position_embeddings_kernels
from fused_vision.reference import default_padding_positions, onehot_position_embeddings

from helpers import assert_bit_identical

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def fresh_failures(monkeypatch):
    monkeypatch.setattr(_dispatch, "_failed", set())


@pytest.mark.parametrize("interpret,off", [("1", "0"), ("true", "false"), ("On", "off")])
def test_auto_on_cpu_follows_the_interpreter(monkeypatch, interpret, off):
    """TRITON_INTERPRET read as Triton reads it: where Triton interprets, so must the dispatch rule."""
    monkeypatch.delenv("FUSED_VISION_BACKEND", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    assert _dispatch.resolve_backend("auto", CPU) == "auto"
    monkeypatch.setenv("TRITON_INTERPRET", off)
    assert _dispatch.resolve_backend("auto", CPU) == "reference"
    with pytest.raises(RuntimeError, match=r"backend='triton': Triton does not drive cpu tensors"):
        _dispatch.resolve_backend("triton", CPU)


def test_auto_on_gpus():
    assert _dispatch.resolve_backend("auto", torch.device("cuda")) == "auto"
    assert _dispatch.resolve_backend("auto", torch.device("xpu")) == "auto"
    assert _dispatch.resolve_backend("auto", torch.device("mps")) == "reference"


@pytest.mark.parametrize("forced", ["reference", "triton"])
def test_environment_overrides_auto_only(monkeypatch, forced):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("FUSED_VISION_BACKEND", forced)
    assert _dispatch.resolve_backend("auto", CPU) == forced
    assert _dispatch.resolve_backend("reference", CPU) == "reference"
    if forced == "triton":  # where Triton cannot serve, the error names the variable, not an argument never passed
        table = torch.randn(2, 16, 8)
        with (
            fwAD.dual_level(),
            pytest.raises(RuntimeError, match=r"^FUSED_VISION_BACKEND=triton: .* no forward-mode AD"),
        ):
            fused_vision.position_embeddings(
                fwAD.make_dual(table, torch.randn_like(table)), torch.randint(0, 16, (1, 3, 2))
            )
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(RuntimeError, match=r"^FUSED_VISION_BACKEND=triton: Triton does not drive cpu tensors"):
            _dispatch.resolve_backend("auto", CPU)


def test_bad_environment_value(monkeypatch):
    monkeypatch.setenv("FUSED_VISION_BACKEND", "cuda")
    with pytest.raises(
        ValueError, match=r"FUSED_VISION_BACKEND='cuda': expected one of auto, triton, reference \(or unset\)"
    ):
        _dispatch.resolve_backend("auto", CPU)


def test_kernel_failure_falls_back_once_with_one_warning(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("FUSED_VISION_BACKEND", raising=False)
    calls = []

    def broken(*args):
        calls.append(1)
        raise RuntimeError("simulated compile failure")

    monkeypatch.setattr(position_embeddings_kernels, "position_embeddings", broken)
    table = torch.randn(2, 16, 24, dtype=torch.bfloat16)
    ids = torch.randint(-1, 16, (2, 9, 2))
    expected = onehot_position_embeddings(table, ids, default_padding_positions(ids))
    with pytest.warns(RuntimeWarning, match=r"position_embeddings: the Triton kernel failed on cpu .*simulated"):
        assert_bit_identical(fused_vision.position_embeddings(table, ids), expected)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_bit_identical(fused_vision.position_embeddings(table, ids), expected)
    assert len(calls) == 1, "a failed kernel is not retried on every call"
    with pytest.raises(RuntimeError, match="simulated"):
        fused_vision.position_embeddings(table, ids, backend="triton")


def test_out_of_memory_is_raised_and_leaves_the_kernel_enabled(monkeypatch):
    """Running out of device memory is not the kernel's failure: the error reaches the caller (the
    reference would need more memory still) and the next call runs the kernel again."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("FUSED_VISION_BACKEND", raising=False)
    launch, calls = position_embeddings_kernels.position_embeddings, []

    def out_of_memory_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("simulated: CUDA out of memory")
        return launch(*args, **kwargs)

    monkeypatch.setattr(position_embeddings_kernels, "position_embeddings", out_of_memory_once)
    table = torch.randn(2, 16, 24, dtype=torch.bfloat16)
    ids = torch.randint(-1, 16, (2, 9, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(torch.OutOfMemoryError, match="simulated"):
            fused_vision.position_embeddings(table, ids)
        out = fused_vision.position_embeddings(table, ids)
    assert len(calls) == 2 and not _dispatch._failed
    assert_bit_identical(out, onehot_position_embeddings(table, ids, default_padding_positions(ids)))


def test_kernels_launch_on_their_tensors_device(monkeypatch):
    """Triton launches on the current device: a model spread over GPUs calls the ops with tensors on another
    one, so dispatch makes theirs current for the launch, and switches nothing when it already is."""
    current, entered = [0], []

    class DeviceContext:  # stands in for torch.cuda.device on this GPU-less machine
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            entered.append(self.index)
            current[0], self.previous = self.index, current[0]

        def __exit__(self, *exc):
            current[0] = self.previous

    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "device", DeviceContext)
    launched_on = []
    for index in (1, 0):
        for backend in ("triton", "auto"):
            _dispatch.dispatch("op", backend, torch.device("cuda", index), lambda: launched_on.append(current[0]), None)
    assert launched_on == [1, 1, 0, 0] and entered == [1, 1] and current == [0]


@pytest.fixture
def rocm_gfx942(monkeypatch):
    """A ROCm machine with one MI300X as torch reports it: device type "cuda", 64 KiB of LDS, wavefronts of 64."""
    properties = SimpleNamespace(
        gcnArchName="gfx942:sramecc+:xnack-", major=9, minor=4, shared_memory_per_block_optin=65536, warp_size=64
    )
    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: properties)
    _device._cuda_device_limits.cache_clear()
    yield
    _device._cuda_device_limits.cache_clear()


def test_rocm_runs_the_kernels_with_tiles_that_fit_its_lds(rocm_gfx942):
    gpu = torch.device("cuda", 0)
    assert _dispatch.resolve_backend("auto", gpu) == "auto"
    limits = _device.device_limits(gpu)
    assert limits == _device.DeviceLimits("gfx942", 65536)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        offered = patch_embed_kernels.gpu_configs(dtype, limits)
        assert offered and set(offered) <= set(patch_embed_kernels.gpu_configs(dtype)), dtype
    # NVIDIA's big half-precision tiles give way to the two-stage ones sized for 64 KiB.
    tiles = {
        (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_D"], c.num_stages)
        for c in patch_embed_kernels.gpu_configs(torch.bfloat16, limits)
    }
    assert tiles == {(64, 128, 2), (128, 128, 2)}


HOPPER_TILES = {(128, 128, 64, 3), (64, 256, 64, 3), (64, 128, 64, 4), (128, 64, 64, 4)}


@pytest.mark.parametrize(
    "arch,shared,expected",
    [
        ("sm_90", 232448, HOPPER_TILES),
        ("sm_80", 166912, {(64, 256, 64, 3), (128, 128, 32, 2)}),
        ("sm_86", 101376, {(128, 128, 32, 2)}),
        ("sm_120", 101376, {(128, 128, 32, 4), (128, 128, 32, 2)}),
    ],
)
def test_nvidia_embedder_tiles_per_architecture(arch, shared, expected):
    """Hopper and Blackwell keep every 64-deep big tile (32-deep ones issue over 48 instructions per HGMMA:
    bench/tools/speed_of_light.py); mma.sync's architectures only those that neither spill nor overflow
    there (bench/tools/build_matrix.py's findings), and the two-stage tile."""
    offered = patch_embed_kernels.gpu_configs(torch.bfloat16, _device.DeviceLimits(arch, shared))
    tiles = {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_D"], c.kwargs["BLOCK_K"], c.num_stages) for c in offered}
    assert tiles == expected


def test_rocm_attention_takes_a_varlen_kernel(rocm_gfx942, monkeypatch):
    """flash-attn's and torch's FlashAttention-2 build for ROCm; FlashAttention-3 and 4 and cuDNN do not."""
    query = torch.empty(8, 2, 64, dtype=torch.bfloat16)
    monkeypatch.setattr(query.__class__, "device", property(lambda self: torch.device("cuda", 0)), raising=False)
    for name in varlen.PATHS:
        monkeypatch.setitem(varlen.PATHS, name, dataclasses.replace(varlen.PATHS[name], load=lambda: object()))
    assert varlen.attention_path(query) == "flash_attn"
    for name in ("flash_attn", "vllm_flash_attn"):
        monkeypatch.setitem(varlen.PATHS, name, dataclasses.replace(varlen.PATHS[name], load=lambda: None))
    assert varlen.attention_path(query) == "torch_varlen"
