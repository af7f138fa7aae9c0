"""The benchmark end to end at tiny shapes, and its byte models against hand counts.

On a CPU the fused providers run in Triton's interpreter (conftest sets TRITON_INTERPRET=1): their rows are
correctness runs, with no peak or rates, compared with nothing. On a GPU the same tests run the CUDA paths:
their peaks, and the low-memory scenario on its emulated card.
"""

import math
import signal
import subprocess
import sys

import pytest
import torch

from fused_vision.bench import Case, plan, report, runner
from fused_vision.bench.cli import main
from fused_vision.bench.encoder import ENCODER_TOWERS
from fused_vision.bench.layer_ops import LAYER_OPS
from fused_vision.bench.ops import (
    STEM_OPS,
    PatchEmbed,
    PatchEmbedBackward,
    PoolByPositions,
    PoolByPositionsBackward,
    PositionEmbeddings,
    PositionEmbeddingsBackward,
)
from fused_vision.bench.rows import COLUMNS, ENVIRONMENT_COLUMNS, LOW_MEMORY_COLUMNS, TEXT_COLUMNS
from fused_vision.bench.workloads import GPU_CASES, position_ids, soft_token_grid

from bench_cli import read_csv, reliable, run_cli
from helpers import DEVICE, TIME_BOXED

REQUIRED_COLUMNS = (
    "op", "provider", "case", "B", "N", "D", "dtype", "ms_p50", "ms_p20", "ms_p80", "peak_bytes", "model_bytes",
    "gbps", "pct_of_copy", "gpu", "torch", "triton", "transformers", "fused_vision",
)  # fmt: skip
TOWERS = ("tower_e2b_e4b", "tower_26b_31b")


def test_every_op_and_provider_reports_through_the_cli(tmp_path):
    out = run_cli(tmp_path, "--ops", "all", "--providers", "onehot,embedding,fused,fused_kernel")

    columns, rows = read_csv(out / "results.csv")
    assert columns == COLUMNS
    assert set(REQUIRED_COLUMNS) <= set(columns)
    measured = {(row["op"], row["provider"]) for row in rows}
    expected = {("copy", "torch"), ("matmul", "torch")}
    expected |= {
        (op, p)
        for op in ("position_embeddings", "patch_embed")
        for p in ("onehot", "embedding", "fused", "fused_kernel")
    }
    expected |= {("pool_by_positions", p) for p in ("onehot", "fused", "fused_kernel")}
    expected |= {
        (op, p)
        for op in ("position_embeddings_backward", "patch_embed_backward")
        for p in ("onehot", "embedding", "fused")
    }
    expected |= {("pool_by_positions_backward", p) for p in ("onehot", "fused")}
    # float32 has no GEMM kernel of its own: cuBLAS and the gate kernel
    expected |= {(op, p) for op in LAYER_OPS for p in ("fused", "fused_kernel")} - {("gate_up_gelu", "fused_kernel")}
    expected |= {(tower, p) for tower in TOWERS for p in ("onehot", "embedding", "fused")}
    expected |= {(encoder, "fused") for encoder in ENCODER_TOWERS}
    assert measured == expected

    ceilings = {row["op"]: row for row in rows if row["op"] in report.CEILING_OPS}
    interpreted = DEVICE.type == "cpu"  # a CPU runs Triton only in its interpreter
    for row in rows:
        for column in set(columns) - TEXT_COLUMNS - set(ENVIRONMENT_COLUMNS):
            if row[column]:
                value = float(row[column])
                assert math.isfinite(value) and value > 0, f"{row['op']}/{row['provider']}: {column} = {row[column]}"
        assert float(row["ms_p20"]) <= float(row["ms_p50"]) <= float(row["ms_p80"]) and int(row["reps"]) >= 1
        triton = row["provider"] in ("fused", "fused_kernel") and row["op"] not in ENCODER_TOWERS
        correctness = triton and interpreted
        assert row["timing"] == ("correctness" if correctness else "speed"), (row["op"], row["provider"])
        if row["op"] not in report.CEILING_OPS:
            assert bool(row["peak_bytes"]) == (not correctness), "a peak for every timed call, on a CPU too"
            assert bool(row["peak_requested_bytes"]) == (DEVICE.type == "cuda"), "a count CUDA's allocator keeps"
        if row["op"] in (*STEM_OPS, *LAYER_OPS):
            assert row["model_bytes"]
            assert bool(row["gbps"]) == (not correctness), "no rate from an interpreter's time"
            assert bool(row["pct_of_copy"]) == (not correctness and reliable(ceilings["copy"]))
            both = reliable(ceilings["copy"]) and (
                row["op"] not in ("patch_embed", "patch_embed_backward") or reliable(ceilings["matmul"])
            )
            assert bool(row["floor_ms"]) == (not correctness and both), "a floor only on reliable ceilings"
        if row["op"] in ("patch_embed", "patch_embed_backward") and not correctness:
            assert bool(row["pct_of_matmul"]) == reliable(ceilings["matmul"])

    markdown = (out / "results.md").read_text()
    assert "### tower_26b_31b" in markdown
    if interpreted:
        assert "| onehot | embedding | fused | fused_kernel |" in markdown and "onehot / fused" not in markdown
        assert "(interpreter: correctness run)" in markdown and "### targets" not in markdown
    else:
        assert "| onehot | embedding | fused | fused_kernel | onehot / fused |" in markdown
        assert "| patch_embed ≥ 4× faster than embedding | image_2x4 | 64 | fused |" in markdown
    assert (out / "time.png").read_bytes().startswith(b"\x89PNG")
    log = (out / "log.txt").read_text()
    assert "fused vs onehot output: max |diff|" in log, "the towers compare their outputs"
    columns, rows = read_csv(out / "low_memory.csv")
    assert columns == LOW_MEMORY_COLUMNS
    chunks = sorted((row["path"], row["case"], int(row["chunk"])) for row in rows)
    if DEVICE.type == "cuda":
        assert [chunk[:2] for chunk in chunks] == [
            ("fused", "image_64x280"), ("fused", "video_128x70"), ("onehot", "image_64x280"), ("onehot", "video_128x70")
        ]  # fmt: skip
        assert all(row["status"] == "ok" and float(row["items_per_s"]) > 0 for row in rows)
    else:  # vLLM's and the planner's chunks for the real 26B/31B tower, computed: no CUDA device runs them
        expected = [("fused", "image_64x280", 16), ("fused", "video_128x70", 67)]
        expected += [("onehot", "image_64x280", 1), ("onehot", "video_128x70", 7)]
        assert chunks == expected
        assert all(row["status"].startswith("computed, not run") and not row["items_per_s"] for row in rows)


