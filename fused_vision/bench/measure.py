"""Timing, peak memory and the device's two ceilings, each measured the same way for every provider.

On CUDA devices, ``triton.testing.do_bench``: CUDA events around every call and an L2 flush before
it, so repeated calls on one input set do not time the cache. On CPUs, the host clock around every
call, with the same warm-up and repetition budgets in milliseconds. Calls that take 10s of ms and more
(whole encoders) can instead be timed in interleaved rounds, on the host clock around a synchronized call.
Host-clock repetitions stop before a ``deadline`` (the run's time budget): the next call must be
predicted, from the last one, to end before it; at least one call is timed.
"""

import contextlib
import gc
import os
import platform
import sys
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import fused_vision

QUANTILES = (0.5, 0.2, 0.8)
MIN_HOST_REPS = 3  # enough calls for the 20% and 80% quantiles to mean something
# A ceiling is reliable, and floors and shares of it are shown, when its median comes from this many calls
# whose 20 % to 80 % spread is within this fraction of the median.
RELIABLE_CEILING_REPS, RELIABLE_CEILING_SPREAD = 10, 0.1


@dataclass(frozen=True)
class Budget:
    """Milliseconds spent warming up, then timing (do_bench's ``warmup`` and ``rep``)."""

    warmup_ms: float
    rep_ms: float


@dataclass(frozen=True)
class Times:
    """Quantiles of the per-call time, in ms, over ``reps`` timed calls."""

    p50: float
    p20: float
    p80: float
    reps: int

    @property
    def spread(self) -> float:
        """The 20 % to 80 % range as a fraction of the median."""
        return (self.p80 - self.p20) / self.p50


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(
    fn: Callable[[], object],
    device: torch.device,
    budget: Budget,
    *,
    deadline: float | None = None,
    min_reps: int = MIN_HOST_REPS,
) -> Times:
    """``fn``'s times: do_bench's on CUDA (bounded by ``budget``); on a CPU, the host clock's, at least
    ``min_reps`` calls unless ``deadline`` (``time.monotonic()``) comes first."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return _quantiles(do_bench(fn, warmup=budget.warmup_ms, rep=budget.rep_ms, return_mode="all"))
    return _quantiles(_host_times_ms(fn, budget, deadline, min_reps))


def _quantiles(times_ms: list[float]) -> Times:
    return Times(*np.quantile(times_ms, QUANTILES).tolist(), reps=len(times_ms))


def _fits(last_s: float, deadline: float | None) -> bool:
    """Whether one more call, as long as the last, ends before ``deadline``."""
    return deadline is None or time.monotonic() + last_s < deadline


def interleaved_times(
    calls: dict[str, Callable[[], object]], device: torch.device, reps: int, deadline: float | None = None
) -> dict[str, Times]:
    """Up to ``reps`` rounds, each calling every one of ``calls`` once in turn: a load that drifts during the rounds
    (other processes, clocks, heat) reaches them all alike, as it would not reach calls timed one after another.
    A round starts only if one as long as the last ends before ``deadline``; the first always runs."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    round_s = 0.0
    for _ in range(reps):
        if round_s and not _fits(round_s, deadline):
            break
        round_start = time.perf_counter()
        for name, fn in calls.items():
            synchronize(device)
            start = time.perf_counter()
            fn()
            synchronize(device)
            times[name].append((time.perf_counter() - start) * 1e3)
        round_s = time.perf_counter() - round_start
    return {name: _quantiles(ms) for name, ms in times.items()}


