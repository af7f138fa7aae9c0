"""Where a call's time goes: one profiled call (``torch.profiler``), its time by category.

On a GPU the categories split the CUDA time of the call's kernels, and ``host gaps`` is the part of the
call's window (its host start to its last kernel's end) in which no kernel ran. On a CPU they split the
ops' own CPU time, and ``host gaps`` is the window's time outside any op (Python, dispatch). A kernel or
op belongs to the outermost op around it that names a category (the fused ops, attention, a GEMM), else
to its own name's category; a name no rule knows is ``other``. Written as profile.csv and a table in
profile.md by ``python -m fused_vision bench --profile``.
"""

import re
from collections.abc import Callable, Iterable

import torch

from .measure import synchronize
from .rows import ENVIRONMENT_COLUMNS
from .text import markdown_table

WINDOW = "fused_vision.bench.profiled_call"
# First match wins; a fused op's own kernels and ops come before the generic rules that would also match them.
RULES = (
    ("qkv_norm_rope", r"qkv_norm_rope"),
    ("residual_rms_norm", r"residual_rms_norm"),
    ("gelu_gate", r"gelu_gate"),
    ("stem", r"patch_embed|position_embeddings"),
    ("pooler", r"pool_by_positions|patch_slots"),
    ("attention", r"flash|fmha|attention|attn|sdpa|flex"),
    ("gemm", r"gemm|cutlass|xmma|cublas|nvjet|triton_tem|aten::(mm|addmm|bmm|baddbmm|linear|matmul)$"),
    (
        "copies_casts",
        r"copy|memcpy|memset|cast|fill|index|gather|scatter|nonzero|CatArray"
        r"|aten::(to|cat|stack|clone|contiguous|zeros|empty|new_zeros|split|masked_\w+)$",
    ),
    (
        "elementwise",
        r"elementwise|reduce|triton_(poi|per|red)|aten::(add|sub|mul|div|neg|pow|rsqrt|sqrt|mean|sum|gelu|tanh"
        r"|exp|clamp|clamp_|where|cos|sin|add_|mul_|sub_|div_)$",
    ),
)
CATEGORIES = (*(name for name, _ in RULES), "other", "host_gaps")
PROFILE_COLUMNS = ("op", "provider", "case", *CATEGORIES, *ENVIRONMENT_COLUMNS)
_COMPILED = tuple((name, re.compile(pattern)) for name, pattern in RULES)


def category_of(name: str) -> str | None:
    """The category a kernel's or op's name names, or None."""
    return next((category for category, pattern in _COMPILED if pattern.search(name)), None)


def _outermost_category(event) -> str | None:
    """The category of the outermost op around ``event`` (itself included) that names one."""
    found = None
    while event is not None:
        found = category_of(event.name) or found
        event = event.cpu_parent
    return found


def _union_us(intervals: Iterable[tuple[float, float]]) -> float:
    """The length of the union of (start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def breakdown(events, on_gpu: bool) -> dict[str, float]:
    """Milliseconds per category of one profiled call's ``events`` (a profiler's ``events()``), the
    categories' sum being the call's window."""
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU and not e.is_async]
    window = next(e for e in cpu if e.name == WINDOW)
    times_us = dict.fromkeys(CATEGORIES, 0.0)
    if on_gpu:
        by_id = {e.id: e for e in cpu}
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        for kernel in kernels:
            launcher = by_id.get(getattr(kernel, "linked_correlation_id", 0))
            found = _outermost_category(launcher) if launcher is not None else None
            category = found or category_of(kernel.name) or "other"
            times_us[category] += kernel.time_range.end - kernel.time_range.start
        spans = [(k.time_range.start, k.time_range.end) for k in kernels]
        end = max([window.time_range.end, *(stop for _, stop in spans)])
        times_us["host_gaps"] = end - window.time_range.start - _union_us(spans)
    else:
        inside = [e for e in cpu if e is not window and e.thread == window.thread and _within(e, window)]
        for event in inside:
            times_us[_outermost_category(event) or "other"] += event.self_cpu_time_total
        busy = sum(e.cpu_time_total for e in inside if e.cpu_parent is window)
        times_us["host_gaps"] = max(0.0, window.cpu_time_total - busy)
    return {category: us / 1e3 for category, us in times_us.items()}


def _within(event, window) -> bool:
    return window.time_range.start <= event.time_range.start and event.time_range.end <= window.time_range.end


def profile_call(call: Callable[[], object], device: torch.device) -> dict[str, float]:
    """One warm call of ``call`` under torch's profiler: its milliseconds by category (``breakdown``)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    synchronize(device)
    with torch.profiler.profile(activities=activities) as profiler:
        with torch.profiler.record_function(WINDOW):
            call()
            synchronize(device)
    return breakdown(profiler.events(), device.type == "cuda")


def profile_table(rows: list[dict]) -> list[str]:
    """A markdown table: one line per profiled call, each category's milliseconds and share of the call."""
    shown = [c for c in CATEGORIES if any(row[c] > 0 for row in rows)]
    lines = []
    for row in rows:
        total = sum(row[c] for c in CATEGORIES)
        cells = [f"{row[c]:.3g} ({100 * row[c] / total:.0f}%)" if row[c] else "" for c in shown]
        lines.append([row["op"], row["provider"], row["case"], f"{total:.3g}", *cells])
    return markdown_table(["op", "provider", "case", "ms", *shown], lines)
