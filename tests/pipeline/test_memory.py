"""planner.device_memory per backend (CPU and cgroups, CUDA, XPU, MPS, other accelerators) and plan on it."""

import os

import pytest
import torch

from fused_vision.pipeline import _memory
from fused_vision.pipeline.planner import device_memory, plan, transient_bytes_per_item

from real_towers import FRAME, IMAGE, TOWER_26B_31B, GiB, MiB


def _no_cuda(*args, **kwargs):
    raise AssertionError("torch.cuda.mem_get_info called for a non-CUDA device")


def test_cpu_memory_is_the_hosts():
    free, total = device_memory("cpu")
    assert isinstance(free, int) and isinstance(total, int)
    assert 0 < free <= total
    if hasattr(os, "sysconf") and "SC_PHYS_PAGES" in os.sysconf_names:
        physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        assert total == physical if _memory._cgroup_limit() is None else total <= physical


@pytest.mark.parametrize(
    "files, limited",
    [
        ({"memory.max": "2147483648\n", "memory.current": "536870912\n"}, True),
        ({"memory.max": "max\n", "memory.current": "536870912\n"}, False),
        ({"memory/memory.limit_in_bytes": "2147483648\n", "memory/memory.usage_in_bytes": "536870912\n"}, True),
        ({"memory/memory.limit_in_bytes": "9223372036854771712\n", "memory/memory.usage_in_bytes": "1\n"}, False),
    ],
    ids=["v2_limit", "v2_max", "v1_limit", "v1_unlimited"],
)
def test_cpu_memory_within_a_containers_cgroup_limit(monkeypatch, tmp_path, files, limited):
    """A 2 GiB container on a 64 GiB host: its limit, less what it uses, not the host's free RAM."""
    monkeypatch.setattr(_memory, "_machine_memory", lambda: (48 * GiB, 64 * GiB))  # fixed: RAM use drifts
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(_memory, "CGROUP_ROOT", str(tmp_path))
    assert device_memory("cpu") == ((1536 * MiB, 2 * GiB) if limited else (48 * GiB, 64 * GiB))


def test_cpu_memory_without_proc_meminfo(monkeypatch):
    if "SC_AVPHYS_PAGES" not in getattr(os, "sysconf_names", {}):
        pytest.skip("no sysconf page counts here")

    def no_meminfo(*args, **kwargs):
        raise FileNotFoundError("/proc/meminfo")

    monkeypatch.setattr(_memory, "open", no_meminfo, raising=False)
    free, total = device_memory(torch.device("cpu"))
    assert 0 < free <= total == os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def test_cuda_memory(monkeypatch):
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: asked.append(device) or (5, 9))
    assert device_memory("cuda:1") == (5, 9)
    assert asked == [torch.device("cuda:1")]


def test_xpu_memory_asks_xpu_only(monkeypatch):
    asked = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", _no_cuda)
    monkeypatch.setattr(torch.xpu, "is_available", lambda: True)
    monkeypatch.setattr(torch.xpu, "mem_get_info", lambda device=None: asked.append(device) or (2 * GiB, 64 * GiB))
    assert device_memory("xpu:0") == (2 * GiB, 64 * GiB)
    assert asked == [torch.device("xpu:0")]
    assert plan(1000, IMAGE, TOWER_26B_31B, device="xpu:0") == plan(
        1000, IMAGE, TOWER_26B_31B, free_bytes=2 * GiB, total_bytes=64 * GiB
    )


def test_mps_memory_asks_mps_only(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", _no_cuda)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.mps, "recommended_max_memory", lambda: 16 * GiB)
    monkeypatch.setattr(torch.mps, "driver_allocated_memory", lambda: 4 * GiB)
    assert device_memory("mps") == (12 * GiB, 16 * GiB)
    monkeypatch.setattr(torch.mps, "driver_allocated_memory", lambda: 20 * GiB)  # over the recommendation
    assert device_memory("mps") == (0, 16 * GiB)
    assert plan(8, FRAME, TOWER_26B_31B, device="mps") == 1


@pytest.mark.parametrize("device", ["cuda", "xpu", "mps"])
def test_a_device_this_torch_cannot_see_is_named(monkeypatch, device):
    """Not a backend's own AssertionError: the argument, and the way out (free_bytes and total_bytes)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.xpu, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    pattern = f"device: this torch sees no {device} device; pass free_bytes and total_bytes"
    with pytest.raises(ValueError, match=pattern):
        device_memory(device)
    with pytest.raises(ValueError, match=pattern):
        plan(8, FRAME, TOWER_26B_31B, device=device)


def test_a_device_index_without_an_accelerator_is_named(monkeypatch):
    def no_accelerator(index):
        raise RuntimeError("Cannot access accelerator device when none is available.")

    monkeypatch.setattr(torch, "device", no_accelerator)
    for call in (lambda: device_memory(0), lambda: plan(8, FRAME, TOWER_26B_31B, device=0)):
        with pytest.raises(ValueError, match=r"device: 0 names no device here .*pass free_bytes and total_bytes"):
            call()


def test_other_accelerators_through_torch_accelerator(monkeypatch):
    if not hasattr(torch.accelerator, "get_memory_info"):
        pytest.skip("torch.accelerator.get_memory_info is torch 2.10+")
    asked = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", _no_cuda)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: torch.device("hpu"))
    monkeypatch.setattr(torch.accelerator, "get_memory_info", lambda device=None: asked.append(device) or (3, 7))
    assert device_memory("hpu:1") == (3, 7)
    assert asked == [torch.device("hpu:1")]


def test_mps_prices_sdpa_as_eager(monkeypatch):
    """MPS's SDPA builds the (N, N) scores that CUDA's fused kernels never hold."""
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.mps, "recommended_max_memory", lambda: 16 * GiB)
    monkeypatch.setattr(torch.mps, "driver_allocated_memory", lambda: 0)
    memory = dict(free_bytes=16 * GiB, total_bytes=16 * GiB)
    eager = plan(64, FRAME * 8, TOWER_26B_31B, attn_implementation="eager", **memory)
    assert eager < plan(64, FRAME * 8, TOWER_26B_31B, **memory)
    assert plan(64, FRAME * 8, TOWER_26B_31B, device="mps") == eager


def test_extra_bytes_per_item_add_to_the_cost():
    memory = dict(free_bytes=3 * GiB, total_bytes=22 * GiB)
    cost = transient_bytes_per_item(FRAME, TOWER_26B_31B)
    budget = 3 * GiB // 2
    assert plan(1000, FRAME, TOWER_26B_31B, **memory) == budget // cost
    assert plan(1000, FRAME, TOWER_26B_31B, extra_bytes_per_item=cost, **memory) == budget // (2 * cost)
    with pytest.raises(ValueError, match="extra_bytes_per_item"):
        plan(1, FRAME, TOWER_26B_31B, extra_bytes_per_item=-1, **memory)


@pytest.mark.parametrize("device", ["meta", "hpu"])
def test_unknown_device_type_is_a_clear_error(monkeypatch, device):
    monkeypatch.setattr(torch.cuda, "mem_get_info", _no_cuda)
    with pytest.raises(ValueError, match=f"device: cannot query memory of device type '{device}'"):
        device_memory(device)
