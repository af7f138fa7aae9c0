"""The stem ops' targets, judged from a run's own rows, so a run states whether it met them.

- patch_embed at least 4x faster than the stock eager embedder (``embedding``, transformers 5.10+), and
  faster than ``torch.compile`` of it (``compiled``);
- the pooler at least 10x faster than the stock pooler (``onehot``: every release pools through it);
- for both, peak memory beyond the inputs and the output under 1 MiB (CUDA only: a CPU runs them interpreted),
  in the bytes the call requested: the allocator's rounding of the output's block (up to 1 MiB) is no
  temporary of the op's. Where the allocator keeps no requested count, in its blocks, which can only
  miss the goal by that rounding, never meet it.

Each goal is judged at every case and width a run measured, for both fused providers: the public op
(``fused``, input checks included) and its launcher alone (``fused_kernel``), never on the rows of Triton's
interpreter (a CPU's), whose times are no speed. The targets are set at
``TARGET_CASE``, D=1152, in bf16, which the summary counts (a run in another dtype is judged, not counted).

The encoders' targets (``ENCODER_TARGETS``) are judged in the caption of each encoder table: they are set at a
processor mix rather than the stem ops' case and width, on the packed and fused providers, and differ by device.
The layer ops' (``LAYER_OP_TARGETS``, GPU only) are judged in the caption of each layer op's table.
"""

from collections import defaultdict
from dataclasses import dataclass

from .encoder import Mix
from .text import speed_rows
from .workloads import CPU_ENCODER_CASES

TARGET_CASE = "image_32x280"
TARGET_HIDDEN = 1152
TARGET_DTYPE = "bfloat16"
FUSED_PROVIDERS = ("fused", "fused_kernel")
EXTRA_PEAK_OPS = ("patch_embed", "pool_by_positions")
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
