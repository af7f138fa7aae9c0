"""time.png and memory.png: each provider's median time and peak per case, a panel per op and width.

Dots, not bars: on a log axis a bar's length depends on where the axis starts, so it would show no ratio
truthfully; dots are read against each other, and each fused_vision provider's dot is labelled with its
ratio to the op's stock baseline at that case, as measured in this run. Rows of Triton's interpreter
(correctness runs) are left out. Each figure names the device, dtype and versions.
"""

import math
from collections import defaultdict
from pathlib import Path

from .text import FUSED_VISION_PROVIDERS, baseline_of, compare, format_bytes, significant, speed_rows

PROVIDER_COLORS = {
    "onehot": "tab:red",
    "embedding": "tab:blue",
    "compiled": "tab:purple",
    "reference": "tab:brown",
    "fused": "tab:green",
    "fused_kernel": "tab:olive",
    "separate": "black",  # the ten tab colours are taken
    "stock": "tab:gray",
    "padded": "tab:orange",
    "packed": "tab:cyan",
    "graphed": "tab:pink",
}
# (column, file, what the figure shows, how a ratio to the baseline reads)
METRICS = (
    ("ms_p50", "time.png", "Median time per call, 20-80 % whiskers", "faster"),
    ("peak_bytes", "memory.png", "Peak memory beyond the inputs, output included", "smaller"),
)


def _title(session, shown: str) -> str:
    env = session.environment
    versions = ", ".join(f"{name} {value or '-'}" for name, value in env.items() if name != "gpu")
    return f"{shown} · fused_vision bench · {env['gpu']} · {session.dtype_name}\n{versions}"


def _whole_decades(axis) -> None:
    """Stretch a log axis to whole decades, so that at least two labelled ticks show."""
    low, high = axis.get_ylim()
    axis.set_ylim(10 ** math.floor(math.log10(low)), 10 ** math.ceil(math.log10(high)))


def plot(session, rows: list[dict], providers: tuple[str, ...], out: Path) -> list[str]:
    """Write time.png and memory.png where rows have the metric; returns the names written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, NullFormatter
    except ImportError:
        session.log("plots skipped: matplotlib is not installed (pip install matplotlib)")
        return []
    panels: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for row in speed_rows(rows):
        if row.get("D") is not None:  # the ceilings have no case of their own
            panels[row["op"], row["D"]].append(row)
    written = []
    tick_labels = {
        "ms_p50": lambda value, _: f"{significant(value)} ms",
        "peak_bytes": lambda value, _: format_bytes(value),
    }
    for metric, filename, shown, better in METRICS:
        chosen = {key: group for key, group in panels.items() if any(r.get(metric) for r in group)}
        if not chosen:
            continue
        columns, rows_of_panels = min(3, len(chosen)), math.ceil(len(chosen) / 3)
        figure, axes = plt.subplots(rows_of_panels, columns, figsize=(5.5 * columns, 4 * rows_of_panels), squeeze=False)
        handles = {}
        for axis, ((op, hidden), group) in zip(axes.flat, chosen.items()):
            handles |= _panel(axis, op, hidden, group, providers, metric, better)
            axis.set_yscale("log")
            _whole_decades(axis)
            axis.set_ylabel("log scale")
            axis.yaxis.set_major_formatter(FuncFormatter(tick_labels[metric]))
            axis.yaxis.set_minor_formatter(NullFormatter())
        for axis in axes.flat[len(chosen) :]:
            axis.set_visible(False)
        figure.suptitle(_title(session, shown), fontsize=9)
        figure.legend(handles.values(), handles.keys(), loc="lower center", ncol=min(len(handles), 6))
        figure.tight_layout(rect=(0, 0.07, 1, 0.93))
        figure.savefig(out / filename, dpi=110)
        plt.close(figure)
        written.append(filename)
    return written


def _panel(axis, op: str, hidden: int, group: list[dict], providers, metric: str, better: str) -> dict:
    """One op's dots per case and provider, p20-p80 whiskers for times, floors dashed; the legend's handles."""
    case_names = list(dict.fromkeys(r["case"] for r in group))
    present = [p for p in providers if any(r["provider"] == p and r.get(metric) for r in group)]
    baseline = baseline_of(present)
    step = 0.8 / len(present)
    handles = {}
    for index, provider in enumerate(present):
        offset = (index - (len(present) - 1) / 2) * step
        for i, case in enumerate(case_names):
            row = next((r for r in group if r["case"] == case and r["provider"] == provider and r.get(metric)), None)
            if row is None:
                continue
            x, value = i + offset, row[metric]
            whiskers = None
            if metric == "ms_p50":
                whiskers = [[value - row["ms_p20"]], [row["ms_p80"] - value]]
            handles[provider] = axis.errorbar(
                x, value, yerr=whiskers, fmt="o", color=PROVIDER_COLORS[provider], capsize=3
            )
            base = next((r for r in group if r["case"] == case and r["provider"] == baseline), None)
            if provider in FUSED_VISION_PROVIDERS and base is not None and base.get(metric):
                axis.annotate(
                    compare(value, base[metric], better),
                    (x, value),
                    textcoords="offset points",
                    xytext=(4, 4),
                    fontsize=7,
                )
    if metric == "ms_p50":
        for i, case in enumerate(case_names):
            floor = next((r["floor_ms"] for r in group if r["case"] == case and r.get("floor_ms")), None)
            if floor:
                handles["floor"] = axis.hlines(floor, i - 0.45, i + 0.45, colors="black", linestyles="--")
    axis.set_xticks(range(len(case_names)), case_names, rotation=15)
    axis.set_xlim(-0.6, len(case_names) - 0.4)
    axis.set_title(f"{op} · D={hidden}" + (f" · ratios to {baseline}" if baseline else ""), fontsize=9)
    axis.grid(axis="y", which="both", alpha=0.3)
    return handles
