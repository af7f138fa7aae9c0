"""What a run writes: results.csv, low_memory.csv, results.md, and the time and memory plots."""

import csv
import math
from collections import defaultdict
from pathlib import Path

from .encoder import ENCODER_PROVIDERS, ENCODER_TOWERS, layer_note
from .layer_ops import LAYER_OPS
from .measure import Ceiling
from .targets import (
    ENCODER_TARGETS,
    GOALS,
    LAYER_OP_TARGETS,
    TARGET_CASE,
    TARGET_DTYPE,
    TARGET_HIDDEN,
    Verdict,
    verdicts,
)

ENVIRONMENT_COLUMNS = ("gpu", "torch", "triton", "transformers", "fused_vision")
COLUMNS = (
    "op", "provider", "case", "B", "N", "D", "dtype",
    "ms_p50", "ms_p20", "ms_p80",
    "peak_bytes", "peak_requested_bytes", "output_bytes",
    "model_bytes", "gbps", "pct_of_copy", "tflops", "pct_of_matmul", "floor_ms",
    "items_per_s", "real_patches", "layers",
    *ENVIRONMENT_COLUMNS,
)  # fmt: skip
LOW_MEMORY_COLUMNS = (
    "workload", "case", "path", "chunk", "calls", "items", "seconds", "items_per_s", "peak_bytes", "status",
    "emulated_total_bytes", "free_bytes",
    *ENVIRONMENT_COLUMNS,
)  # fmt: skip
CEILING_OPS = ("copy", "matmul")
PROVIDER_COLORS = {
    "onehot": "tab:red",
    "embedding": "tab:blue",
    "compiled": "tab:purple",
    "fused": "tab:green",
    "fused_kernel": "tab:olive",
    "stock": "tab:gray",
    "padded": "tab:orange",
    "packed": "tab:cyan",
}


def significant(value: float, digits: int = 3) -> str:
    """``value`` to ``digits`` significant digits in fixed point: 0.0421, 5.95, 138, 4,253."""
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(value))))
    return f"{value:,.{decimals}f}"


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
    return f"{significant(pct, 2)}%"


def progress_summary(row: dict) -> str:
    parts = [f"{format_ms(row['ms_p50'])} [{significant(row['ms_p20'])}, {significant(row['ms_p80'])}]"]
    if row.get("items_per_s") is not None:
        parts.append(f"{significant(row['items_per_s'])} items/s")
    if row.get("peak_bytes") is not None:
        parts.append(f"peak {format_bytes(row['peak_bytes'])}")
    if row.get("pct_of_copy") is not None:
        parts.append(f"{significant(row['gbps'])} GB/s = {format_pct(row['pct_of_copy'])} of copy")
    if row.get("pct_of_matmul") is not None:
        parts.append(f"{significant(row['tflops'])} TFLOP/s = {format_pct(row['pct_of_matmul'])} of matmul")
    return "  ".join(parts)


def low_memory_summary(row: dict) -> str:
    head = f"{row['items']} items, {row['chunk']} per call, {row['calls']} calls: "
    if row["status"] != "ok":
        return head + row["status"]
    rate, seconds, peak = significant(row["items_per_s"]), significant(row["seconds"]), format_bytes(row["peak_bytes"])
    return head + f"{rate} items/s, {seconds} s, peak {peak}"


def ceiling_row(ceiling: Ceiling, dtype: str) -> dict:
    row = dict(
        op=ceiling.name,
        provider="torch",
        case=ceiling.case,
        dtype=dtype,
        ms_p50=ceiling.times.p50,
        ms_p20=ceiling.times.p20,
        ms_p80=ceiling.times.p80,
    )
    if ceiling.flops:
        return row | dict(tflops=ceiling.tflops, pct_of_matmul=100.0)
    return row | dict(model_bytes=ceiling.bytes_moved, gbps=ceiling.gbps, pct_of_copy=100.0)


def sorted_rows(rows: list[dict], ops: tuple[str, ...], providers: tuple[str, ...]) -> list[dict]:
    """Ceilings first, then the ops in ``ops`` order, each by width, case (in run order) and provider."""
    op_order = {op: index for index, op in enumerate((*CEILING_OPS, *ops))}
    case_order = {case: index for index, case in enumerate(dict.fromkeys(row["case"] for row in rows))}
    provider_order = {provider: index for index, provider in enumerate(providers)}

    def key(row: dict) -> tuple:
        return op_order[row["op"]], row.get("D") or 0, case_order[row["case"]], provider_order.get(row["provider"], -1)

    return sorted(rows, key=key)


def write_csv(path: Path, columns: tuple[str, ...], rows: list[dict]) -> None:
    def cell(value) -> str:
        if value is None:
            return ""
        return f"{value:.6g}" if isinstance(value, float) else str(value)

    with path.open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(columns)
        writer.writerows([cell(row.get(column)) for column in columns] for row in rows)


