"""The project's goals, judged from a bench run's results.csv: which target, case, provider, measured, met.

    python bench/goals.py RESULTS_CSV [--out GOALS_MD]

Prints the verdicts as markdown (and writes them to GOALS_MD): the stem ops' table at every case and width,
the layer ops' copy-bandwidth share, the encoders' targets at a processor mix. A verdict uses speed rows
alone, never Triton's interpreter's. docs/benchmark.md, "The goals", says what each goal is and why.
"""

import argparse
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from fused_vision.bench.encoder import ENCODER_TOWERS, Mix
from fused_vision.bench.layer_ops import LAYER_OPS
from fused_vision.bench.rows import read_csv
from fused_vision.bench.text import format_bytes, format_ms, format_pct, markdown_table, significant, speed_rows
from fused_vision.bench.workloads import CPU_ENCODER_CASES

TARGET_CASE = "image_32x280"
TARGET_HIDDEN = 1152
TARGET_DTYPE = "bfloat16"
FUSED_PROVIDERS = ("fused", "fused_kernel")
EXTRA_PEAK_OPS = ("patch_embed", "pool_by_positions")
# Peak beyond inputs and output, in the bytes requested where the allocator counts them: its rounding of the
# output's block (up to 1 MiB) is no temporary of the op's; elsewhere in its blocks, which only judges stricter.
EXTRA_PEAK_LIMIT = 2**20


@dataclass(frozen=True)
class SpeedUp:
    """``op`` under a fused provider must beat ``baseline`` by ``factor`` (strictly, for "faster than")."""

    op: str
    baseline: str
    factor: float
    strictly: bool = False

    @property
    def goal(self) -> str:
        if self.strictly:
            return f"{self.op} faster than {self.baseline}"
        return f"{self.op} ≥ {self.factor:g}× faster than {self.baseline}"

    def met(self, ratio: float) -> bool:
        return ratio > self.factor if self.strictly else ratio >= self.factor


SPEED_UPS = (
    SpeedUp("patch_embed", "embedding", 4.0),
    SpeedUp("patch_embed", "compiled", 1.0, strictly=True),
    SpeedUp("pool_by_positions", "onehot", 10.0),
)


def peak_goal(op: str) -> str:
    return f"{op} peak beyond inputs and output < 1 MiB"


GOALS = (*(target.goal for target in SPEED_UPS), *map(peak_goal, EXTRA_PEAK_OPS))


@dataclass(frozen=True)
class Verdict:
    """One goal at one case, width and fused provider. ``ratio`` is the baseline's time over the fused
    one's for speed-ups, None for memory; ``extra_bytes`` the peak beyond the output for memory goals
    (requested bytes where the row has them)."""

    goal: str
    case: str
    hidden: int
    provider: str
    row: dict
    baseline: dict | None
    ratio: float | None
    extra_bytes: int | None
    met: bool

    @property
    def at_target_case(self) -> bool:
        return self.case == TARGET_CASE and self.hidden == TARGET_HIDDEN and self.row["dtype"] == TARGET_DTYPE


def verdicts(rows: list[dict]) -> list[Verdict]:
    """Every goal a run's rows can judge: speed-ups where the baseline ran too, memory where peaks exist."""
    by_case: dict[tuple[str, str, int], dict[str, dict]] = defaultdict(dict)
    for row in speed_rows(rows):  # Triton's interpreter's times are no speed to judge
        if row.get("D") is not None:  # the ceilings have no case of their own
            by_case[row["op"], row["case"], row["D"]][row["provider"]] = row
    found = []
    for (op, case, hidden), by_provider in by_case.items():
        for provider in FUSED_PROVIDERS:
            row = by_provider.get(provider)
            if row is None:
                continue
            for target in SPEED_UPS:
                baseline = by_provider.get(target.baseline)
                if target.op == op and baseline is not None:
                    ratio = baseline["ms_p50"] / row["ms_p50"]
                    met = target.met(ratio)
                    found.append(Verdict(target.goal, case, hidden, provider, row, baseline, ratio, None, met))
            if op in EXTRA_PEAK_OPS and row.get("peak_bytes") is not None:
                requested = row.get("peak_requested_bytes")
                extra = (row["peak_bytes"] if requested is None else requested) - row["output_bytes"]
                met = extra < EXTRA_PEAK_LIMIT
                found.append(Verdict(peak_goal(op), case, hidden, provider, row, None, None, extra, met))
    return found


def _where(case: str, dtype: str | None) -> str:
    return case + (f", {dtype}" if dtype else "")


