"""Check fused_vision.pipeline.planner's memory model against real forwards of Gemma 4's vision tower.

Builds the 26B/31B vision tower from its config with random weights (nothing is downloaded), runs
forwards for images (280 soft tokens, 2520 patches) and video frames (70 soft tokens, 630 patches)
at several chunk sizes, and compares the peak memory each forward adds with the planner's per-item
transient times the chunk. Every prediction must be an upper bound within 25 % of the measured peak;
the script exits 1 otherwise. On transformers 5.5-5.9 the stock embedder builds the one-hot, so the
predictions take path="onehot", vLLM's price of it, which is meant to over-count: there they are
checked as upper bounds only.

    python bench/planner_check.py                        # CUDA: torch.cuda.max_memory_allocated
    python bench/planner_check.py --device cpu --tiny    # a small tower, live tensors tracked on the CPU

Results go to --out (default bench/out) as planner_check.csv and planner_check.json. Needs
fused_vision importable (``pip install --no-deps --no-build-isolation -e .``) and transformers >= 5.5.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import transformers
from transformers.models.gemma4 import Gemma4VisionConfig, Gemma4VisionModel

from fused_vision.bench.measure import LiveTensorBytes
from fused_vision.bench.tower import VISION_TOWERS
from fused_vision.bench.workloads import PATCH_SIZE, POOLING_KERNEL, POSITION_EMBEDDING_SIZE
from fused_vision.pipeline.encoding import planner_path
from fused_vision.pipeline.planner import transient_bytes_per_item

TOLERANCE = 0.25  # the prediction may exceed the measured peak by at most this fraction

# The released checkpoints' shapes. The tiny tower keeps the real one's ratios (I ≈ 3.7·D, heads·head_dim = D) with a
# patch small enough that, as at full size, the encoder layers rather than the pixel prescale peak.
GEMMA4_26B_31B = dict(
    VISION_TOWERS["tower_26b_31b"],
    position_embedding_size=POSITION_EMBEDDING_SIZE,
    patch_size=PATCH_SIZE,
    pooling_kernel_size=POOLING_KERNEL,
)
TINY = dict(
    hidden_size=96,
    intermediate_size=360,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=24,
    position_embedding_size=64,
    patch_size=4,
    pooling_kernel_size=3,
    use_clipped_linears=False,
    standardize=True,
)
# (kind, soft tokens per item, chunk sizes): full size, then tiny.
CASES = {
    False: [("image", 280, (1, 4, 16)), ("frame", 70, (4, 32))],
    True: [("image", 40, (1, 4, 16)), ("frame", 10, (4, 32))],
}


def vision_config(shape: dict, attn_implementation: str = "sdpa", **overrides) -> Gemma4VisionConfig:
    return Gemma4VisionConfig(**{**shape, **overrides}, attn_implementation=attn_implementation)


def build_model(config: Gemma4VisionConfig, device: torch.device | str, dtype: torch.dtype) -> Gemma4VisionModel:
    """A Gemma4VisionModel with random weights, built directly on ``device``."""
    torch.manual_seed(0)
    with torch.device(device):
        model = Gemma4VisionModel(config)
    return model.to(dtype).eval()


def make_inputs(config: Gemma4VisionConfig, batch: int, soft_tokens: int, device: torch.device | str):
    """Processor-like inputs: float32 pixels in [0, 1] and (x, y) ids, each item padded to N patches.

    The grid of soft tokens leaves part of N unused, as most aspect ratios do, so the tower builds
    its attention mask (the case the planner prices).
    """
    k = config.pooling_kernel_size
    patches = soft_tokens * k * k
    rows = math.isqrt(soft_tokens)
    cols = (soft_tokens - 1) // rows  # rows·cols < soft_tokens
    ys, xs = torch.meshgrid(torch.arange(rows * k), torch.arange(cols * k), indexing="ij")
    position_ids = torch.full((batch, patches, 2), -1, dtype=torch.long)
    position_ids[:, : xs.numel()] = torch.stack([xs.flatten(), ys.flatten()], dim=-1)
    pixel_values = torch.rand(batch, patches, 3 * config.patch_size**2)
    pixel_values[:, xs.numel() :] = 0
    return pixel_values.to(device), position_ids.to(device)


def measure_peak(model, pixel_values: torch.Tensor, position_ids: torch.Tensor) -> int:
    """Bytes one forward adds at its peak over what was allocated before it (weights, inputs)."""
    device = pixel_values.device
    if device.type == "cuda":
        with torch.inference_mode():
            # Warm up: the cuBLAS workspace is allocated once per process, not per forward.
            model(pixel_values=pixel_values, pixel_position_ids=position_ids)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)  # the model's GPU, which need not be the current one
        before = torch.cuda.memory_allocated(device)
        with torch.inference_mode():
            output = model(pixel_values=pixel_values, pixel_position_ids=position_ids)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
        del output
        return peak
    existing = [*model.parameters(), *model.buffers(), pixel_values, position_ids]
    with torch.no_grad(), LiveTensorBytes(existing) as tracker:
        model(pixel_values=pixel_values, pixel_position_ids=position_ids)
    return tracker.peak


@dataclass
class Row:
    kind: str
    path: str
    patches_per_item: int
    items: int
    measured_bytes: int
    predicted_bytes: int

    @property
    def ratio(self) -> float:
        return self.predicted_bytes / self.measured_bytes

    @property
    def ok(self) -> bool:
        bound = self.measured_bytes <= self.predicted_bytes
        return bound and (self.path == "onehot" or self.predicted_bytes <= (1 + TOLERANCE) * self.measured_bytes)


def check(config: Gemma4VisionConfig, cases, device: torch.device, dtype: torch.dtype) -> Iterator[Row]:
    """One row per case and chunk, as each forward is measured."""
    model = build_model(config, device, dtype)
    for kind, soft_tokens, chunks in cases:
        for items in chunks:
            pixel_values, position_ids = make_inputs(config, items, soft_tokens, device)
            path = planner_path(model, [(pixel_values, position_ids)])
            patches = pixel_values.shape[1]
            per_item = transient_bytes_per_item(patches, config, path=path, dtype=dtype)
            measured = measure_peak(model, pixel_values, position_ids)
            yield Row(kind, path, patches, items, measured, per_item * items)


def write_results(rows: list[Row], out_dir: Path, meta: dict) -> None:
    """planner_check.csv and .json, each replaced whole, so an interrupted run leaves no torn file."""
    out_dir.mkdir(parents=True, exist_ok=True)
    records = [{**asdict(row), "ratio": round(row.ratio, 4), "ok": row.ok} for row in rows]
    csv_path, json_path = out_dir / "planner_check.csv", out_dir / "planner_check.json"
    with open(csv_path.with_suffix(".csv.tmp"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows(records)
    json_path.with_suffix(".json.tmp").write_text(json.dumps({**meta, "rows": records}, indent=2) + "\n")
    os.replace(csv_path.with_suffix(".csv.tmp"), csv_path)
    os.replace(json_path.with_suffix(".json.tmp"), json_path)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--tiny", action="store_true", help="a small tower with the real one's proportions")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"), help="attn_implementation")
    default_out = Path(__file__).resolve().parent / "out"
    parser.add_argument("--out", type=Path, default=default_out, help="results directory (default: bench/out)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type not in ("cuda", "cpu"):
        raise SystemExit(f"--device: expected cuda or cpu, got {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (use --device cpu --tiny)")
    dtype = getattr(torch, args.dtype)
    config = vision_config(TINY if args.tiny else GEMMA4_26B_31B, args.attn)
    meta = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "tower": "tiny" if args.tiny else "gemma4-26b/31b",
        "dtype": args.dtype,
        "attn_implementation": args.attn,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    rows = []
    # Each row is printed and the files rewritten as it is measured, should a time box cut the run short.
    for row in check(config, CASES[args.tiny], device, dtype):
        if not rows:
            path = row.path
            standard = "upper bounds" if path == "onehot" else f"upper bounds within {TOLERANCE:.0%}"
            meta |= {"path": path, "tolerance": None if path == "onehot" else TOLERANCE}
            print(f"path={path}: predictions must be {standard} of the measured peaks")
            print(f"{'kind':<6} {'N':>5} {'items':>5} {'measured MiB':>13} {'predicted MiB':>14} {'ratio':>6}")
        print(
            f"{row.kind:<6} {row.patches_per_item:>5} {row.items:>5} {row.measured_bytes / 2**20:>13.1f} "
            f"{row.predicted_bytes / 2**20:>14.1f} {row.ratio:>6.3f}{'' if row.ok else '  FAIL'}",
            flush=True,
        )
        rows.append(row)
        write_results(rows, args.out, meta)
    failed = [row for row in rows if not row.ok]
    if failed:
        print(f"{len(failed)} of {len(rows)} predictions are not {standard}", file=sys.stderr)
        return 1
    print(f"all {len(rows)} predictions are {standard}; results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
