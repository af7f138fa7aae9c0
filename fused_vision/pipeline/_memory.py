"""The free and total memory of a device, asked of its own backend (``fused_vision.pipeline.planner``'s budget)."""

from __future__ import annotations

import os

import torch

__all__ = ["current_device", "device_memory", "visible_device"]


def visible_device(device: torch.device | str | int) -> torch.device:
    """``torch.device(device)``, which must name a device this torch can see."""
    try:
        device = torch.device(device)
    except RuntimeError as exc:  # an index where this machine has no accelerator
        raise ValueError(f"device: {device!r} names no device here ({exc}); pass free_bytes and total_bytes") from None
    available = {"cuda": torch.cuda.is_available, "xpu": torch.xpu.is_available, "mps": torch.backends.mps.is_available}
    if device.type in available and not available[device.type]():
        raise ValueError(
            f"device: this torch sees no {device.type} device; "
            "pass free_bytes and total_bytes to plan for another machine"
        )
    return device


def device_memory(device: torch.device | str | int) -> tuple[int, int]:
    """(free_bytes, total_bytes) of ``device``, asked of its own backend.

    CUDA and ROCm (whose devices are "cuda" too): ``torch.cuda.mem_get_info``. XPU: ``torch.xpu.mem_get_info``.
    MPS: Metal's recommended working-set size as the total, less what the Metal driver holds for this
    process. CPU: available and total RAM from the operating system, within the process's cgroup memory
    limit (a container's) when it has one. Any other accelerator (HPU, an out-of-tree NPU, ...):
    ``torch.accelerator.get_memory_info`` where this torch has it (2.10+).
    """
    device = visible_device(device)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
    elif device.type == "xpu":
        free, total = torch.xpu.mem_get_info(device)
    elif device.type == "mps":
        total = torch.mps.recommended_max_memory()
        free = max(0, total - torch.mps.driver_allocated_memory())
    elif device.type == "cpu":
        free, total = _host_memory()
    elif hasattr(torch.accelerator, "get_memory_info") and device.type == getattr(
        torch.accelerator.current_accelerator(check_available=True), "type", None
    ):
        free, total = torch.accelerator.get_memory_info(device)
    else:
        raise ValueError(
            f"device: cannot query memory of device type {device.type!r}; expected cuda, xpu, mps, cpu or "
            "this machine's accelerator with torch 2.10+ (or pass free_bytes and total_bytes)"
        )
    return int(free), int(total)


def _host_memory() -> tuple[int, int]:
    """The host's available and total RAM, cut to the cgroup's limit and what it has left under it."""
    free, total = _machine_memory()
    limit = _cgroup_limit()
    if limit is not None:
        limit_bytes, used_bytes = limit
        free, total = min(free, max(0, limit_bytes - used_bytes)), min(total, limit_bytes)
    return free, total


def _machine_memory() -> tuple[int, int]:
    try:  # Linux: MemAvailable counts reclaimable page cache, which sysconf's free pages do not
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        return _kib_field(fields["MemAvailable"]), _kib_field(fields["MemTotal"])
    except (OSError, KeyError, ValueError):
        pass
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page
    except (AttributeError, ValueError, OSError) as exc:
        raise RuntimeError("device: cannot read this host's memory; pass free_bytes and total_bytes") from exc


CGROUP_ROOT = "/sys/fs/cgroup"
# (limit, usage) files: cgroup v2, then v1. v2's limit reads "max" when there is none; v1's, a huge number.
_CGROUP_FILES = (("memory.max", "memory.current"), ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"))


def _cgroup_limit() -> tuple[int, int] | None:
    """(limit, usage) bytes of the memory cgroup mounted at CGROUP_ROOT, or None without a limit. In a
    container (Docker, Kubernetes) that is the container's own; a process in a nested cgroup of a host
    is not looked up."""
    for limit_file, usage_file in _CGROUP_FILES:
        try:
            with open(os.path.join(CGROUP_ROOT, limit_file)) as f:
                limit = f.read().strip()
            with open(os.path.join(CGROUP_ROOT, usage_file)) as f:
                usage = int(f.read().strip())
            limit_bytes = None if limit == "max" else int(limit)
        except (OSError, ValueError):
            continue
        return None if limit_bytes is None or limit_bytes >= 2**62 else (limit_bytes, usage)
    return None


def _kib_field(value: str) -> int:
    amount, unit = value.split()
    if unit != "kB":
        raise ValueError(f"unexpected /proc/meminfo unit {unit!r}")
    return int(amount) * 1024


def current_device() -> torch.device:
    # check_available: a CUDA build of torch names "cuda" even on a machine without a GPU or driver.
    return torch.accelerator.current_accelerator(check_available=True) or torch.device("cpu")
