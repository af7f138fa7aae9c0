"""The backend rule: which path "auto" takes, the environment override, and the warn-once fallback."""

import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import fused_vision
from fused_vision import _dispatch
from fused_vision.kernels import position_embeddings as position_embeddings_kernels
from fused_vision.reference import default_padding_positions, onehot_position_embeddings

from conftest import assert_bit_identical

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
    with pytest.raises(ValueError, match=r"FUSED_VISION_BACKEND: expected one of"):
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
