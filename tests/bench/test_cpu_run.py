"""What `python -m fused_vision bench` runs by device: on a CPU, fused_vision's PyTorch path against stock with
measured peaks, the packed and fused encoders, the planner's chunks, and the plain summary it ends with; on a
GPU, what it ran before."""

import re

import pytest
import torch

import fused_vision
from fused_vision import reference
from fused_vision.bench import Case, plan, summary
from fused_vision.bench.measure import cpu_allocator_peak
from fused_vision.bench.ops import STEM_OPS
from fused_vision.bench.text import significant
from fused_vision.bench.workloads import GPU_CASES, GPU_ENCODER_CASES, pixel_values, position_ids

from bench_cli import read_csv, run_cli
from helpers import DEVICE

CPU = torch.device("cpu")
MB = 10**6


def test_the_defaults_by_device(tmp_path):
    def default(device):
        return plan.Plan.of(plan.Options(device=torch.device(device), out=tmp_path))

    cpu, gpu = default("cpu"), default("cuda")
    assert cpu.ops == ("position_embeddings", "patch_embed", "pool_by_positions", "encoder_e2b_e4b", "low_memory")
    assert cpu.providers == ("onehot", "embedding", "reference") and cpu.encoder_providers == (
        "stock",
        "packed",
        "fused",
    )
    assert [case.name for case in cpu.stem_cases] == ["image_1x280"] and cpu.dtype == torch.float32
    gpu_providers = ("stock", "onehot", "embedding", "compiled", "fused", "fused_kernel", "separate")
    gpu_providers += ("padded", "packed", "graphed")
    assert gpu.ops == plan.OPS and gpu.providers == gpu.encoder_providers == gpu_providers, "a GPU runs as before"
    assert gpu.stem_cases == GPU_CASES and gpu.encoder_cases == GPU_ENCODER_CASES and gpu.dtype == torch.bfloat16


@pytest.mark.parametrize("op", list(STEM_OPS))
def test_the_reference_provider_computes_stocks_result(op):
    torch.manual_seed(0)
    bench = STEM_OPS[op](Case.parse("image_2x4"), 64, torch.float32, CPU)
    expected = bench.call("onehot")()
    actual = bench.call("reference")()
    for got, want in zip(*(o if isinstance(o, tuple) else (o,) for o in (actual, expected))):
        if got is not None:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=f"{op} reference")


def test_the_cpu_peak_counts_the_calls_own_blocks_at_their_most():
    size = 4 * MB

    def two_temporaries_in_turn():
        first = torch.ones(size, dtype=torch.uint8)
        del first
        return torch.ones(size, dtype=torch.uint8)

    peak, result = cpu_allocator_peak(two_temporaries_in_turn)
    assert result.numel() == size and size <= peak.allocated < size + 64 * 1024 and peak.requested is None
    peak, _ = cpu_allocator_peak(lambda: torch.ones(size, dtype=torch.uint8).sum())
    assert peak.allocated >= 8 * size, "the int64 copy the sum of uint8 makes inside its kernel"
    held = [torch.ones(8 * MB, dtype=torch.uint8)]
    peak, _ = cpu_allocator_peak(lambda: (held.pop(), torch.ones(size, dtype=torch.uint8))[1])
    assert size <= peak.allocated < size + 64 * 1024, "an earlier block's free neither counts nor discounts"


def test_the_cpu_peak_sees_inside_fused_visions_registered_op():
    """Through the dispatcher (as under autograd or a tracer) the op runs as one registered op: its two gathers,
    alive at once before their sum, still count."""
    ids = position_ids(Case.parse("image_1x70"), CPU)
    padding, table = reference.default_padding_positions(ids), torch.randn(2, 10240, 64)
    output_bytes = ids.shape[1] * 64 * 4
    op = torch.ops.fused_vision.position_embeddings
    peak, output = cpu_allocator_peak(lambda: op(table, ids, padding, None, "reference"))
    assert output.shape == (1, 630, 64) and peak.allocated >= 3 * output_bytes, "two gathers and their sum"


def test_the_one_hot_lookups_peak_is_its_int64_one_hot_and_float_copy():
    ids = position_ids(Case.parse("image_1x70"), CPU)
    padding, table = reference.default_padding_positions(ids), torch.randn(2, 10240, 64)
    stock, _ = cpu_allocator_peak(lambda: reference.onehot_position_embeddings(table, ids, padding))
    ours, _ = cpu_allocator_peak(lambda: fused_vision.position_embeddings(table, ids, padding, backend="reference"))
    one_hot = 630 * 2 * 10240 * 8
    assert stock.allocated >= one_hot * 3 // 2, "the (N, 2, P) int64 one-hot and its float32 copy, alive at once"
    assert ours.allocated < 630 * 64 * 4 * 4, "a few (N, D) tensors"
    pixels = pixel_values(ids)
    assert pixels.shape == (1, 630, 768)


