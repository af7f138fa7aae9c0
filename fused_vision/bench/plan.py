"""What a run measures: the ops and providers there are, the options a run is given, and the plan they make."""

from dataclasses import dataclass
from pathlib import Path

import torch

from .encoder import ENCODER_PROVIDERS, ENCODER_TOWERS, Mix
from .layer_ops import LAYER_OPS
from .ops import STEM_OPS
from .tower import LOW_MEMORY_PATHS, LOW_MEMORY_WORKLOADS, TOWER_PROVIDERS, VISION_TOWERS
from .workloads import (
    CPU_CASES,
    CPU_ENCODER_CASES,
    GPU_CASES,
    GPU_ENCODER_CASES,
    GPU_TOWER_CASES,
    HEADLINE_CASE,
    HEADLINE_ENCODER_CASES,
    TINY_CASES,
    Case,
    cases,
)

TOWER_OPS = tuple(VISION_TOWERS)
ENCODER_OPS = tuple(ENCODER_TOWERS)
OP_BENCHES = {**STEM_OPS, **LAYER_OPS}  # the ops timed one call at a time, at the stem cases
OPS = (*OP_BENCHES, *TOWER_OPS, *ENCODER_OPS, "low_memory")
OP_GROUPS = {"stem": tuple(STEM_OPS), "layer": tuple(LAYER_OPS), "tower": TOWER_OPS, "encoder": ENCODER_OPS}
PROVIDERS = (
    "stock",
    "onehot",
    "embedding",
    "compiled",
    "reference",
    "fused",
    "fused_kernel",
    "separate",
    "padded",
    "packed",
    "graphed",
)
GPU_PROVIDERS = tuple(p for p in PROVIDERS if p != "reference")  # a GPU runs fused_vision's Triton kernels
# A CPU runs fused_vision as a CPU user gets it: the ops' PyTorch path (``reference``, what backend="auto" picks
# there) against stock's one-hot and F.embedding code, on the forward stem ops (the layer ops' PyTorch path is
# stock's own code); the packed and fused encoders (the fused one on the ops' PyTorch path) against stock's
# tower; and the planner's chunks for the low-memory scenario, computed. Triton runs on a CPU only in its
# interpreter, whose times mean nothing, so no Triton provider is a CPU default.
CPU_OPS = ("position_embeddings", "patch_embed", "pool_by_positions", "encoder_e2b_e4b", "low_memory")
CPU_PROVIDERS = ("onehot", "embedding", "reference")
CPU_ENCODER_PROVIDERS = ("stock", "packed", "fused")
# --headline: the rows the project's targets are set on, in one process so that their ratios compare. The
# forward stem ops and the layer ops at the headline case, beside compiled stock; both encoders, stock eager,
# compiled, packed and fused, at an image mix and a video of 20,160 patches each.
HEADLINE_OPS = (*(op for op in STEM_OPS if not op.endswith("_backward")), *LAYER_OPS, *ENCODER_OPS)
HEADLINE_ENCODER_PROVIDERS = ("stock", "compiled", "packed", "fused")
DEFAULT_HIDDEN = 1152  # the 26B/31B tower's width, that of the baselines (bench/baselines.md)
TINY_HIDDEN = 64  # the Triton interpreter runs a D=64 patch embedder ~30x faster than D=1152
# The whole comparison must end within 5 minutes on an H200: 210 s leaves ~90 s for start-up, the task running
# at the deadline (a compile can take 20 s) and the reports. On a 2-core CPU within 3 minutes: 160 s leaves
# ~20 s for start-up, the call in flight and the reports.
DEFAULT_TIME_BUDGET_S = {"cuda": 210.0, "cpu": 160.0}


@dataclass(frozen=True)
class Options:
    """What to run. ``None`` leaves the choice to the device's defaults (see ``Plan``)."""

    device: torch.device
    out: Path
    ops: tuple[str, ...] | None = None
    providers: tuple[str, ...] | None = None
    cases: tuple[Case, ...] | None = None
    hidden_sizes: tuple[int, ...] | None = None
    dtype: torch.dtype | None = None
    quick: bool = False
    tiny: bool = False
    time_budget_s: float | None = None  # None: the device's default; 0: no limit
    profile: bool = False  # one profiled call per tower and encoder row, by category (``profile``)
    headline: bool = False  # the defaults are ``HEADLINE_OPS`` and their cases and providers
    command: str = ""