@dataclass(frozen=True, kw_only=True)
class EncoderTarget:
    """``provider`` must reach ``factor`` x ``baseline``'s items/s at ``case`` (in ``dtype``, where set), with a
    lower peak where ``lower_peak``. ``factor`` None: the padding the mix drops, its B·N over its real patches."""

    device: str
    case: str
    factor: float | None
    provider: str = "packed"
    baseline: str = "stock"
    dtype: str | None = None
    lower_peak: bool = False

    @property
    def goal(self) -> str:
        peak = " and a lower peak" if self.lower_peak else ""
        where = f"at {_where(self.case, self.dtype)}{peak}"
        if self.factor is None:
            return f"{self.provider} ≥ {self.baseline}'s items/s × B·N / real patches (the padding it drops) {where}"
        return f"{self.provider} ≥ {self.factor:g}× {self.baseline}'s items/s {where}"

    def judge(self, by_case: dict[str, dict[str, dict]], dtype: str) -> str:
        """The goal, and whether the rows of one (op, dtype) meet it, with the measured ratios."""
        head = f"Target ({self.device}): {self.goal}"
        by_provider = by_case.get(self.case, {})
        if self.dtype not in (None, dtype):
            return f"{head}: not judged in {dtype}."
        if self.baseline not in by_provider or self.provider not in by_provider:
            return f"{head}: not judged, this run has no {self.baseline} and {self.provider} rows there."
        baseline, row = by_provider[self.baseline], by_provider[self.provider]
        ratio = row["items_per_s"] / baseline["items_per_s"]
        factor = baseline["B"] * baseline["N"] / baseline["real_patches"] if self.factor is None else self.factor
        measured, met = f"{ratio:.2f}×", ratio >= factor
        if self.factor is None:
            measured += f" against {factor:.2f}×"
        if self.lower_peak:
            peak_ratio = row["peak_bytes"] / baseline["peak_bytes"]
            measured += f", peak {peak_ratio:.2f}× {self.baseline}'s"
            met = met and peak_ratio < 1
        return f"{head}: {'met' if met else '**not met**'} ({measured})."


@dataclass(frozen=True, kw_only=True)
class MatmulShare:
    """``provider``'s FLOP rate (useful FLOPs, on real patches) at least ``pct`` % of the run's matmul ceiling."""

    device: str
    case: str
    pct: float
    provider: str = "fused"
    dtype: str | None = None

    @property
    def goal(self) -> str:
        return f"{self.provider} ≥ {self.pct:g}% of the matmul rate at {_where(self.case, self.dtype)}"

    def judge(self, by_case: dict[str, dict[str, dict]], dtype: str) -> str:
        head = f"Target ({self.device}): {self.goal}"
        row = by_case.get(self.case, {}).get(self.provider)
        if self.dtype not in (None, dtype):
            return f"{head}: not judged in {dtype}."
        if row is None or row.get("pct_of_matmul") is None:
            return f"{head}: not judged, this run has no {self.provider} row with a FLOP rate there."
        met = row["pct_of_matmul"] >= self.pct
        return f"{head}: {'met' if met else '**not met**'} ({row['pct_of_matmul']:.1f}%)."


@dataclass(frozen=True)
class CopyShare:
    """Every row of a Triton provider at least ``pct`` % of the run's copy bandwidth, at every case."""

    device: str
    pct: float

    @property
    def goal(self) -> str:
        return f"{' and '.join(FUSED_PROVIDERS)} ≥ {self.pct:g}% of copy bandwidth at every case"

    def judge(self, rows: list[dict]) -> str:
        """The goal, and whether the rows of one (op, D, dtype) meet it: the lowest share, or those below it."""
        head = f"Target ({self.device}): {self.goal}"
        judged = [row for row in rows if row["provider"] in FUSED_PROVIDERS and row.get("pct_of_copy") is not None]
        if not judged:
            return f"{head}: not judged, this run has no {' or '.join(FUSED_PROVIDERS)} rows."
        below = [row for row in judged if row["pct_of_copy"] < self.pct]
        shown = below or [min(judged, key=lambda row: row["pct_of_copy"])]
        where = ", ".join(f"{row['provider']} {row['pct_of_copy']:.0f}% at {row['case']}" for row in shown)
        return f"{head}: **not met** (below: {where})." if below else f"{head}: met (lowest: {where})."