def summary_row(op, provider, ms, peak=None, timing="speed", case="image_1x280", **fields):
    row = dict(op=op, provider=provider, case=case, B=1, N=2520, D=1152, dtype="float32", ms_p50=ms)
    return row | dict(peak_bytes=peak, timing=timing) | fields


def test_the_summarys_stem_lines_compare_fused_visions_timed_row_with_stock():
    rows = [
        summary_row("position_embeddings", "onehot", 3000.0, peak=619 * MB),
        summary_row("position_embeddings", "embedding", 26.0, peak=35 * MB),
        summary_row("position_embeddings", "reference", 27.0, peak=35 * MB),
        summary_row("position_embeddings", "fused", 5000.0, timing="correctness"),
        summary_row("pool_by_positions", "onehot", 90.0, peak=60 * MB),
        summary_row("pool_by_positions", "reference", 3.0, peak=20 * MB),
        summary_row("patch_embed", "embedding", 150.0),  # no one-hot to compare with: no line
    ]
    lines = summary.stem_lines([row for row in rows if row["timing"] == "speed"])
    assert lines == [
        "position_embeddings at image_1x280, D=1152: fused_vision (reference) 27.0 ms, 111× faster than the one-hot "
        "(transformers 5.5-5.9) (3,000 ms), 1.04× slower than F.embedding (transformers 5.10+) (26.0 ms); "
        "peak 35.0 MB, 18× smaller than the one-hot's 619 MB",
        "pool_by_positions at image_1x280, D=1152: fused_vision (reference) 3.00 ms, 30× faster than the one-hot "
        "(transformers 5.5-5.9) (90.0 ms); peak 20.0 MB, 3.00× smaller than the one-hot's 60.0 MB",
    ]


def test_the_summarys_planner_and_unmeasured_lines():
    rows = [
        dict(workload="64 images", path=path, chunk=chunk, status="computed", free_bytes=3 * 2**30)
        | dict(emulated_total_bytes=22 * 2**30)
        for path, chunk in (("onehot", 1), ("fused", 16))
    ]
    assert summary.planner_lines(rows) == [
        "low-memory scenario (26B/31B tower, bf16, 3 GiB free of 22 GiB), items per call: 64 images: vLLM's chunk 1, "
        "the planner's 16 (computed)"
    ]
    skipped = [dict(reason="past the time budget of 160 s"), dict(reason="OutOfMemoryError: ...")]
    session = type("Session", (), dict(options=plan.Options(device=CPU, out=None), skipped=skipped))()
    lines = summary.not_measured_lines(session)
    assert lines[0].startswith("not measured on a CPU: the Triton kernels' speed") and "bench/results/h200/" in lines[0]
    assert lines[1] == "skipped: 2 measurements, 1 of them past the time budget; results.md lists each and why"
    session.options = plan.Options(device=torch.device("cuda"), out=None)
    assert not summary.not_measured_lines(session)[0].startswith("not measured on a CPU")


def test_a_run_ends_with_its_summary_from_its_own_rows(tmp_path):
    ops = "position_embeddings,patch_embed,pool_by_positions,encoder_e2b_e4b,low_memory"
    providers = "onehot,embedding,reference,fused,stock,packed"
    out = run_cli(tmp_path, "--ops", ops, "--providers", providers, "--cases", "image_2x4,image_1x70")
    log = (out / "log.txt").read_text().splitlines()
    start = next(index for index, line in enumerate(log) if line.startswith("summary: "))
    lines = log[start:-1]
    assert log[-1].startswith("wrote results.csv, low_memory.csv, results.md") and "s of CPU time)" in log[-1]
    _, rows = read_csv(out / "results.csv")
    ours = "fused" if DEVICE.type == "cuda" else "reference"  # a CPU's fused rows are correctness runs
    timed = {
        (row["op"], row["provider"], row["case"]): float(row["ms_p50"]) for row in rows if row["timing"] == "speed"
    }
    for op in ("position_embeddings", "patch_embed", "pool_by_positions"):
        ratio = timed[op, "onehot", "image_1x70"] / timed[op, ours, "image_1x70"]  # the larger case
        shown = ratio if ratio >= 1 else 1 / ratio
        word = "faster" if ratio >= 1 else "slower"
        better = f"{significant(shown, 2 if shown >= 10 else 3)}× {word}"
        line = next(line for line in lines if f"- {op} at image_1x70, D=64: fused_vision ({ours})" in line)
        assert f"{better} than the one-hot" in line and "peak " in line
    encoder = next(line for line in lines if line.startswith("  - encoder_e2b_e4b at image_mix_"))
    assert re.search(r"packed \d[\d.,]*× (faster|slower), peak \d[\d.,]*× (smaller|larger); fused ", encoder)
    chunks = "64 images x 280 tokens: vLLM's chunk 1, the planner's 16; 4 videos x 32 frames x 70 tokens: vLLM's chunk"
    assert any(chunks in line for line in lines)
    assert any(line.startswith("  - not measured on a CPU") for line in lines) == (DEVICE.type == "cpu")
    markdown = (out / "results.md").read_text()
    assert "### summary" in markdown and lines[1].removeprefix("  ") in markdown
