"""A run's rows: results.csv's and low_memory.csv's columns, the one builder of a timing row, and both files
written and read back (docs/benchmark.md, "Output")."""

import csv
from pathlib import Path

from .measure import Peak, Times

ENVIRONMENT_COLUMNS = ("gpu", "torch", "triton", "transformers", "fused_vision")
COLUMNS = (
    "op", "provider", "case", "B", "N", "D", "dtype",
    "ms_p50", "ms_p20", "ms_p80", "reps", "timing",
    "peak_bytes", "peak_requested_bytes", "output_bytes",
    "model_bytes", "gbps", "pct_of_copy", "tflops", "pct_of_matmul", "floor_ms",
    "items_per_s", "real_patches", "layers", "attention",
    *ENVIRONMENT_COLUMNS,
)  # fmt: skip
LOW_MEMORY_COLUMNS = (
    "workload", "case", "path", "chunk", "calls", "items", "seconds", "items_per_s", "peak_bytes", "status",
    "emulated_total_bytes", "free_bytes",
    *ENVIRONMENT_COLUMNS,
)  # fmt: skip
TEXT_COLUMNS = frozenset(("op", "provider", "case", "dtype", "timing", "attention", "workload", "path", "status"))
SPEED = "speed"  # a row's timing, but for Triton's interpreter's rows (``text.CORRECTNESS``)


def timing_row(
    op: str,
    provider: str,
    case: str,
    dtype: str,
    times: Times,
    *,
    timing: str = SPEED,
    peak: Peak | None = None,
    **columns,
) -> dict:
    """A results.csv row: ``times``' quantiles, ``peak``'s two counts and any other of ``COLUMNS``."""
    unknown = columns.keys() - set(COLUMNS)
    if unknown:
        raise TypeError(f"not a results.csv column: {', '.join(sorted(unknown))}")
    row = dict(op=op, provider=provider, case=case, dtype=dtype, timing=timing)
    row |= dict(ms_p50=times.p50, ms_p20=times.p20, ms_p80=times.p80, reps=times.reps)
    if peak is not None:
        row |= dict(peak_bytes=peak.allocated, peak_requested_bytes=peak.requested)
    return row | columns


def write_csv(path: Path, columns: tuple[str, ...], rows: list[dict]) -> None:
    """``rows`` under ``columns``; never called without rows (no file is better than an empty one)."""

    def cell(value) -> str:
        if value is None:
            return ""
        return f"{value:.6g}" if isinstance(value, float) else str(value)

    with path.open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(columns)
        writer.writerows([cell(row.get(column)) for column in columns] for row in rows)


def read_csv(path: Path) -> list[dict]:
    """``write_csv``'s rows back: text as written, a number an int or a float, an empty number None."""

    def value(column: str, cell: str):
        if column in TEXT_COLUMNS or column in ENVIRONMENT_COLUMNS:
            return cell
        if not cell:
            return None
        return int(cell) if cell.lstrip("-").isdigit() else float(cell)

    with path.open(newline="") as file:
        return [{column: value(column, cell) for column, cell in row.items()} for row in csv.DictReader(file)]