def test_compiled_provider(tmp_path):
    out = run_cli(tmp_path, "--ops", "position_embeddings", "--providers", "compiled")
    _, rows = read_csv(out / "results.csv")
    measured = [(row["op"], row["provider"]) for row in rows]
    assert measured == [("copy", "torch"), ("matmul", "torch"), ("position_embeddings", "compiled")]
    assert "first call" in (out / "log.txt").read_text()


def test_compiled_providers_run_last_the_embedder_first(tmp_path, monkeypatch):
    """Past the time budget a run loses compiled rows first, and of those the embedder's at the target case
    (its target) last. The eager stem ops also start at the target case, whose first calls tune the tiles."""
    sections, compiled_cases, eager_cases = [], [], []

    def bench_stem(session, ops, providers, cases, hidden_sizes):
        sections.append((providers, ops))
        if providers == ("compiled",):
            compiled_cases.extend((case.name, hidden) for hidden in hidden_sizes for case in cases)
        else:
            eager_cases.extend(case.name for case in cases)

    monkeypatch.setattr(runner, "bench_stem", bench_stem)
    monkeypatch.setattr(runner, "bench_tower", lambda session, op, *_: sections.append(op))
    ops = ("position_embeddings", "pool_by_positions", "patch_embed", "tower_e2b_e4b")
    options = plan.Options(
        device=DEVICE,
        out=tmp_path,
        ops=ops,
        providers=("onehot", "compiled", "fused"),
        cases=GPU_CASES,
        hidden_sizes=(768, 1152),
    )
    chosen = plan.Plan.of(options)
    runner.run_sections(runner.Session(options, runner.Log(tmp_path / "log.txt"), chosen), chosen)
    assert sections == [
        (("onehot", "fused"), ("position_embeddings", "patch_embed", "pool_by_positions")),
        "tower_e2b_e4b",
        (("compiled",), ("patch_embed", "position_embeddings", "pool_by_positions")),
    ]
    assert compiled_cases[0] == ("image_32x280", 1152)
    assert eager_cases == ["image_32x280", "video_32x70", "image_8x280", "image_8x1120"]
    assert sorted(compiled_cases) == sorted((case.name, hidden) for hidden in (768, 1152) for case in GPU_CASES)


