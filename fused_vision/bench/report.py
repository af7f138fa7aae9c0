"""What a run writes: results.csv, low_memory.csv and results.md (the plots: ``plots``), and the text of them.

Rows of Triton's interpreter (``timing`` "correctness", a CPU's fused and fused_kernel) are labelled as
correctness runs and never compared with any other provider. No absolute path reaches a file (``portable``).
"""

from collections import defaultdict
from pathlib import Path

from .encoder import ENCODER_PROVIDERS, ENCODER_TOWERS, layer_note
from .measure import Ceiling
from .plots import plot
from .profile import PROFILE_COLUMNS, profile_table
from .rows import COLUMNS, ENVIRONMENT_COLUMNS, LOW_MEMORY_COLUMNS, write_csv
from .text import (
    ABOVE_CEILING_NOTE,
    CORRECTNESS,
    baseline_of,
    format_bytes,
    format_ms,
    format_pct,
    markdown_table,
    portable,
    significant,
    speed_rows,
)

CEILING_OPS = ("copy", "matmul")


def ceiling_text(ceiling: Ceiling) -> str:
    """How a ceiling was measured, and whether floors and shares of it are shown."""
    times = ceiling.times
    how = f"median of {times.reps} calls, 20-80 % spread {100 * times.spread:.0f}%"
    if ceiling.reliable:
        return how
    return f"{how}: too few or too spread for a floor or a share of it, none shown"


def sorted_rows(rows: list[dict], ops: tuple[str, ...], providers: tuple[str, ...]) -> list[dict]:
    """Ceilings first, then the ops in ``ops`` order, each by width, case (in run order) and provider."""
    op_order = {op: index for index, op in enumerate((*CEILING_OPS, *ops))}
    case_order = {case: index for index, case in enumerate(dict.fromkeys(row["case"] for row in rows))}
    provider_order = {provider: index for index, provider in enumerate(providers)}

    def key(row: dict) -> tuple:
        return op_order[row["op"]], row.get("D") or 0, case_order[row["case"]], provider_order.get(row["provider"], -1)

    return sorted(rows, key=key)


def _pct_of_floor(row: dict) -> float | None:
    return 100 * row["floor_ms"] / row["ms_p50"] if row.get("floor_ms") and row.get("timing") != CORRECTNESS else None


def _cell(row: dict | None, with_floor: bool) -> str:
    """``median · peak · % of the floor``, the parts this row has; an interpreter's time labelled as such."""
    if row is None:
        return "—"
    if row.get("timing") == CORRECTNESS:
        return f"{format_ms(row['ms_p50'])} (interpreter: correctness run)"
    parts = [format_ms(row["ms_p50"])]
    if row.get("peak_bytes") is not None:
        parts.append(format_bytes(row["peak_bytes"]))
    if with_floor and _pct_of_floor(row) is not None:
        parts.append(format_pct(_pct_of_floor(row)))
    return " · ".join(parts)


def _speed_ratio_columns(baseline: str | None, by_case: dict[str, dict[str, dict]]) -> list[str]:
    """The fused_vision providers to compare with the baseline: those with a speed row (not the interpreter's)."""
    if baseline is None:
        return []
    rows = [row for by_provider in by_case.values() for row in by_provider.values()]
    timed = {row["provider"] for row in speed_rows(rows)}
    return [p for p in ("reference", "fused") if p in timed]


