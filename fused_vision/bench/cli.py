"""The bench's command line: ``python -m fused_vision bench`` and ``fused-vision bench``."""

import argparse
import math
import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

from .plan import DEFAULT_TIME_BUDGET_S, OP_GROUPS, OPS, PROVIDERS, Options
from .runner import run
from .workloads import Case


def _name_list(choices: tuple[str, ...], groups: dict[str, tuple[str, ...]]):
    """A parser of comma-separated names, each one of ``choices`` or a group of them."""

    def parse(text: str) -> tuple[str, ...]:
        names: list[str] = []
        for name in filter(None, (part.strip() for part in text.split(","))):
            if name not in choices and name not in groups:
                raise argparse.ArgumentTypeError(f"{name!r}: expected one of {', '.join((*choices, *groups))}")
            names += groups.get(name, (name,))
        if not names:
            raise argparse.ArgumentTypeError(f"{text!r}: expected at least one of {', '.join((*choices, *groups))}")
        return tuple(dict.fromkeys(names))

    return parse


def _case_list(text: str) -> tuple[Case, ...]:
    try:
        return tuple(Case.parse(name.strip()) for name in text.split(",") if name.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated positive integers, e.g. 768,1152")
    return values


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number of seconds, 0 or more")
    return value


DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _device(text: str) -> torch.device:
    try:
        device = torch.device(text)
    except RuntimeError:  # a device type this torch does not know
        raise argparse.ArgumentTypeError(f"{text!r}: the bench runs on cuda or cpu") from None
    if device.type not in ("cuda", "cpu"):
        raise argparse.ArgumentTypeError(f"{text!r}: the bench runs on cuda or cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: this torch sees no CUDA device")
    return device


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fused-vision", description="The Gemma 4 vision stem without the one-hot.")
    commands = parser.add_subparsers(dest="command", required=True)
    bench = commands.add_parser(
        "bench",
        help="benchmark fused_vision against the one-hot and its peers on this device",
        description="Benchmark fused_vision against the one-hot and its peers, and end with a plain summary. "
        "Writes results.csv, low_memory.csv (where the scenario has rows), results.md, time.png, memory.png "
        "(where peaks were measured) and log.txt to --out. Defaults: on a GPU, everything at the checkpoints' "
        "shapes in bf16; on a CPU, fused_vision's PyTorch path (reference) against stock's one-hot and "
        "F.embedding on the stem at one image, the E2B/E4B encoder's stock, packed and fused calls at one "
        "layer, in fp32, and the planner's chunks for the low-memory scenario, computed.",
    )
    bench.set_defaults(command_parser=bench)
    bench.add_argument("--device", type=_device, help="cuda or cpu (default: cuda when available)")
    bench.add_argument(
        "--ops",
        type=_name_list(OPS, {**OP_GROUPS, "all": OPS}),
        help=f"comma-separated: {', '.join(OPS)}; or stem, layer, tower, encoder, all",
    )
    bench.add_argument("--providers", type=_name_list(PROVIDERS, {}), help=f"comma-separated: {', '.join(PROVIDERS)}")
    bench.add_argument(
        "--cases",
        type=_case_list,
        help="comma-separated <image|video>_<items>x<soft tokens>, e.g. video_32x70,image_8x280 (towers and "
        "encoders too; an encoder's image case is a mix of aspect ratios)",
    )
    bench.add_argument(
        "--hidden", type=_int_list, help="comma-separated widths D of the stem and layer ops (default 1152)"
    )
    bench.add_argument(
        "--dtype",
        choices=DTYPES,
        help="weights and activations (default: bfloat16 on a GPU, Gemma 4's checkpoints; float32 on a CPU, "
        "which may emulate bf16 matmuls); pixels stay float32, the low-memory scenario bfloat16",
    )
    bench.add_argument("--out", type=Path, help="results folder (default: fused_vision_bench/<UTC time>-<device>)")
    bench.add_argument("--quick", action="store_true", help="fewer repetitions per measurement")
    bench.add_argument(
        "--tiny",
        action="store_true",
        help="tiny shapes and one-layer towers, to check that the bench runs (with the device's default ops "
        "and providers unless --ops or --providers say otherwise)",
    )
    bench.add_argument(
        "--headline",
        action="store_true",
        help="the rows the project's targets are set on, for a GPU: the forward stem ops and the layer ops at "
        "image_32x280 beside compiled stock, and both encoders (stock, compiled, packed, fused) at image_8x280 "
        "and video_32x70 (--ops, --providers and --cases still choose)",
    )
    bench.add_argument(
        "--profile",
        action="store_true",
        help="also profile one call of every tower and encoder row (torch.profiler): its time by category "
        "(GEMMs, attention, each fused op, copies and casts, elementwise, host gaps), in profile.csv and profile.md",
    )
    defaults = ", ".join(
        f"{seconds:g} on a {'GPU' if device == 'cuda' else 'CPU'}" for device, seconds in DEFAULT_TIME_BUDGET_S.items()
    )
    bench.add_argument(
        "--time-budget",
        type=_seconds,
        metavar="SECONDS",
        help="cap the run: nothing starts that a like call's last duration says would end this long after the "
        "start, so only a first call, whose length nothing predicts, ends later; compiled providers run last, "
        "so they go first "
        f"(default {defaults}; 0: no limit)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unrecognized = parser.parse_known_args(argv)
    if unrecognized:  # the command's own usage, not the top level's
        args.command_parser.error(f"unrecognized arguments: {' '.join(unrecognized)}")
    device = args.device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = args.out or Path("fused_vision_bench") / f"{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{device.type}"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        parser.error(f"--out {out}: {exc.strerror or exc}")
    # python -m and the console script both come here: record the canonical form.
    command = "python -m fused_vision " + shlex.join(sys.argv[1:] if argv is None else argv)
    options = Options(
        device=device,
        out=out,
        ops=args.ops,
        providers=args.providers,
        cases=args.cases,
        hidden_sizes=args.hidden,
        dtype=DTYPES.get(args.dtype),
        quick=args.quick,
        tiny=args.tiny,
        time_budget_s=args.time_budget,
        profile=args.profile,
        headline=args.headline,
        command=command,
    )
    try:
        run(options)
    except KeyboardInterrupt:
        print(f"interrupted: what was measured is written in {out}", file=sys.stderr)
        return 130  # the shell's code for SIGINT
    return 0