def test_time_budget_skips_what_would_start_late(tmp_path):
    out = run_cli(tmp_path, "--ops", "position_embeddings,pool_by_positions,tower_e2b_e4b", "--time-budget", "1e-9")
    _, rows = read_csv(out / "results.csv")
    assert {row["op"] for row in rows} == {"copy", "matmul"}
    assert "past the time budget" in (out / "results.md").read_text()
    assert "building the tower" not in (out / "log.txt").read_text(), "no tower is built once out of time"


def test_a_failing_section_still_writes_the_other_results(tmp_path, monkeypatch):
    def broken_tower(*args):
        raise RuntimeError("planted failure")

    monkeypatch.setattr(runner, "bench_tower", broken_tower)
    with pytest.raises(RuntimeError, match="sections stopped by errors: tower_e2b_e4b"):
        run_cli(tmp_path, "--ops", "position_embeddings,tower_e2b_e4b", "--providers", "embedding")
    _, rows = read_csv(tmp_path / "bench" / "results.csv")
    assert ("position_embeddings", "embedding") in {(row["op"], row["provider"]) for row in rows}
    assert "RuntimeError: planted failure" in (tmp_path / "bench" / "log.txt").read_text()


def test_an_interrupted_run_writes_what_it_measured(tmp_path, monkeypatch, capsys):
    """A time box's SIGINT (KeyboardInterrupt) mid-run: the rows so far reach the reports, exit code 130."""

    def interrupted_tower(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "bench_tower", interrupted_tower)
    sigint_handler = signal.getsignal(signal.SIGINT)
    out = tmp_path / "bench"
    args = [
        "--ops",
        "position_embeddings,tower_e2b_e4b,pool_by_positions",
        "--providers",
        "embedding,onehot",
        "--out",
        str(out),
    ]
    assert main(["bench", "--device", DEVICE.type, "--tiny", "--quick", *args]) == 130
    _, rows = read_csv(out / "results.csv")
    assert [(row["op"], row["provider"]) for row in rows] == [
        ("copy", "torch"),
        ("matmul", "torch"),
        ("position_embeddings", "onehot"),
        ("position_embeddings", "embedding"),
        ("pool_by_positions", "onehot"),
    ]  # fmt: skip
    assert "**Interrupted** after 3 of 5 measurements." in (out / "results.md").read_text()
    assert "interrupted: writing the reports" in (out / "log.txt").read_text()
    assert f"interrupted: what was measured is written in {out}" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGINT) is sigint_handler, "Ctrl-C works as before afterwards"


def test_sigint_mid_run_writes_the_reports(tmp_path):
    """What a time box does to the bench (bench/gpu_run.sh's ``timeout``): a real SIGINT mid-run."""
    out = tmp_path / "bench"
    # Time-boxed as gpu_run.sh runs it; ``timeout`` passes on the signal it gets. The device's default cases (not
    # --tiny): 20 measurements of ~0.5 s on a CPU, so the signal lands mid-run.
    command = [*TIME_BOXED, sys.executable, "-m", "fused_vision"]
    command += ["bench", "--device", DEVICE.type, "--quick", "--hidden", "64", "--ops", "stem"]
    command += ["--providers", "onehot,embedding", "--out", str(out)]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in child.stdout:
        if line.lstrip("[ ").startswith("1/"):  # the first measurement's progress line: "[ 1/20] ..."
            child.send_signal(signal.SIGINT)
            break
    output = child.stdout.read()
    assert child.wait(timeout=120) == 130, output
    _, rows = read_csv(out / "results.csv")
    measured = [(row["op"], row["provider"]) for row in rows]
    assert measured[:3] == [("copy", "torch"), ("matmul", "torch"), ("position_embeddings", "onehot")]
    assert "**Interrupted** after" in (out / "results.md").read_text()


def test_the_dtype_follows_the_device_unless_given(tmp_path):
    """bf16 on a GPU (the checkpoints'); fp32 on a CPU, which may emulate bf16 matmuls 50x slower."""

    def dtype(device, dtype=None):
        return plan.Plan.of(plan.Options(device=torch.device(device), out=tmp_path, dtype=dtype)).dtype

    assert dtype("cuda") == torch.bfloat16 and dtype("cpu") == torch.float32
    assert dtype("cpu", torch.float16) == torch.float16 and dtype("cuda", torch.float32) == torch.float32
    out = run_cli(tmp_path, "--ops", "position_embeddings", "--providers", "embedding", "--dtype", "float16")
    _, rows = read_csv(out / "results.csv")
    assert [(row["op"], row["dtype"]) for row in rows] == [
        ("copy", "float32"),
        ("matmul", "float16"),
        ("position_embeddings", "float16"),
    ]


