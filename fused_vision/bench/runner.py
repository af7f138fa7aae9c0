"""The driver: what runs, in which order, within what time, and what each measurement becomes.

Order: the two ceilings; every stem op's providers but ``compiled``, the headline case first (its first
calls tune the kernels' tiles for the whole run); the layer ops, in the same order; the towers; the
low-memory scenario; the encoders' providers but ``compiled``; the ``compiled`` providers last, the stem
and layer ops' then the encoders'. Compile times are the one part of the run nobody can predict, so a run past its
time budget loses compiled rows first, never the towers or the scenario; among them the embedder's at the
headline case and default width go first: the comparison the project's goals are set on.

The time budget caps the run: nothing starts that would end past it, as far as a like call's last
duration predicts, so only a first call, whose length nothing predicts, can end after it. The run ends
with a plain summary (``summary``).
"""

import signal
import time
import traceback
from collections.abc import Callable
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

import torch

from . import report
from .encoder import Mix, bench_encoder
from .measure import (
    Budget,
    Ceiling,
    Peak,
    call_peak,
    copy_ceiling,
    environment,
    matmul_ceiling,
    peak_memory,
    synchronize,
    tensor_bytes,
    time_call,
)
from .ops import Unsupported
from .plan import DEFAULT_HIDDEN, OP_BENCHES, OPS, PROVIDERS, Options, Plan
from .profile import CATEGORIES, profile_call
from .rows import SPEED, timing_row
from .summary import summary_lines
from .text import CORRECTNESS, low_memory_summary, portable, progress_summary, significant
from .tower import bench_tower, run_low_memory
from .workloads import HEADLINE_CASE, Case

COMPILED_FIRST = ("patch_embed", "position_embeddings")  # then the other ops with a compiled provider
TRITON_PROVIDERS = ("fused", "fused_kernel")  # of the stem, layer and tower ops: a CPU runs them interpreted


# do_bench's own defaults for the stem ops; a tower call takes 30-300 ms, so a second buys 3-30 timed calls.
STEM_BUDGET, TOWER_BUDGET = Budget(warmup_ms=25, rep_ms=100), Budget(warmup_ms=1, rep_ms=1000)
QUICK_STEM_BUDGET, QUICK_TOWER_BUDGET = Budget(warmup_ms=5, rep_ms=20), Budget(warmup_ms=1, rep_ms=100)


def describe(exc: BaseException | str) -> str:
    if isinstance(exc, str):
        return exc
    lines = str(exc).strip().splitlines()
    return lines[0] if isinstance(exc, Unsupported) else f"{type(exc).__name__}: {lines[0] if lines else ''}"