def _table(header: list[str], body: list[list[str]]) -> list[str]:
    """A markdown table, text left-aligned in the first column, numbers right-aligned in the others."""
    lines = ["| " + " | ".join(header) + " |", "|---|" + "--:|" * (len(header) - 1)]
    return lines + ["| " + " | ".join(cells) + " |" for cells in body] + [""]


def _cell(row: dict | None, with_floor: bool) -> str:
    """``median · peak · % of the floor``, the parts this row has."""
    if row is None:
        return "—"
    parts = [format_ms(row["ms_p50"])]
    if row.get("peak_bytes") is not None:
        parts.append(format_bytes(row["peak_bytes"]))
    if with_floor and row.get("floor_ms"):
        parts.append(format_pct(100 * row["floor_ms"] / row["ms_p50"]))
    return " · ".join(parts)


def op_tables(rows: list[dict], providers: tuple[str, ...], stem_ops: tuple[str, ...], device_type: str) -> list[str]:
    """One table per (op, D): a row per case, a column per provider that ran, the baseline-to-fused ratio (the
    one-hot's, or stock's for the layer ops); a layer op's caption judges its target."""
    groups: dict[tuple[str, int, str], dict[str, dict[str, dict]]] = defaultdict(lambda: defaultdict(dict))
    for row in rows:
        if row["op"] not in CEILING_OPS:
            groups[row["op"], row["D"], row["dtype"]][row["case"]][row["provider"]] = row
    lines = []
    for (op, hidden, dtype), by_case in groups.items():
        present = [p for p in providers if any(p in by_provider for by_provider in by_case.values())]
        stem = op in stem_ops
        baseline = next((p for p in ("onehot", "stock") if p in present), None)
        speedup = baseline is not None and "fused" in present
        header = ["case", "patches", *(["floor"] if stem else []), *present]
        header += [f"{baseline} / fused"] if speedup else []
        body = []
        for case, by_provider in by_case.items():
            first = next(iter(by_provider.values()))
            cells = [case, f"{first['B'] * first['N']:,}"]
            if stem:
                cells.append(format_ms(first["floor_ms"]) if first.get("floor_ms") else "—")
            cells += [_cell(by_provider.get(p), stem) for p in present]
            if speedup:
                both = baseline in by_provider and "fused" in by_provider
                ratio = by_provider[baseline]["ms_p50"] / by_provider["fused"]["ms_p50"] if both else None
                cells.append(f"{significant(ratio, 2)}×" if ratio else "—")
            body.append(cells)
        lines += [f"### {op} · D={hidden} · {dtype}", ""]
        target = LAYER_OP_TARGETS.get(device_type) if op in LAYER_OPS else None
        if target is not None:
            lines += [target.judge([row for by_provider in by_case.values() for row in by_provider.values()]), ""]
        lines += _table(header, body)
    return lines


def _ratio(by_provider: dict[str, dict], numerator: str, denominator: str) -> str:
    if numerator not in by_provider or denominator not in by_provider:
        return "—"
    return f"{by_provider[numerator]['items_per_s'] / by_provider[denominator]['items_per_s']:.2f}×"


def _encoder_cell(row: dict | None) -> str:
    """``items/s · peak · TFLOP/s (% of matmul)``, the parts this row has."""
    if row is None:
        return "—"
    parts = [f"{significant(row['items_per_s'])}/s"]
    if row["peak_bytes"] is not None:
        parts.append(format_bytes(row["peak_bytes"]))
    if row.get("tflops") is not None:
        parts.append(f"{significant(row['tflops'])} TFLOP/s ({format_pct(row['pct_of_matmul'])})")
    return " · ".join(parts)


def encoder_tables(rows: list[dict], device_type: str, tiny: bool) -> list[str]:
    """One table per (op, dtype): a row per mix, each provider's items/s, peak and FLOP rate, packed's and
    fused's ratios; the targets in the caption."""
    groups: dict[tuple[str, str, int], dict[str, dict[str, dict]]] = defaultdict(lambda: defaultdict(dict))
    for row in rows:
        groups[row["op"], row["dtype"], row["layers"]][row["case"]][row["provider"]] = row
    lines = []
    for (op, dtype, layers), by_case in groups.items():
        present = [p for p in ENCODER_PROVIDERS if any(p in by_provider for by_provider in by_case.values())]
        ratios = [("packed", "stock"), ("packed", "padded")]
        ratios += [("fused", "stock"), ("fused", "packed")] if "fused" in present else []
        header = ["case", "items", "real patches", *present, *(f"{a} / {b}" for a, b in ratios)]
        body = []
        for case, by_provider in by_case.items():
            first = next(iter(by_provider.values()))
            cells = [case, str(first["B"]), f"{100 * first['real_patches'] / (first['B'] * first['N']):.1f}%"]
            cells += [_encoder_cell(by_provider.get(provider)) for provider in present]
            body.append(cells + [_ratio(by_provider, a, b) for a, b in ratios])
        note = (
            f"{ENCODER_TOWERS[op]} with {layer_note(op, layers, tiny)}. TFLOP/s counts every provider's useful "
            "FLOPs alone, those on the real patches (attention within each item), so the rates compare."
        )
        judged = [f"- {target.judge(by_case, dtype)}" for target in ENCODER_TARGETS[device_type]]
        lines += [f"### {op} · {dtype}", "", note, "", *judged, "", *_table(header, body)]
    return lines


