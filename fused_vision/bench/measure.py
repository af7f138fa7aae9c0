"""Timing, peak memory and the device's two ceilings, each measured the same way for every provider.

On CUDA devices, ``triton.testing.do_bench``: CUDA events around every call and an L2 flush before
it, so repeated calls on one input set do not time the cache. On CPUs, the host clock around every
call, with the same warm-up and repetition budgets in milliseconds.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

QUANTILES = (0.5, 0.2, 0.8)
MIN_HOST_REPS = 3  # enough calls for the 20% and 80% quantiles to mean something


@dataclass(frozen=True)
class Budget:
    """Milliseconds spent warming up, then timing (do_bench's ``warmup`` and ``rep``)."""

    warmup_ms: float
    rep_ms: float


@dataclass(frozen=True)
class Times:
    """Quantiles of the per-call time, in ms."""

    p50: float
    p20: float
    p80: float


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], object], device: torch.device, budget: Budget) -> Times:
    if device.type == "cuda":
        from triton.testing import do_bench

        return Times(*do_bench(fn, warmup=budget.warmup_ms, rep=budget.rep_ms, quantiles=list(QUANTILES)))
    return Times(*np.quantile(_host_times_ms(fn, budget), QUANTILES).tolist())


def _host_times_ms(fn: Callable[[], object], budget: Budget) -> list[float]:
    deadline = time.perf_counter() + budget.warmup_ms / 1e3
    fn()
    while time.perf_counter() < deadline:
        fn()
    times: list[float] = []
    deadline = time.perf_counter() + budget.rep_ms / 1e3
    while len(times) < MIN_HOST_REPS or time.perf_counter() < deadline:
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def tensor_bytes(value) -> int:
    """Bytes of the tensors in a call's result (a tensor, or a tuple or list of them)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(tensor_bytes(item) for item in value)
    return 0


@dataclass(frozen=True)
class Peak:
    """One call's peak on a CUDA device beyond what was allocated before it (its inputs), its output included.

    ``allocated`` counts the caching allocator's blocks, which out-of-memory errors answer to: a large
    block it does not split holds up to 1 MiB beyond the request (a 39.4 MiB pooled output takes a
    40 MiB block). ``requested`` counts the bytes the call asked for, which the op's design decides.
    None where the allocator keeps no such count (``requested``) or none at all (a CPU's: both).
    """

    allocated: int | None
    requested: int | None


def peak_memory(fn: Callable[[], object], device: torch.device) -> tuple[Peak, object]:
    """One call's ``Peak`` and its result."""
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_stats(device)
    result = fn()
    synchronize(device)
    after = torch.cuda.memory_stats(device)
    allocated = after["allocated_bytes.all.peak"] - before.get("allocated_bytes.all.current", 0)
    requested = None
    if "requested_bytes.all.peak" in after:
        requested = after["requested_bytes.all.peak"] - before.get("requested_bytes.all.current", 0)
    return Peak(allocated, requested), result


@dataclass(frozen=True)
class Ceiling:
    """A ceiling measured in this run: a large device-to-device copy or a large matmul."""

    name: str
    case: str
    times: Times
    bytes_moved: int
    flops: int = 0

    @property
    def gbps(self) -> float:
        return self.bytes_moved / self.times.p50 / 1e6

    @property
    def tflops(self) -> float:
        return self.flops / self.times.p50 / 1e9


def copy_ceiling(device: torch.device, elements: int, budget: Budget) -> Ceiling:
    """Device copy bandwidth, counting bytes read plus bytes written, on random fp32 data far beyond L2."""
    source = torch.rand(elements, device=device)
    destination = torch.empty_like(source)
    times = time_call(lambda: destination.copy_(source), device, budget)
    size = source.numel() * source.element_size()
    return Ceiling("copy", f"{size / 2**20:g} MiB fp32", times, bytes_moved=2 * size)


def matmul_ceiling(device: torch.device, size: int, dtype: torch.dtype, budget: Budget) -> Ceiling:
    """Dense matmul rate on random data (zeros run faster than real data on tensor cores)."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    times = time_call(lambda: a @ b, device, budget)
    return Ceiling("matmul", f"{size}^3", times, bytes_moved=3 * size * size * a.element_size(), flops=2 * size**3)