def _host_times_ms(fn: Callable[[], object], budget: Budget, deadline: float | None, min_reps: int) -> list[float]:
    """Warm-up calls for ``budget.warmup_ms`` (none at 0), then timed calls for ``budget.rep_ms`` and at least
    ``min_reps``, each started only if predicted to end before ``deadline``; at least one is timed."""
    last_s = 0.0
    warmup_end = time.perf_counter() + budget.warmup_ms / 1e3
    while time.perf_counter() < warmup_end and _fits(last_s, deadline):
        start = time.perf_counter()
        fn()
        last_s = time.perf_counter() - start
    times: list[float] = []
    rep_end = time.perf_counter() + budget.rep_ms / 1e3
    while not times or (len(times) < min_reps or time.perf_counter() < rep_end) and _fits(last_s, deadline):
        start = time.perf_counter()
        fn()
        last_s = time.perf_counter() - start
        times.append(last_s * 1e3)
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
    decides. On a CPU (``cpu_allocator_peak``), ``allocated`` counts the bytes the call's blocks held at once
    and ``requested`` is None.
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
    memory inside a single aten kernel is invisible, and so is everything inside a registered custom
    op (fused_vision's ops run as one); run under torch.no_grad rather than inference_mode so composite
    ops (sdpa, matmul, softmax with dtype) decompose and their temporaries are seen.
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


def call_peak(fn: Callable[[], object], device: torch.device) -> tuple[Peak, object]:
    """One call's ``Peak`` and its result: ``peak_memory`` on CUDA, ``cpu_allocator_peak`` on a CPU."""
    if device.type == "cuda":
        return peak_memory(fn, device)
    return cpu_allocator_peak(fn)


@contextlib.contextmanager
def _native_stderr_silenced():
    """Send the process's stderr (fd 2) to the null device: kineto logs each profiler start and stop there."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def cpu_allocator_peak(fn: Callable[[], object]) -> tuple[Peak, object]:
    """One call's ``Peak`` on a CPU, and its result: the most bytes that blocks of the CPU allocator which the
    call allocated held at once, from torch's profiler's record of every allocation and free (scratch inside
    kernels and custom ops included; memory a library allocates on its own, as MKL's may, is not seen).
    Blocks allocated before the call (inputs, weights) are not counted, their frees neither."""
    from torch.profiler import ProfilerActivity, profile

    profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    gc.collect()  # garbage of earlier calls freed now, not during the call (the profiler warns of such frees)
    with _native_stderr_silenced():
        profiler.start()
    try:
        result = fn()
    finally:
        with _native_stderr_silenced():
            profiler.stop()
    events, pending = [], list(profiler.profiler.kineto_results.experimental_event_tree())
    while pending:
        event = pending.pop()
        pending.extend(event.children)
        fields = event.extra_fields
        if isinstance(fields, torch._C._profiler._ExtraFields_Allocation) and fields.device.type == "cpu":
            events.append((event.start_time_ns, fields.alloc_size, fields.ptr))
    held, live, peak = {}, 0, 0
    for _, size, ptr in sorted(events):  # a free before an allocation of the same instant
        if size > 0:
            held[ptr] = size
            live += size
        elif ptr in held:
            live -= held.pop(ptr)
        peak = max(peak, live)
    return Peak(allocated=peak, requested=None), result


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

    @property
    def reliable(self) -> bool:
        """Enough calls, close enough together, for a floor or a share of this ceiling to mean something."""
        return self.times.reps >= RELIABLE_CEILING_REPS and self.times.spread <= RELIABLE_CEILING_SPREAD


def copy_ceiling(device: torch.device, elements: int, budget: Budget) -> Ceiling:
    """Device copy bandwidth, counting bytes read plus bytes written, on random fp32 data far beyond L2."""
    source = torch.rand(elements, device=device)
    destination = torch.empty_like(source)
    times = time_call(lambda: destination.copy_(source), device, budget, min_reps=RELIABLE_CEILING_REPS)
    size = source.numel() * source.element_size()
    return Ceiling("copy", f"{size / 2**20:g} MiB fp32", times, bytes_moved=2 * size)


def matmul_ceiling(device: torch.device, size: int, dtype: torch.dtype, budget: Budget) -> Ceiling:
    """Dense matmul rate on random data (zeros run faster than real data on tensor cores)."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    times = time_call(lambda: a @ b, device, budget, min_reps=RELIABLE_CEILING_REPS)
    return Ceiling("matmul", f"{size}^3", times, bytes_moved=3 * size * size * a.element_size(), flops=2 * size**3)


def environment(device: torch.device) -> dict[str, str]:
    """What every row records of the run: the device and the versions that ran it."""

    def installed(package: str) -> str:
        try:
            return version(package)
        except PackageNotFoundError:
            return ""

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"{device.type} {platform.machine()} ({torch.get_num_threads()} threads)"
    return dict(
        gpu=name,
        torch=torch.__version__,
        triton=installed("triton"),
        transformers=installed("transformers"),
        fused_vision=fused_vision.__version__,
    )