def low_memory_table(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    total = rows[0]["emulated_total_bytes"]
    free = [row["free_bytes"] for row in rows if row.get("free_bytes") is not None]
    with_free = f" with {min(free) / 2**30:.2f} GiB free" if free else ""
    header = ["workload", "path", "items per call", "calls", "items/s", "peak beyond weights and inputs", "status"]
    body = []
    for row in rows:
        ok = row["status"] == "ok"
        rate = significant(row["items_per_s"]) if ok else "—"
        peak = format_bytes(row["peak_bytes"]) if ok else "—"
        body.append([row["workload"], row["path"], str(row["chunk"]), str(row["calls"]), rate, peak, row["status"]])
    title = f"### low memory: 26B/31B tower on an emulated {total / 2**30:.0f} GiB card{with_free}"
    return [title, "", *_table(header, body)]


def goal_summary(found: list[Verdict]) -> str:
    """How many targets the target case met, which not, and which the run could not judge there."""
    at_case = [verdict for verdict in found if verdict.at_target_case]
    where = f"{TARGET_CASE}, D={TARGET_HIDDEN}, {TARGET_DTYPE}"
    if not at_case:
        return f"targets: not judged, this run has no fused row with its baseline at {where}"
    missed = [f"{verdict.goal} ({verdict.provider})" for verdict in at_case if not verdict.met]
    unjudged = [goal for goal in GOALS if goal not in {verdict.goal for verdict in at_case}]
    summary = f"targets at {where}: {len(at_case) - len(missed)} of {len(at_case)} met"
    summary += f"; not met: {', '.join(missed)}" if missed else ""
    return summary + (f"; not judged (a row missing): {', '.join(unjudged)}" if unjudged else "")


def _measured(verdict: Verdict) -> str:
    if verdict.ratio is None:
        counted = "allocated" if verdict.row.get("peak_requested_bytes") is None else "requested"
        return f"{format_bytes(verdict.extra_bytes)} {counted}"
    row, baseline = verdict.row, verdict.baseline
    text = f"{significant(verdict.ratio, 2)}×: {format_ms(row['ms_p50'])} against {format_ms(baseline['ms_p50'])}"
    if row.get("floor_ms"):
        text += f" · {format_pct(100 * row['floor_ms'] / row['ms_p50'])} of floor"
    return text


def goal_lines(rows: list[dict]) -> list[str]:
    """The targets against this run's rows: a summary for the target case, then every verdict."""
    found = verdicts(rows)
    if not found:
        return []
    header = ["goal", "case", "D", "provider", "measured", "met"]
    body = [[v.goal, v.case, str(v.hidden), v.provider, _measured(v), "yes" if v.met else "**no**"] for v in found]
    return ["### targets", "", goal_summary(found) + ".", "", *_table(header, body)]


def skipped_lines(skipped: list[dict]) -> list[str]:
    if not skipped:
        return []
    grouped: dict[tuple[str, str, str], list[str]] = defaultdict(list)
    for entry in skipped:
        grouped[entry["op"], entry["provider"], entry["reason"]].append(f"{entry['case']} (D={entry['D']})")
    lines = ["### skipped", ""]
    lines += [f"- {op} · {provider} · {', '.join(where)}: {why}" for (op, provider, why), where in grouped.items()]
    return lines + [""]


def markdown(session, rows: list[dict], providers: tuple[str, ...], stem_ops: tuple[str, ...]) -> str:
    env, copy, matmul = session.environment, session.copy, session.matmul
    versions = ", ".join(f"{name} {env[name] or '-'}" for name in ENVIRONMENT_COLUMNS[1:])
    lines = [
        f"## fused_vision bench: {env['gpu']}",
        "",
        f"{session.date:%Y-%m-%d %H:%M} UTC · `{session.options.command}` · {versions}",
        "",
        f"Ceilings measured in this run: device copy **{significant(copy.gbps)} GB/s** (bytes read + written, "
        f"{copy.case}), {matmul.case} {session.dtype_name} matmul **{significant(matmul.tflops)} TFLOP/s**.",
        "",
    ]
    encoder_rows = [row for row in rows if row["op"] in ENCODER_TOWERS]
    other_rows = [row for row in rows if row["op"] not in ENCODER_TOWERS]
    if any(row["op"] not in CEILING_OPS for row in other_rows):
        lines += [
            "Cells: median time · peak bytes allocated beyond the inputs, output included (CUDA only) · for the stem "
            "and layer ops, % of the floor, where floor = max(bytes the op must move / copy bandwidth, FLOPs / matmul "
            "rate). onehot / fused, stock / fused: the fused op's speed-up over the one-hot or stock's eager code.",
            "",
        ]
    if encoder_rows:
        lines += [
            "Encoder cells: items/s (items over the median time of a call, over repetitions that interleave the "
            "providers) · peak beyond the weights and inputs, output included (CUDA: allocator blocks; CPU: the "
            "live tensors the call creates, under no_grad) · TFLOP/s and its % of the matmul ceiling. Ratios: packed's "
            "and fused's items/s over the other providers'.",
            "",
        ]
    if session.interrupted:
        lines += [f"**Interrupted** after {session.tasks_done} of {session.total_tasks} measurements.", ""]
    lines += goal_lines(rows)
    lines += op_tables(other_rows, providers, stem_ops, session.options.device.type)
    lines += encoder_tables(encoder_rows, session.options.device.type, session.options.tiny)
    lines += low_memory_table(session.low_memory_rows)
    lines += skipped_lines(session.skipped)
    return "\n".join(lines)


def plot(rows: list[dict], providers: tuple[str, ...], out: Path, log) -> list[str]:
    """time.png and memory.png: a panel per (op, D), bars per provider over the cases, log scale; floors dashed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("plots skipped: matplotlib is not installed (pip install matplotlib)")
        return []
    panels: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for row in rows:
        if row["op"] not in CEILING_OPS:
            panels[row["op"], row["D"]].append(row)
    written = []
    for metric, filename, label in (("ms_p50", "time.png", "median ms"), ("peak_bytes", "memory.png", "peak bytes")):
        chosen = {key: group for key, group in panels.items() if any(r.get(metric) for r in group)}
        if not chosen:
            continue
        columns, rows_of_panels = min(3, len(chosen)), math.ceil(len(chosen) / 3)
        figure, axes = plt.subplots(rows_of_panels, columns, figsize=(5.5 * columns, 4 * rows_of_panels), squeeze=False)
        handles = {}
        for axis, ((op, hidden), group) in zip(axes.flat, chosen.items()):
            case_names = list(dict.fromkeys(r["case"] for r in group))
            present = [p for p in providers if any(r["provider"] == p for r in group)]
            width = 0.8 / len(present)
            for index, provider in enumerate(present):
                values = {r["case"]: r[metric] for r in group if r["provider"] == provider and r.get(metric)}
                offset = (index - (len(present) - 1) / 2) * width
                xs = [i + offset for i, case in enumerate(case_names) if case in values]
                ys = [values[case] for case in case_names if case in values]
                handles[provider] = axis.bar(xs, ys, width, color=PROVIDER_COLORS[provider])
            floors = {r["case"]: r["floor_ms"] for r in group if metric == "ms_p50" and r.get("floor_ms")}
            for i, case in enumerate(case_names):
                if case in floors:
                    handles["floor"] = axis.hlines(floors[case], i - 0.45, i + 0.45, colors="black", linestyles="--")
            axis.set_yscale("log")
            # Log-scale bars start at the axis: put it below the smallest value so that every bar shows.
            axis.set_ylim(bottom=min([r[metric] for r in group if r.get(metric)] + list(floors.values())) / 3)
            axis.set_xticks(range(len(case_names)), case_names, rotation=15)
            axis.set_title(f"{op} · D={hidden}")
            axis.set_ylabel(label)
            axis.grid(axis="y", which="both", alpha=0.3)
        for axis in axes.flat[len(chosen) :]:
            axis.set_visible(False)
        figure.legend(handles.values(), handles.keys(), loc="upper center", ncol=len(handles))
        figure.tight_layout(rect=(0, 0, 1, 0.94))
        figure.savefig(out / filename, dpi=110)
        plt.close(figure)
        written.append(filename)
    return written


def write_all(
    session, out: Path, providers: tuple[str, ...], ops: tuple[str, ...], stem_ops: tuple[str, ...]
) -> list[str]:
    """Every file of a run but the log, which the run writes as it goes; returns the names written."""
    rows = sorted_rows(session.rows, ops, providers)
    write_csv(out / "results.csv", COLUMNS, rows)
    write_csv(out / "low_memory.csv", LOW_MEMORY_COLUMNS, session.low_memory_rows)
    (out / "results.md").write_text(markdown(session, rows, providers, stem_ops))
    return ["results.csv", "low_memory.csv", "results.md", *plot(rows, providers, out, session.log), "log.txt"]
