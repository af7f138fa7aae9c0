"""The plain summary a run ends with, from its own rows: what fused_vision did faster or in less memory than
stock and by how much, the planner's chunks for the low-memory scenario, and what the run did not measure.

Every number is this run's: medians of its calls, and ratios between medians of the same run. Rows of
Triton's interpreter (a CPU's fused providers) are correctness runs and never compared.
"""

from .encoder import ENCODER_TOWERS, layer_note
from .text import compare, format_bytes, format_ms, speed_rows

STEM_OPS = ("position_embeddings", "patch_embed", "pool_by_positions")  # the stem as inference runs it
FUSED_VISION_FIRST = ("fused", "fused_kernel", "reference")  # the stem's fused_vision row, in order of preference
STOCK_NAMES = {"onehot": "the one-hot (transformers 5.5-5.9)", "embedding": "F.embedding (transformers 5.10+)"}
# What a CPU cannot measure, and where a GPU run puts it.
NOT_ON_A_CPU = (
    "not measured on a CPU: the Triton kernels' speed (a CPU runs them only in Triton's interpreter), "
    "torch.compile's providers, peaks in CUDA's caching allocator and the low-memory scenario's runs on an "
    "emulated card. `python -m fused_vision bench` on a CUDA GPU measures them into the same files; the "
    "H200's are to be committed to fused_vision's repository under bench/results/h200/."
)


def _largest_case(by_case: dict[str, dict[str, dict]], provider: str, baseline: str) -> dict[str, dict] | None:
    """The case with the most patches where both ran (the first in run order among equals)."""
    both = [group for group in by_case.values() if provider in group and baseline in group]
    return max(both, key=lambda group: group[baseline]["B"] * group[baseline]["N"], default=None)


def stem_lines(rows: list[dict]) -> list[str]:
    lines = []
    for op in STEM_OPS:
        by_case: dict[str, dict[str, dict]] = {}
        for row in rows:
            if row["op"] == op:
                by_case.setdefault(f"{row['case']} D={row['D']} {row['dtype']}", {})[row["provider"]] = row
        ours_name = next((p for p in FUSED_VISION_FIRST if any(p in group for group in by_case.values())), None)
        group = _largest_case(by_case, ours_name, "onehot") if ours_name else None
        if group is None:
            continue
        ours = group[ours_name]
        speed = [
            f"{compare(ours['ms_p50'], group[name]['ms_p50'], 'faster')} than {STOCK_NAMES[name]} "
            f"({format_ms(group[name]['ms_p50'])})"
            for name in STOCK_NAMES
            if name in group
        ]
        line = f"{op} at {ours['case']}, D={ours['D']}: fused_vision ({ours_name}) {format_ms(ours['ms_p50'])}, "
        line += ", ".join(speed)
        if ours.get("peak_bytes") and group["onehot"].get("peak_bytes"):
            theirs = group["onehot"]["peak_bytes"]
            memory = compare(ours["peak_bytes"], theirs, "smaller")
            line += f"; peak {format_bytes(ours['peak_bytes'])}, {memory} than the one-hot's {format_bytes(theirs)}"
        lines.append(line)
    return lines


def encoder_lines(rows: list[dict], tiny: bool) -> list[str]:
    lines = []
    for op in ENCODER_TOWERS:
        mixes: dict[str, dict[str, dict]] = {}
        for row in rows:
            if row["op"] == op:
                mixes.setdefault(row["case"], {})[row["provider"]] = row
        for mix, group in mixes.items():
            stock = group.get("stock")
            if stock is None:
                continue
            parts = []
            for name in ("packed", "fused", "graphed"):
                if name in group:
                    row = group[name]
                    part = f"{name} {compare(row['ms_p50'], stock['ms_p50'], 'faster')}"
                    if row.get("peak_bytes") and stock.get("peak_bytes"):
                        part += f", peak {compare(row['peak_bytes'], stock['peak_bytes'], 'smaller')}"
                    parts.append(part)
            if parts:
                where = f"{op} at {mix}, {layer_note(op, stock['layers'], tiny)}, against stock's padded forward"
                lines.append(f"{where}: {'; '.join(parts)}")
    return lines


def planner_lines(low_memory_rows: list[dict]) -> list[str]:
    """vLLM's chunk against the planner's, per workload of the scenario, and whether they ran."""
    chunks: dict[str, dict[str, dict]] = {}
    for row in low_memory_rows:
        chunks.setdefault(row["workload"], {})[row["path"]] = row
    parts = [
        f"{workload}: vLLM's chunk {paths['onehot']['chunk']}, the planner's {paths['fused']['chunk']}"
        for workload, paths in chunks.items()
        if {"onehot", "fused"} <= set(paths)
    ]
    if not parts:
        return []
    first = low_memory_rows[0]
    card = f"{first['free_bytes'] / 2**30:.3g} GiB free of {first['emulated_total_bytes'] / 2**30:.0f} GiB"
    statuses = {row["status"] for row in low_memory_rows}
    how = "run on the emulated card, each ok" if statuses == {"ok"} else "; ".join(sorted(statuses))
    return [f"low-memory scenario (26B/31B tower, bf16, {card}), items per call: {'; '.join(parts)} ({how})"]


def not_measured_lines(session) -> list[str]:
    lines = [NOT_ON_A_CPU] if session.options.device.type == "cpu" else []
    if session.skipped:
        late = sum("past the time budget" in entry["reason"] for entry in session.skipped)
        within = f", {late} of them past the time budget" if late else ""
        lines.append(f"skipped: {len(session.skipped)} measurements{within}; results.md lists each and why")
    return lines


def summary_lines(session) -> list[str]:
    """The summary's lines, the first saying what the numbers are."""
    rows = speed_rows(session.rows)
    head = (
        f"summary: {session.environment['gpu']}, {session.dtype_name}; one run: medians of its calls and "
        "ratios between them (another load on the machine moves them)"
    )
    body = stem_lines(rows) + encoder_lines(rows, session.options.tiny) + planner_lines(session.low_memory_rows)
    return [head, *body, *not_measured_lines(session)]