@dataclass(frozen=True)
class Plan:
    """What a run does: the options, with the device's defaults where they leave a choice open.

    GPUs run everything at the checkpoints' shapes in bf16 (their dtype; pixels stay float32, as the
    processors emit them). CPUs run fused_vision's PyTorch path against stock on the forward stem ops at one
    image, the E2B/E4B encoder's stock, packed and fused calls at one layer, in fp32, and compute the
    low-memory scenario's chunks: compiles take minutes there, Triton runs on a CPU only in its interpreter,
    whose times mean nothing, and a CPU without bf16 matmul instructions emulates them (one bf16 one-hot
    lookup at video_2x70 took 15 s on a 2-core x86, 50x its fp32 time). ``--tiny`` shrinks the towers and
    the stem ops' cases, not the encoder's processor mixes. ``time_budget_s`` is 0 for no limit.
    """

    ops: tuple[str, ...]
    providers: tuple[str, ...]
    encoder_providers: tuple[str, ...]
    stem_cases: tuple[Case, ...]
    tower_cases: tuple[Case, ...]
    encoder_cases: tuple[Case, ...]
    hidden_sizes: tuple[int, ...]
    dtype: torch.dtype
    time_budget_s: float

    @classmethod
    def of(cls, options: Options) -> "Plan":
        on_gpu, tiny, headline = options.device.type == "cuda", options.tiny, options.headline
        budget = options.time_budget_s
        stem_cases = TINY_CASES if tiny else cases(HEADLINE_CASE) if headline else GPU_CASES if on_gpu else CPU_CASES
        encoder_cases = HEADLINE_ENCODER_CASES if headline else GPU_ENCODER_CASES if on_gpu else CPU_ENCODER_CASES
        encoder_providers = GPU_PROVIDERS if on_gpu else CPU_ENCODER_PROVIDERS
        return cls(
            ops=options.ops or (HEADLINE_OPS if headline else OPS if on_gpu else CPU_OPS),
            providers=options.providers or (GPU_PROVIDERS if on_gpu or headline else CPU_PROVIDERS),
            encoder_providers=options.providers or (HEADLINE_ENCODER_PROVIDERS if headline else encoder_providers),
            stem_cases=options.cases or stem_cases,
            tower_cases=options.cases or (TINY_CASES if tiny else GPU_TOWER_CASES if on_gpu else CPU_CASES),
            encoder_cases=options.cases or encoder_cases,
            hidden_sizes=options.hidden_sizes or ((TINY_HIDDEN,) if tiny else (DEFAULT_HIDDEN,)),
            dtype=options.dtype or (torch.bfloat16 if on_gpu else torch.float32),
            time_budget_s=DEFAULT_TIME_BUDGET_S[options.device.type] if budget is None else budget,
        )

    @property
    def stem_ops(self) -> tuple[str, ...]:
        return tuple(op for op in STEM_OPS if op in self.ops)

    @property
    def layer_ops(self) -> tuple[str, ...]:
        return tuple(op for op in LAYER_OPS if op in self.ops)

    @property
    def tower_ops(self) -> tuple[str, ...]:
        return tuple(op for op in TOWER_OPS if op in self.ops)

    @property
    def encoder_ops(self) -> tuple[str, ...]:
        return tuple(op for op in ENCODER_OPS if op in self.ops)

    def task_count(self) -> int:
        chosen = set(self.providers)
        ops = sum(len(chosen & set(OP_BENCHES[op].providers)) for op in (*self.stem_ops, *self.layer_ops))
        count = ops * len(self.stem_cases) * len(self.hidden_sizes)
        count += len(self.tower_ops) * len(chosen & set(TOWER_PROVIDERS)) * len(self.tower_cases)
        encoder_providers = set(self.encoder_providers) & set(ENCODER_PROVIDERS)
        count += len(self.encoder_ops) * len(encoder_providers) * len(self.encoder_cases)
        return count + (len(LOW_MEMORY_PATHS) * len(LOW_MEMORY_WORKLOADS) if "low_memory" in self.ops else 0)

    def describe(self, device: torch.device) -> list[str]:
        """What the run will do, a line per section that it runs: ops, providers, cases."""
        lines = []
        where = f"at {', '.join(case.name for case in self.stem_cases)}, D {', '.join(map(str, self.hidden_sizes))}"
        for ops in (self.stem_ops, self.layer_ops):
            if ops:
                chosen = [p for p in self.providers if any(p in OP_BENCHES[op].providers for op in ops)]
                lines.append(_section(", ".join(ops), chosen, where))
        tower_cases = f"at {', '.join(case.name for case in self.tower_cases)}"
        for op in self.tower_ops:
            lines.append(_section(op, [p for p in TOWER_PROVIDERS if p in self.providers], tower_cases))
        mixes = f"at {', '.join(Mix(case).name for case in self.encoder_cases)}"
        for op in self.encoder_ops:
            lines.append(_section(op, [p for p in ENCODER_PROVIDERS if p in self.encoder_providers], mixes))
        if "low_memory" in self.ops:
            runs = "each run on an emulated card" if device.type == "cuda" else "computed (running them needs CUDA)"
            lines.append(f"low_memory: vLLM's and the planner's chunks, {runs}")
        return lines


def _section(name: str, providers: list[str], where: str) -> str:
    if not providers:
        return f"{name}: nothing to run, none of its providers is among --providers"
    return f"{name}: {', '.join(providers)} {where}"