def test_bad_arguments_are_usage_errors(capsys):
    bad = {
        ("--ops", "position_embeddings,nope"): "'nope': expected one of",
        ("--providers", "onehot,magic"): "'magic': expected one of",
        ("--providers", ","): "',': expected at least one of",
        ("--ops", ""): "'': expected at least one of",
        ("--cases", "image_8"): "image_<items>x<soft tokens>",
        ("--device", "meta"): "'meta': the bench runs on cuda or cpu",
        ("--device", "tpu"): "'tpu': the bench runs on cuda or cpu",  # a device type torch does not know
        ("--hidden", "0"): "'0': expected comma-separated positive integers",
        ("--hidden", "768,-8"): "'768,-8': expected comma-separated positive integers",
        ("--time-budget", "-1"): "'-1': expected a number of seconds, 0 or more",
        ("--time-budget", "nan"): "'nan': expected a number of seconds",
        ("--out", "/dev/null/results"): "--out /dev/null/results: Not a directory",
    }
    if not torch.cuda.is_available():
        bad["--device", "cuda"] = "'cuda': this torch sees no CUDA device"
    for args, message in bad.items():
        with pytest.raises(SystemExit) as exit_info:
            main(["bench", *args])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err, args


def test_module_entry_point():
    result = subprocess.run([sys.executable, "-m", "fused_vision", "bench", "--help"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "--time-budget" in result.stdout


def test_cases_and_their_layout():
    case = Case.parse("video_32x70")
    assert (case.kind, case.items, case.soft_tokens) == ("video", 32, 70)
    assert (case.patches_per_item, case.patches) == (630, 20160)
    assert [soft_token_grid(tokens) for tokens in (70, 280, 1120)] == [(6, 11), (12, 23), (25, 44)]
    ids = position_ids(Case.parse("image_2x280"), torch.device("cpu"))
    assert ids.shape == (2, 2520, 2)
    assert int((ids == -1).all(dim=-1).sum()) == 2 * (280 - 276) * 9
    assert ids[0, :69].tolist() == [[x, 0] for x in range(69)] and ids[0, 69].tolist() == [0, 1]  # x fastest
    for name in ("image_0x280", "audio_1x70", "image_8"):
        with pytest.raises(ValueError, match="expected image_<items>x<soft tokens>"):
            Case.parse(name)


def test_byte_models_match_hand_counts():
    """One 70-token frame at D=1152, bf16: 18 x 33 patches, 36 padding; 33 distinct x and 18 distinct y rows."""
    case, cpu = Case.parse("video_1x70"), torch.device("cpu")
    patches, ids_and_padding, row = 630, 630 * (2 * 8 + 1), 1152 * 2
    lookup = ids_and_padding + (33 + 18) * row + patches * row
    assert PositionEmbeddings(case, 1152, torch.bfloat16, cpu).model_bytes == lookup == 1_579_734

    patch_embed = PatchEmbed(case, 1152, torch.bfloat16, cpu)
    assert patch_embed.model_bytes == 630 * 768 * 4 + 1152 * 768 * 2 + lookup == 5_284_566
    assert patch_embed.flops == 2 * 630 * 768 * 1152

    pooled = 70 * (1152 * 4 + 1)  # float32 (L, D) and the (L,) mask
    assert (
        PoolByPositions(case, 1152, torch.bfloat16, cpu).model_bytes
        == patches * row + ids_and_padding + pooled
        == 1_784_860
    )

    table_grad = 2 * 10240 * row
    lookup_backward = patches * row + ids_and_padding + table_grad
    assert PositionEmbeddingsBackward(case, 1152, torch.bfloat16, cpu).model_bytes == lookup_backward
    weight_grad = 1152 * 768 * 2
    patch_embed_backward = PatchEmbedBackward(case, 1152, torch.bfloat16, cpu)
    assert patch_embed_backward.model_bytes == 630 * 768 * 4 + weight_grad + lookup_backward
    assert patch_embed_backward.flops == 2 * 630 * 768 * 1152
    pooled_grad = 70 * 1152 * 4
    assert (
        PoolByPositionsBackward(case, 1152, torch.bfloat16, cpu).model_bytes
        == pooled_grad + ids_and_padding + patches * row
    )
