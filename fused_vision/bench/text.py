"""How a run's numbers and rows read: units, shares of a ceiling, the interpreter's label, portable paths."""

import math
import os
import re
import sysconfig

BASELINES = ("onehot", "stock")  # an op's stock code: the one-hot where it has one, else its eager code
FUSED_VISION_PROVIDERS = ("reference", "fused", "fused_kernel", "padded", "packed", "graphed")
CORRECTNESS = "correctness"  # a row's timing in Triton's interpreter: the kernels ran, at no meaningful speed
ABOVE_CEILING = "†"
ABOVE_CEILING_NOTE = (
    f"{ABOVE_CEILING} above 100 %: faster than this run's ceiling (a working set in cache, or a ceiling measured low)."
)


def speed_rows(rows: list[dict]) -> list[dict]:
    """The rows whose times are a speed: all but Triton's interpreter's."""
    return [row for row in rows if row.get("timing") != CORRECTNESS]


def baseline_of(providers) -> str | None:
    return next((p for p in BASELINES if p in providers), None)


# An absolute path: a slash after the start, a space, a quote, a bracket or "=", then one or more segments.
_ABSOLUTE_PATH = re.compile(r"(?<![^\s'\"(\[=])/[^\s'\":,()\[\]]+")


def portable(text: str) -> str:
    """``text`` with no absolute path: one under the working folder made relative to it, one in the
    interpreter's site-packages made relative to that, any other cut to its last part ("…/name")."""
    roots = [(sysconfig.get_path(name), "site-packages") for name in ("purelib", "platlib")]
    # The longest root first: a venv inside the working folder still reads "site-packages/…".
    roots = sorted([*roots, (os.getcwd(), None)], key=lambda root: len(root[0]), reverse=True)

    def shorten(match: re.Match) -> str:
        path = match.group(0)
        for root, name in roots:
            if path == root or path.startswith(root.rstrip("/") + "/"):
                return os.path.relpath(path, root) if name is None else f"{name}/{os.path.relpath(path, root)}"
        return "…/" + (path.rstrip("/").rsplit("/", 1)[-1] or "")

    return _ABSOLUTE_PATH.sub(shorten, text)


def significant(value: float, digits: int = 3) -> str:
    """``value`` to ``digits`` significant digits in fixed point: 0.0421, 5.95, 138, 4,253."""
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(value))))
    return f"{value:,.{decimals}f}"


OPPOSITES = {"faster": "slower", "smaller": "larger"}


def compare(value: float, baseline: float, better: str) -> str:
    """How ``value`` compares with ``baseline`` where less is ``better``: "42× faster", "1.03× slower"."""
    ratio = baseline / value if baseline >= value else value / baseline
    word = better if baseline >= value else OPPOSITES[better]
    return f"{significant(ratio, 2 if ratio >= 10 else 3)}× {word}"


def format_ms(ms: float) -> str:
    return f"{significant(ms)} ms"


def format_bytes(count: float) -> str:
    """Decimal units, as the baselines' tables: 3.94 GB, 133 MB."""
    for unit in ("B", "kB", "MB", "GB"):
        if abs(count) < 999.5:
            return f"{significant(count)} {unit}"
        count /= 1000
    return f"{significant(count)} TB"


def format_pct(pct: float) -> str:
    """A share of a ceiling, flagged above 100 %."""
    return f"{significant(pct, 2)}%" + (ABOVE_CEILING if pct > 100 else "")


def markdown_table(header: list[str], body: list[list[str]]) -> list[str]:
    """A markdown table, text left-aligned in the first column, numbers right-aligned in the others."""
    lines = ["| " + " | ".join(header) + " |", "|---|" + "--:|" * (len(header) - 1)]
    return lines + ["| " + " | ".join(cells) + " |" for cells in body] + [""]


def progress_summary(row: dict) -> str:
    parts = [f"{format_ms(row['ms_p50'])} [{significant(row['ms_p20'])}, {significant(row['ms_p80'])}]"]
    if row.get("timing") == CORRECTNESS:
        return f"{parts[0]}  Triton interpreter: a correctness run, its time no speed"
    if row.get("reps") is not None:
        parts.append(f"{row['reps']} call{'s' if row['reps'] != 1 else ''}")
    if row.get("items_per_s") is not None:
        parts.append(f"{significant(row['items_per_s'])} items/s")
    if row.get("peak_bytes") is not None:
        parts.append(f"peak {format_bytes(row['peak_bytes'])}")
    if row.get("gbps") is not None:
        share = f" = {format_pct(row['pct_of_copy'])} of copy" if row.get("pct_of_copy") is not None else ""
        parts.append(f"{significant(row['gbps'])} GB/s{share}")
    if row.get("tflops") is not None:
        share = f" = {format_pct(row['pct_of_matmul'])} of matmul" if row.get("pct_of_matmul") is not None else ""
        parts.append(f"{significant(row['tflops'])} TFLOP/s{share}")
    return "  ".join(parts)


def low_memory_summary(row: dict) -> str:
    head = f"{row['items']} items, {row['chunk']} per call, {row['calls']} calls: "
    if row["status"] != "ok":
        return head + row["status"]
    rate, seconds, peak = significant(row["items_per_s"]), significant(row["seconds"]), format_bytes(row["peak_bytes"])
    return head + f"{rate} items/s, {seconds} s, peak {peak}"