@dataclass(frozen=True)
class EpilogueChoice:
    """The GEMM with the GELU gate in its epilogue against the separate path it would replace (cuBLAS's
    GEMM, then the gate kernel): which is faster at each case, so which the fused layer should run."""

    device: str

    def judge(self, rows: list[dict]) -> str:
        head = f"Choice ({self.device}): the gate in the GEMM's epilogue (fused) where it beats the separate path"
        by_case: dict[str, dict[str, dict]] = defaultdict(dict)
        for row in rows:
            by_case[row["case"]][row["provider"]] = row
        pairs = [
            (case, got["fused"], got["separate"]) for case, got in by_case.items() if {"fused", "separate"} <= set(got)
        ]
        if not pairs:
            return f"{head}: not judged, this run has no fused and separate rows at one case."
        shown = ", ".join(f"{significant(s['ms_p50'] / f['ms_p50'], 3)}× at {case}" for case, f, s in pairs)
        faster = all(f["ms_p50"] < s["ms_p50"] for _, f, s in pairs)
        return f"{head}: {'fused' if faster else '**separate**'} (separate / fused: {shown})."


# CPU, at its default mix: packed at least the padding it drops, and the fused layer's reference path no slower
# than stock's layer; GPU: bench/NOTES.md's packed prediction, and the fused encoder's goals.
CPU_MIX = Mix(CPU_ENCODER_CASES[0]).name
ENCODER_TARGETS = {
    "cpu": (
        EncoderTarget(device="CPU", case=CPU_MIX, factor=None, lower_peak=True),
        EncoderTarget(device="CPU", case=CPU_MIX, factor=1.0, provider="fused", baseline="packed"),
    ),
    "cuda": (
        EncoderTarget(device="GPU", case="image_mix_8x280", factor=1.3, dtype="bfloat16"),
        EncoderTarget(device="GPU", case="image_mix_8x280", factor=2.5, provider="fused", dtype="bfloat16"),
        EncoderTarget(
            device="GPU", case="image_mix_8x280", factor=1.5, provider="fused", baseline="compiled", dtype="bfloat16"
        ),
        MatmulShare(device="GPU", case="image_mix_8x280", pct=50.0, dtype="bfloat16"),
    ),
}
# The layer ops move their bytes once each; a CPU runs Triton only in its interpreter, so it has no such goal.
LAYER_OP_TARGETS = {"cuda": CopyShare("GPU", 70.0)}
# The GEMM ops are not copies: what their rows decide is whether the epilogue beats the separate path.
GEMM_OP_CHOICES = {"cuda": {"gate_up_gelu": EpilogueChoice("GPU")}}


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


def stem_lines(rows: list[dict]) -> list[str]:
    """The summary for the target case, then every verdict."""
    found = verdicts(rows)
    header = ["goal", "case", "D", "provider", "measured", "met"]
    body = [[v.goal, v.case, str(v.hidden), v.provider, _measured(v), "yes" if v.met else "**no**"] for v in found]
    return ["### targets", "", goal_summary(found) + ".", "", *(markdown_table(header, body) if found else [])]


def layer_op_lines(rows: list[dict], device: str) -> list[str]:
    """The copy-bandwidth target of each layer op, per (op, D, dtype); none on a CPU, which has no such goal."""
    target = LAYER_OP_TARGETS.get(device)
    if target is None:
        return []
    groups: dict[tuple[str, int, str], list[dict]] = defaultdict(list)
    for row in rows:
        if row["op"] in LAYER_OPS:
            groups[row["op"], row["D"], row["dtype"]].append(row)
    lines = []
    choices = GEMM_OP_CHOICES.get(device, {})
    for (op, hidden, dtype), group in groups.items():
        judge = choices[op].judge if op in choices else target.judge
        lines += [f"### {op} · D={hidden} · {dtype}", "", judge(group), ""]
    return lines


def encoder_lines(rows: list[dict], device: str) -> list[str]:
    """The encoders' targets, per (op, dtype, layers)."""
    groups: dict[tuple[str, str, int], dict[str, dict[str, dict]]] = defaultdict(lambda: defaultdict(dict))
    for row in rows:
        if row["op"] in ENCODER_TOWERS:
            groups[row["op"], row["dtype"], row["layers"]][row["case"]][row["provider"]] = row
    lines = []
    for (op, dtype, _), by_case in groups.items():
        judged = [f"- {target.judge(by_case, dtype)}" for target in ENCODER_TARGETS[device]]
        lines += [f"### {op} · {dtype}", "", *judged, ""]
    return lines


def markdown(rows: list[dict]) -> str:
    device = "cpu" if rows[0]["gpu"].startswith("cpu ") else "cuda"  # the run's environment names its device
    return "\n".join([*stem_lines(rows), *layer_op_lines(rows, device), *encoder_lines(rows, device)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="a bench run's results.csv")
    parser.add_argument("--out", type=Path, help="also write the verdicts to this markdown file")
    args = parser.parse_args(argv)
    text = markdown(read_csv(args.results))
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