def op_tables(rows: list[dict], providers: tuple[str, ...], stem_ops: tuple[str, ...]) -> list[str]:
    """One table per (op, D): a row per case, a column per provider that ran, the baseline's time over each
    timed fused_vision provider's (the one-hot's, or stock's for the layer ops)."""
    groups: dict[tuple[str, int, str], dict[str, dict[str, dict]]] = defaultdict(lambda: defaultdict(dict))
    for row in rows:
        if row["op"] not in CEILING_OPS:
            groups[row["op"], row["D"], row["dtype"]][row["case"]][row["provider"]] = row
    lines = []
    for (op, hidden, dtype), by_case in groups.items():
        present = [p for p in providers if any(p in by_provider for by_provider in by_case.values())]
        stem = op in stem_ops
        with_floor = stem and any(first.get("floor_ms") for first in _firsts(by_case))
        baseline = baseline_of(present)
        compared = _speed_ratio_columns(baseline, by_case)
        header = ["case", "patches", *(["floor"] if with_floor else []), *present]
        header += [f"{baseline} / {provider}" for provider in compared]
        body = []
        for case, by_provider in by_case.items():
            first = next(iter(by_provider.values()))
            cells = [case, f"{first['B'] * first['N']:,}"]
            if with_floor:
                cells.append(format_ms(first["floor_ms"]) if first.get("floor_ms") else "—")
            cells += [_cell(by_provider.get(p), stem) for p in present]
            for provider in compared:
                row, base = by_provider.get(provider), by_provider.get(baseline)
                timed = row is not None and base is not None and row.get("timing") != CORRECTNESS
                cells.append(f"{significant(base['ms_p50'] / row['ms_p50'], 2)}×" if timed else "—")
            body.append(cells)
        lines += [f"### {op} · D={hidden} · {dtype}", "", *markdown_table(header, body)]
    return lines


def _firsts(by_case: dict[str, dict[str, dict]]) -> list[dict]:
    return [next(iter(by_provider.values())) for by_provider in by_case.values()]


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
        share = f" ({format_pct(row['pct_of_matmul'])})" if row.get("pct_of_matmul") is not None else ""
        parts.append(f"{significant(row['tflops'])} TFLOP/s{share}")
    return " · ".join(parts)


def _encoder_ratios(present) -> list[tuple[str, str]]:
    pairs = (("packed", "stock"), ("packed", "padded"), ("fused", "stock"), ("fused", "packed"), ("graphed", "fused"))
    return [(a, b) for a, b in pairs if a in present and b in present]


def _attention_paths(by_case: dict[str, dict[str, dict]], present: list[str]) -> str:
    """Each provider's attention path, as its rows recorded it (runs before the column show none)."""
    paths = []
    for provider in present:
        rows = [by_provider[provider] for by_provider in by_case.values() if provider in by_provider]
        taken = dict.fromkeys(row.get("attention") or "not recorded" for row in rows)
        paths.append(f"{provider} {' / '.join(taken)}")
    return "; ".join(paths)


def encoder_tables(rows: list[dict], tiny: bool) -> list[str]:
    """One table per (op, dtype): a row per mix, each provider's items/s, peak and FLOP rate, packed's and
    fused's ratios."""
    groups: dict[tuple[str, str, int], dict[str, dict[str, dict]]] = defaultdict(lambda: defaultdict(dict))
    for row in rows:
        groups[row["op"], row["dtype"], row["layers"]][row["case"]][row["provider"]] = row
    lines = []
    for (op, dtype, layers), by_case in groups.items():
        present = [p for p in ENCODER_PROVIDERS if any(p in by_provider for by_provider in by_case.values())]
        ratios = _encoder_ratios(present)
        header = ["case", "items", "real patches", *present, *(f"{a} / {b}" for a, b in ratios)]
        body = []
        for case, by_provider in by_case.items():
            first = next(iter(by_provider.values()))
            cells = [case, str(first["B"]), f"{100 * first['real_patches'] / (first['B'] * first['N']):.1f}%"]
            cells += [_encoder_cell(by_provider.get(provider)) for provider in present]
            body.append(cells + [_ratio(by_provider, a, b) for a, b in ratios])
        note = (
            f"{ENCODER_TOWERS[op]} with {layer_note(op, layers, tiny)}. TFLOP/s counts every provider's useful "
            "FLOPs alone, those on the real patches (attention within each item), so the rates compare. "
            f"Attention: {_attention_paths(by_case, present)}."
        )
        lines += [f"### {op} · {dtype}", "", note, "", *markdown_table(header, body)]
    return lines