class Log:
    """Lines to stdout as they happen, and to ``log.txt`` without absolute paths."""

    def __init__(self, path: Path):
        self.path = path
        self.file = path.open("w")

    def __call__(self, line: str) -> None:
        print(line, flush=True)
        self.file.write(portable(line) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class Session:
    """What every measurement shares: options, ceilings, the log, progress, and the rows so far."""

    def __init__(self, options: Options, log: Log, plan: Plan):
        self.options, self.log, self.total_tasks = options, log, plan.task_count()
        self.dtype, self.dtype_name = plan.dtype, str(plan.dtype).removeprefix("torch.")
        self.started = time.monotonic()
        self.time_budget_s = plan.time_budget_s
        self.deadline = self.started + plan.time_budget_s if plan.time_budget_s else None  # time.monotonic()
        self.date = datetime.now(timezone.utc)
        self.environment = environment(options.device)
        self.stem_budget = QUICK_STEM_BUDGET if options.quick else STEM_BUDGET
        self.tower_budget = QUICK_TOWER_BUDGET if options.quick else TOWER_BUDGET
        self.rows: list[dict] = []
        self.low_memory_rows: list[dict] = []
        self.profile_rows: list[dict] = []
        self.skipped: list[dict] = []
        self.failed_sections: list[str] = []
        self.interrupted = False
        self.tasks_done = 0
        self.copy: Ceiling | None = None
        self.matmul: Ceiling | None = None

    def out_of_time(self, ahead_s: float = 0.0) -> bool:
        """Whether the time budget is spent, or would be by something starting now that takes ``ahead_s``."""
        return self.deadline is not None and time.monotonic() + ahead_s > self.deadline

    def time_budget_reason(self) -> str:
        return f"past the time budget of {self.time_budget_s:g} s (--time-budget)"

    def _progress(self, line: str) -> None:
        self.tasks_done += 1
        width = len(str(self.total_tasks))
        self.log(f"[{self.tasks_done:>{width}}/{self.total_tasks}] {line}")

    def skip(self, op: str, provider: str, case: Case | Mix, hidden: int, reason: BaseException | str) -> None:
        reason = describe(reason)
        self.skipped.append(dict(op=op, provider=provider, case=case.name, D=hidden, reason=reason))
        self._progress(f"{op:<14} {provider:<12} {case.name:<13} D={hidden:<5} skipped: {reason}")
        if self.options.device.type == "cuda":
            torch.cuda.empty_cache()  # after an out-of-memory error, hand the cached blocks back

    def run(
        self,
        op: str,
        provider: str,
        case: Case,
        hidden: int,
        setup: Callable[[], Callable[[], object]],
        *,
        budget: Budget,
        model_bytes: int = 0,
        flops: int = 0,
    ):
        """Set up, time and measure one provider at one case, and log it: the call's result, or None if skipped.

        A CPU runs a Triton provider in Triton's interpreter: its row is a correctness run, with no peak or rates.
        """
        if self.out_of_time():
            self.skip(op, provider, case, hidden, self.time_budget_reason())
            return None
        device = self.options.device
        on_cpu = device.type == "cpu"
        interpreted = on_cpu and provider in TRITON_PROVIDERS
        failure = None
        try:
            start = time.perf_counter()
            call = setup()
            call_start = time.perf_counter()
            # The first call compiles, autotunes, JITs: kept out of the timings, reported in the log. On a CPU,
            # whose allocator keeps no peak statistics, torch's profiler records the eager call's allocations.
            peak = Peak(allocated=None, requested=None)
            if on_cpu and not interpreted and provider != "compiled":
                peak, result = call_peak(call, device)
            else:
                result = call()
            synchronize(device)
            first_call_s, call_s = time.perf_counter() - start, time.perf_counter() - call_start
            if on_cpu and call_s * 1e3 >= budget.warmup_ms:  # that call was warm-up enough
                budget = Budget(warmup_ms=0, rep_ms=budget.rep_ms)
            if self.out_of_time(ahead_s=call_s):  # a timed call as long as the first would end past the budget
                failure = self.time_budget_reason()
            else:
                times = time_call(call, device, budget, deadline=self.deadline)
                if device.type == "cuda":
                    peak, result = peak_memory(call, device)
        except Exception as exc:  # an out-of-memory error, a provider this stack lacks: a logged skip, not a crash
            failure = describe(exc)
        if failure:  # skipped outside the handler, whose traceback holds the failed call's tensors
            self.skip(op, provider, case, hidden, failure)
            return None
        rates = {} if interpreted else self.rates(times.p50, model_bytes, flops)
        row = timing_row(
            op,
            provider,
            case.name,
            self.dtype_name,
            times,
            timing=CORRECTNESS if interpreted else SPEED,
            peak=peak,
            B=case.items,
            N=case.patches_per_item,
            D=hidden,
            output_bytes=tensor_bytes(result),
            model_bytes=model_bytes or None,
            **rates,
        )
        self.record(row, first_call_s)
        return result

    def profile(self, op: str, provider: str, case: Case | Mix, call: Callable[[], object]) -> None:
        """Under ``--profile``, one more call of a timed row under torch's profiler: its time by category."""
        if not self.options.profile:
            return
        if self.out_of_time():
            self.log(f"    {op} {provider} {case.name}: not profiled: {self.time_budget_reason()}")
            return
        try:
            row = dict(op=op, provider=provider, case=case.name, **profile_call(call, self.options.device))
        except Exception as exc:  # a profiler this torch lacks: the timed row stands, the log says why
            self.log(f"    {op} {provider} {case.name}: not profiled: {describe(exc)}")
            return
        self.profile_rows.append(row | self.environment)
        shares = sorted(((ms, name) for name, ms in row.items() if name in CATEGORIES and ms), reverse=True)
        total = sum(ms for ms, _ in shares)
        self.log(
            f"    {op} {provider} {case.name} profiled: "
            + ", ".join(f"{name} {100 * ms / total:.0f}%" for ms, name in shares[:4])
        )

    def rates(self, ms: float, model_bytes: int, flops: int, *, floor: bool = True) -> dict:
        """GB/s and TFLOP/s of a call of ``ms``; their shares of the ceilings, and the floor where ``floor``,
        where every ceiling they rest on is reliable."""
        rates, floors, ceilings = {}, [], []
        if model_bytes:
            rates["gbps"] = model_bytes / ms / 1e6
            floors.append(model_bytes / self.copy.gbps / 1e6)
            ceilings.append(self.copy)
            if self.copy.reliable:
                rates["pct_of_copy"] = 100 * rates["gbps"] / self.copy.gbps
        if flops:
            rates["tflops"] = flops / ms / 1e9
            floors.append(flops / self.matmul.tflops / 1e9)
            ceilings.append(self.matmul)
            if self.matmul.reliable:
                rates["pct_of_matmul"] = 100 * rates["tflops"] / self.matmul.tflops
        if floor and floors and all(ceiling.reliable for ceiling in ceilings):
            rates["floor_ms"] = max(floors)
        return rates

    def record(self, row: dict, first_call_s: float) -> None:
        self.rows.append(row | self.environment)
        self._progress(
            f"{row['op']:<14} {row['provider']:<12} {row['case']:<13} D={row['D']:<5} {progress_summary(row)}"
            f"  (first call {first_call_s:.2f} s)"
        )

    def measure_ceilings(self) -> None:
        device, tiny = self.options.device, self.options.tiny
        on_gpu = device.type == "cuda"
        copy_elements = 2**20 if tiny else 2**28 if on_gpu else 2**24  # 4 MiB, 1 GiB, 64 MiB of fp32
        matmul_size = 256 if tiny else 8192 if on_gpu else 1024
        self.log("measuring the ceilings: a device copy and a matmul")
        self.copy = copy_ceiling(device, copy_elements, self.stem_budget)
        self.matmul = matmul_ceiling(device, matmul_size, self.dtype, self.stem_budget)
        for ceiling, dtype in ((self.copy, "float32"), (self.matmul, self.dtype_name)):
            if ceiling.flops:
                rates = dict(tflops=ceiling.tflops, pct_of_matmul=100.0)
            else:
                rates = dict(model_bytes=ceiling.bytes_moved, gbps=ceiling.gbps, pct_of_copy=100.0)
            row = timing_row(ceiling.name, "torch", ceiling.case, dtype, ceiling.times, **rates)
            self.rows.append(row | self.environment)
        self.log(
            f"  copy {significant(self.copy.gbps)} GB/s (read + write, {self.copy.case}; "
            f"{report.ceiling_text(self.copy)})"
        )
        self.log(
            f"  matmul {significant(self.matmul.tflops)} TFLOP/s ({self.matmul.case}, {self.dtype_name}; "
            f"{report.ceiling_text(self.matmul)})"
        )

    def guarded(self, section: str, fn: Callable, *args) -> None:
        """Run one section of the bench; an error in it is logged with its traceback, and the others go on."""
        try:
            fn(*args)
        except Exception:
            self.failed_sections.append(section)
            self.log(f"{section}: stopped by an error, the other sections go on\n{traceback.format_exc()}")

    def record_low_memory(self, row: dict) -> None:
        self.low_memory_rows.append(row | self.environment)
        self._progress(f"{'low_memory':<14} {row['path']:<12} {row['case']:<13} {low_memory_summary(row)}")


def bench_stem(session: Session, ops: tuple[str, ...], providers: tuple[str, ...], stem_cases, hidden_sizes) -> None:
    device = session.options.device
    for name in ops:
        op = OP_BENCHES[name]
        chosen = [p for p in op.providers if p in providers]
        for hidden in hidden_sizes:
            for case in stem_cases:
                torch.manual_seed(0)
                try:
                    bench = op(case, hidden, session.dtype, device)
                except Exception as exc:
                    for provider in chosen:
                        session.skip(name, provider, case, hidden, exc)
                    continue
                for provider in chosen:
                    if provider == "compiled":
                        torch._dynamo.reset()  # a fresh compile per case: its time is the case's own
                    session.run(
                        name,
                        provider,
                        case,
                        hidden,
                        partial(bench.call, provider),
                        budget=session.stem_budget,
                        model_bytes=bench.model_bytes,
                        flops=bench.flops,
                    )
                del bench


def headline_case_first(cases):
    """The headline case first (stable: the rest keep their order): each op's first call there tunes the tiles
    that every case of the process then uses, so its times come from tiles tuned at their own case."""
    return sorted(cases, key=lambda case: case.name != HEADLINE_CASE)


def run_sections(session: Session, plan: Plan) -> None:
    """Every section in the order of the module docstring; an error stops only its own section."""
    eager = tuple(p for p in plan.providers if p != "compiled")
    stem_cases = headline_case_first(plan.stem_cases)
    session.guarded("stem ops", bench_stem, session, plan.stem_ops, eager, stem_cases, plan.hidden_sizes)
    if plan.layer_ops:
        session.guarded("layer ops", bench_stem, session, plan.layer_ops, eager, stem_cases, plan.hidden_sizes)
    for op in plan.tower_ops:
        session.guarded(op, bench_tower, session, op, plan.providers, plan.tower_cases)
    if "low_memory" in plan.ops:
        session.guarded("low_memory", run_low_memory, session)
    encoder_eager = tuple(p for p in plan.encoder_providers if p != "compiled")
    for op in plan.encoder_ops:
        session.guarded(op, bench_encoder, session, op, encoder_eager, plan.encoder_cases)
    if "compiled" in plan.providers:
        first = tuple(op for op in COMPILED_FIRST if op in plan.stem_ops)
        ops = first + tuple(op for op in plan.stem_ops + plan.layer_ops if op not in first)
        hidden_sizes = sorted(plan.hidden_sizes, key=lambda hidden: hidden != DEFAULT_HIDDEN)
        session.guarded("compiled", bench_stem, session, ops, ("compiled",), stem_cases, hidden_sizes)
    if "compiled" in plan.encoder_providers:
        for op in plan.encoder_ops:
            session.guarded(f"{op} compiled", bench_encoder, session, op, ("compiled",), plan.encoder_cases)


def run(options: Options) -> Path:
    """Run the comparison and write results.csv, low_memory.csv, results.md, time.png, memory.png and log.txt.

    A section (the stem ops, a tower, the low-memory scenario, the compiled providers) stopped by an error
    is logged with its traceback and the others still run; the reports are written, then it raises.
    Interrupted (KeyboardInterrupt: Ctrl-C, or SIGINT from a time box), it writes the reports of what it
    measured, then raises KeyboardInterrupt.
    """
    plan = Plan.of(options)
    options.out.mkdir(parents=True, exist_ok=True)
    log = Log(options.out / "log.txt")
    sigint_ignored, sigint_handler = False, None  # while the reports of an interrupted run are written
    try:
        session = Session(options, log, plan)
        cpu_start = time.process_time()
        env = session.environment
        log(
            f"fused_vision bench on {env['gpu']}: torch {env['torch']}, triton {env['triton'] or '-'}, "
            f"transformers {env['transformers'] or '-'}, fused_vision {env['fused_vision']}"
        )
        for line in plan.describe(options.device):
            log(f"  {line}")
        budget = f"time budget {plan.time_budget_s:g} s" if plan.time_budget_s else "no time budget"
        log(f"  {session.dtype_name}; {budget}; results in {options.out}")
        session.measure_ceilings()
        try:
            run_sections(session, plan)
        except KeyboardInterrupt:  # Ctrl-C, or a time box's SIGINT: keep what was measured
            sigint_handler = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second must not cut the reports
            sigint_ignored = True
            session.interrupted = True
            log("interrupted: writing the reports of what was measured so far")
        summary = summary_lines(session)
        written = report.write_all(session, options.out, PROVIDERS, OPS, tuple(OP_BENCHES), summary)
        for index, line in enumerate(summary):
            log(line if index == 0 else f"  - {line}")
        seconds, cpu_seconds = time.monotonic() - session.started, time.process_time() - cpu_start
        log(f"wrote {', '.join(written)} in {options.out} ({seconds:.0f} s; {cpu_seconds:.0f} s of CPU time)")
    finally:
        log.close()
        if sigint_ignored:  # None: a handler not set from Python, which signal.signal cannot restore
            signal.signal(signal.SIGINT, signal.default_int_handler if sigint_handler is None else sigint_handler)
    if session.interrupted:
        raise KeyboardInterrupt(f"bench interrupted; what it measured is written in {options.out}")
    if session.failed_sections:
        raise RuntimeError(
            f"bench sections stopped by errors: {', '.join(session.failed_sections)} (tracebacks in {log.path}); "
            "the other sections' results are written"
        )
    return options.out
