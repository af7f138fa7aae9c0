"""Timing, peak memory and the device's two ceilings, each measured the same way for every provider.

On CUDA devices, ``triton.testing.do_bench``: CUDA events around every call and an L2 flush before
it, so repeated calls on one input set do not time the cache. On CPUs, the host clock around every
call, with the same warm-up and repetition budgets in milliseconds. Calls that take 10s of ms and more
(whole encoders) can instead be timed in interleaved rounds, on the host clock around a synchronized call.
"""

import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

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
    return _quantiles(_host_times_ms(fn, budget))


def _quantiles(times_ms: list[float]) -> Times:
    return Times(*np.quantile(times_ms, QUANTILES).tolist())


def interleaved_times(calls: dict[str, Callable[[], object]], device: torch.device, reps: int) -> dict[str, Times]:
    """``reps`` rounds, each calling every one of ``calls`` once in turn: a load that drifts during the rounds
    (other processes, clocks, heat) reaches them all alike, as it would not reach calls timed one after another."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(reps):
        for name, fn in calls.items():
            synchronize(device)
            start = time.perf_counter()
            fn()
            synchronize(device)
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: _quantiles(ms) for name, ms in times.items()}


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
    """One call's peak beyond what was allocated before it (its inputs), its output included.

    On a CUDA device, ``allocated`` counts the caching allocator's blocks, which out-of-memory errors
    answer to: a large block it does not split holds up to 1 MiB beyond the request (a 39.4 MiB pooled
    output takes a 40 MiB block). ``requested`` counts the bytes the call asked for, which the op's design
    decides. None where the allocator keeps no such count (``requested``) or none at all (a CPU's: both,
    but where ``call_peak`` tracks the live tensors: ``allocated``).
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


class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of tensor storage created by the ops run under this mode and still alive.

    Storages that exist beforehand (weights, inputs) and views of them are not counted. Scratch
    memory inside a single aten kernel is invisible; run under torch.no_grad rather than
    inference_mode so composite ops (sdpa, matmul, softmax with dtype) decompose and their
    temporaries are seen.
    """

    def __init__(self, existing: list[torch.Tensor]):
        super().__init__()
        self._existing = {t.untyped_storage().data_ptr() for t in existing}
        self._alive: set[int] = set()
        self.live = 0
        self.peak = 0

    def _freed(self, key: int, nbytes: int) -> None:
        self._alive.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key in self._existing or key in self._alive or storage.nbytes() == 0:
                continue
            self._alive.add(key)
            self.live += storage.nbytes()
            weakref.finalize(storage, self._freed, key, storage.nbytes())
        self.peak = max(self.peak, self.live)
        return out


def call_peak(fn: Callable[[], object], device: torch.device, existing: list[torch.Tensor]) -> tuple[Peak, object]:
    """One call's ``Peak`` and its result: ``peak_memory`` on CUDA; elsewhere the live tensors it creates
    beyond ``existing`` (``LiveTensorBytes``, under torch.no_grad), ``requested`` None."""
    if device.type == "cuda":
        return peak_memory(fn, device)
    with torch.no_grad(), LiveTensorBytes(existing) as tracker:
        result = fn()
    return Peak(allocated=tracker.peak, requested=None), result


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
