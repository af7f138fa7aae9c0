"""Every attention path of the packed encoder that this machine has, at the towers' cases: its median time,
its rate against the measured matmul ceiling, and its error against float64 beside sdpa's (bench/gpu_run.sh's
attention step). What it finds is the rule per device in docs/encoders.md ("Attention paths").

    python bench/tools/attention_paths.py [--tiny] [--device cpu] [--out DIR]

One layer's attention: (T, H, d) queries, keys and values of the case's items, packed, scale d**-0.5 as the
towers'. The error is on the first item (float64 on every item of image_8x1120 would need ~100 GB): the
relative Frobenius error of the path's output against float64 attention of the same bf16 inputs.
FLOPs: 4 * H * d * sum(L**2) per call (QK^T and PV).
"""

import argparse
import itertools
from pathlib import Path

import torch

from fused_vision.bench.measure import Budget, matmul_ceiling, time_call
from fused_vision.bench.tower import VISION_TOWERS
from fused_vision.bench.workloads import TINY_CASES, Case
from fused_vision.encoder import varlen

CASES = ("image_8x280", "video_32x70", "image_8x1120")
TOWERS = ("tower_26b_31b", "tower_e2b_e4b")  # the 26B/31B tower first: the headline
TINY_HEADS = 2  # --tiny: two heads of each tower's head_dim


def packed_inputs(case: Case, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
    lengths = [case.patches_per_item] * case.items
    generator = torch.Generator().manual_seed(0)
    states = [torch.randn(case.patches, heads, head_dim, generator=generator).to(device, dtype) for _ in range(3)]
    offsets = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
    return states, offsets, lengths


def first_item_error(output: torch.Tensor, states, length: int, scale: float) -> float:
    query, key, value = (t[:length].double().transpose(0, 1) for t in states)  # (H, L, d)
    exact = torch.softmax(query @ key.transpose(1, 2) * scale, dim=-1) @ value
    got = output[:length].double().transpose(0, 1)
    return ((got - exact).norm() / exact.norm()).item()


def case_rows(tower, case, heads, head_dim, dtype, device, budget, matmul_tflops) -> list[str]:
    """One row per path this machine has, sdpa's error measured first as every row's yardstick."""
    states, offsets, lengths = packed_inputs(case, heads, head_dim, dtype, device)
    scale, longest = head_dim**-0.5, max(lengths)
    flops = 4 * heads * head_dim * sum(length**2 for length in lengths)
    rows, sdpa_error = [], None
    for path in ("sdpa", *(name for name in varlen.PATHS if name != "sdpa")):
        if not varlen.usable(path, states[0]):
            continue
        call = lambda path=path: varlen.varlen_attention(*states, offsets, lengths, longest, scale=scale, path=path)
        try:
            error = first_item_error(call(), states, lengths[0], scale)
            ms = time_call(call, device, budget).p50
        except Exception as exc:  # a kernel that refuses the shape is a finding, not the end of the run
            rows.append(f"| {tower} | {case.name} | {path} | failed: {type(exc).__name__}: {exc} |||||")
            print(rows[-1], flush=True)
            continue
        sdpa_error = error if path == "sdpa" else sdpa_error
        tflops = flops / ms / 1e9
        yardstick = "-" if sdpa_error is None else f"{sdpa_error:.2e}"
        rows.append(
            f"| {tower} | {case.name} | {path} | {ms:.4g} | {tflops:.3g} | {100 * tflops / matmul_tflops:.0f} "
            f"| {error:.2e} | {yardstick} |"
        )
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="a tiny case with two heads, to check that this runs")
    parser.add_argument("--out", type=Path, help="also write the table to DIR/attention_paths.md")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    budget = Budget(warmup_ms=25, rep_ms=100 if device.type == "cuda" else 20)
    cases = TINY_CASES[:1] if args.tiny else tuple(Case.parse(name) for name in CASES)
    matmul = matmul_ceiling(device, 8192 if device.type == "cuda" else 256, dtype, budget)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = [
        f"{name}, torch {torch.__version__}, {dtype}; matmul ceiling {matmul.tflops:.1f} TFLOP/s",
        "",
        "| tower | case | path | median ms | TFLOP/s | % of matmul | error vs fp64 | sdpa's error |",
        "|---|---|---|--:|--:|--:|--:|--:|",
    ]
    print("\n".join(lines), flush=True)
    try:
        for tower in TOWERS:
            shape = VISION_TOWERS[tower]
            heads, head_dim = TINY_HEADS if args.tiny else shape["num_attention_heads"], shape["head_dim"]
            for case in cases:
                lines += case_rows(tower, case, heads, head_dim, dtype, device, budget, matmul.tflops)
    except KeyboardInterrupt:  # the step's time box: keep what was measured
        lines.append("(interrupted)")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "attention_paths.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