def low_memory_table(rows: list[dict]) -> list[str]:
    """The scenario's rows; where none ran (no CUDA device), only the chunks each path computed."""
    if not rows:
        return []
    total = rows[0]["emulated_total_bytes"]
    free = [row["free_bytes"] for row in rows if row.get("free_bytes") is not None]
    with_free = f" with {min(free) / 2**30:.2f} GiB free" if free else ""
    ran = any(row["status"] == "ok" for row in rows)
    header = ["workload", "path", "items per call", "calls"]
    header += ["items/s", "peak beyond weights and inputs"] if ran else []
    body = []
    for row in rows:
        cells = [row["workload"], row["path"], str(row["chunk"]), str(row["calls"])]
        if ran:
            ok = row["status"] == "ok"
            cells += [significant(row["items_per_s"]) if ok else "—", format_bytes(row["peak_bytes"]) if ok else "—"]
        body.append(cells + [row["status"]])
    title = f"### low memory: 26B/31B tower on {'an emulated' if ran else 'a'} {total / 2**30:.0f} GiB card{with_free}"
    paths = "path onehot: vLLM's chunk (its one-hot price); fused: fused_vision's planner."
    return [title, "", paths, "", *markdown_table([*header, "status"], body)]


def skipped_lines(skipped: list[dict]) -> list[str]:
    if not skipped:
        return []
    grouped: dict[tuple[str, str, str], list[str]] = defaultdict(list)
    for entry in skipped:
        grouped[entry["op"], entry["provider"], entry["reason"]].append(f"{entry['case']} (D={entry['D']})")
    lines = ["### skipped", ""]
    lines += [f"- {op} · {provider} · {', '.join(where)}: {why}" for (op, provider, why), where in grouped.items()]
    return lines + [""]


PROVIDER_NOTES = {
    "onehot": "transformers 5.5-5.9's one-hot code",
    "embedding": "transformers 5.10+'s two F.embedding",
    "compiled": "torch.compile of stock's code",
    "stock": "stock's eager code",
    "reference": "fused_vision's op on its PyTorch path, what a CPU runs",
    "fused": "fused_vision's op on its Triton kernel",
    "fused_kernel": "the Triton kernel's launcher alone",
    "separate": "cuBLAS's GEMM, then fused_vision's gate kernel: the fused layer's default MLP",
}


def _op_caption(rows: list[dict], providers: tuple[str, ...], device_type: str) -> list[str]:
    """What the op tables' cells and columns hold: only the parts these rows have."""
    present = [p for p in providers if any(row["provider"] == p for row in rows)]
    parts = ["median time"]
    if any(row.get("peak_bytes") is not None for row in rows):
        parts.append(f"peak beyond the inputs, output included ({PEAK_NOTES[device_type]})")
    shares = [_pct_of_floor(row) for row in rows if _pct_of_floor(row) is not None]
    if shares:
        parts.append("% of the floor, where floor = max(bytes the op must move / copy bandwidth, FLOPs / matmul rate)")
    lines = ["Cells: " + " · ".join(parts) + "."]
    if shares and max(shares) > 100:
        lines.append(ABOVE_CEILING_NOTE)
    if any(row.get("timing") == CORRECTNESS for row in rows):
        lines.append(
            "interpreter: correctness run: Triton's interpreter ran the kernel on the CPU; its time says nothing of "
            "the kernel's speed and is compared with nothing."
        )
    notes = [f"{p}: {PROVIDER_NOTES[p]}" for p in present if p in PROVIDER_NOTES]
    lines.append("Providers: " + "; ".join(notes) + ".")
    if _speed_ratio_columns(baseline_of(present), {"": {row["provider"]: row for row in rows}}):
        lines.append("A ratio column: the first provider's median time over the second's.")
    return [" ".join(lines), ""]


PEAK_NOTES = {
    "cuda": "the caching allocator's blocks",
    "cpu": "the CPU allocator's blocks the call allocated, from torch's profiler; memory MKL allocates itself unseen",
}


def _encoder_caption(rows: list[dict], device_type: str) -> list[str]:
    parts = ["items/s (items over the median time of a call, over rounds that interleave the providers)"]
    if any(row.get("peak_bytes") is not None for row in rows):
        parts.append(f"peak beyond the weights and inputs, output included ({PEAK_NOTES[device_type]})")
    if any(row.get("pct_of_matmul") is not None for row in rows):
        parts.append("TFLOP/s and its % of the matmul ceiling")
    elif any(row.get("tflops") is not None for row in rows):
        parts.append("TFLOP/s")
    caption = "Encoder cells: " + " · ".join(parts) + "."
    if any((row.get("pct_of_matmul") or 0) > 100 for row in rows):
        caption += " " + ABOVE_CEILING_NOTE
    if _encoder_ratios({row["provider"] for row in rows}):
        caption += " A ratio column: the first provider's items/s over the second's."
    return [caption, ""]


def _ceilings_line(session) -> str:
    copy, matmul = session.copy, session.matmul
    return (
        f"Ceilings measured in this run: device copy **{significant(copy.gbps)} GB/s** (bytes read + written, "
        f"{copy.case}; {ceiling_text(copy)}), {matmul.case} {session.dtype_name} matmul "
        f"**{significant(matmul.tflops)} TFLOP/s** ({ceiling_text(matmul)})."
    )


def markdown(session, rows: list[dict], providers: tuple[str, ...], stem_ops: tuple[str, ...], summary) -> str:
    env, device_type = session.environment, session.options.device.type
    versions = ", ".join(f"{name} {env[name] or '-'}" for name in ENVIRONMENT_COLUMNS[1:])
    lines = [
        f"## fused_vision bench: {env['gpu']}",
        "",
        f"{session.date:%Y-%m-%d %H:%M} UTC · `{portable(session.options.command)}` · {versions}",
        "",
        _ceilings_line(session),
        "",
    ]
    if session.interrupted:
        lines += [f"**Interrupted** after {session.tasks_done} of {session.total_tasks} measurements.", ""]
    lines += [
        "### summary",
        "",
        summary[0].removeprefix("summary: ") + ":",
        "",
        *(f"- {line}" for line in summary[1:]),
        "",
    ]
    encoder_rows = [row for row in rows if row["op"] in ENCODER_TOWERS]
    op_rows = [row for row in rows if row["op"] not in (*ENCODER_TOWERS, *CEILING_OPS)]
    if op_rows:
        lines += _op_caption(op_rows, providers, device_type)
        lines += op_tables(op_rows, providers, stem_ops)
    if encoder_rows:
        lines += _encoder_caption(encoder_rows, device_type)
        lines += encoder_tables(encoder_rows, session.options.tiny)
    lines += low_memory_table(session.low_memory_rows)
    lines += skipped_lines(session.skipped)
    return portable("\n".join(lines))


def write_all(session, out: Path, providers: tuple[str, ...], ops: tuple[str, ...], stem_ops, summary) -> list[str]:
    """Every file of a run but the log, which the run writes as it goes; returns the names written. A CSV
    without rows is not written."""
    rows = sorted_rows(session.rows, ops, providers)
    written = []
    for name, columns, table in (
        ("results.csv", COLUMNS, rows),
        ("low_memory.csv", LOW_MEMORY_COLUMNS, session.low_memory_rows),
    ):
        if table:
            write_csv(out / name, columns, table)
            written.append(name)
    (out / "results.md").write_text(markdown(session, rows, providers, stem_ops, summary))
    written.append("results.md")
    if session.profile_rows:
        write_csv(out / "profile.csv", PROFILE_COLUMNS, session.profile_rows)
        (out / "profile.md").write_text(profile_markdown(session))
        written += ["profile.csv", "profile.md"]
    return [*written, *plot(session, rows, providers, out), "log.txt"]


def profile_markdown(session) -> str:
    """profile.md: each profiled call's milliseconds by category, and how they were measured."""
    env = session.environment
    where = "CUDA time of its kernels" if session.options.device.type == "cuda" else "CPU time of its ops"
    lines = [
        f"# Where the time goes: {env['gpu']}, {session.dtype_name}",
        "",
        f"One call per row under torch.profiler, after the timed calls: the {where} by category, and host gaps "
        "(on a GPU, the call's time with no kernel running; on a CPU, its time outside every op). A profiled "
        "call runs slower than a timed one; the shares are what to read.",
        "",
        *profile_table(session.profile_rows),
        f"torch {env['torch']}, triton {env['triton'] or '-'}, transformers {env['transformers'] or '-'}, "
        f"fused_vision {env['fused_vision']}; command: `{session.options.command}`",
        "",
    ]
    return portable("\n".join(lines))
