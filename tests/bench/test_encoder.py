"""The encoder section: stock, padded and packed calls on processor mixes, interleaved, in items/s and peaks."""

import sys

import pytest
import torch

from fused_vision.__main__ import _parser
from fused_vision.bench import Case, encoder, plan, runner
from fused_vision.bench.targets import ENCODER_TARGETS

from bench_cli import read_csv, run_cli
from conftest import DEVICE

EAGER = ("stock", "padded", "packed")
MIXES = ("image_mix_7x280", "video_32x70")


def test_a_tiny_run_interleaves_the_providers_and_reports_items_per_second(tmp_path, monkeypatch):
    calls = []

    def recorded_call(provider, *args):
        call = real_provider_call(provider, *args)

        def record():
            calls.append(provider)
            return call()

        return record

    real_provider_call = encoder.provider_call
    monkeypatch.setattr(encoder, "provider_call", recorded_call)
    monkeypatch.setitem(encoder.QUICK_REPS, DEVICE.type, 2)  # two rounds tell interleaved from one after another
    out = run_cli(tmp_path, "--ops", "encoder_e2b_e4b")

    first_calls = 2 if DEVICE.type == "cuda" else 1  # a GPU's warm-up, then the peak's call
    per_mix = [p for p in EAGER for _ in range(first_calls)] + [*EAGER, *EAGER]
    assert calls == per_mix * len(MIXES)
    _, rows = read_csv(out / "results.csv")
    rows = {(row["case"], row["provider"]): row for row in rows if row["op"] == "encoder_e2b_e4b"}
    assert sorted(rows) == sorted((mix, provider) for mix in MIXES for provider in EAGER)
    shapes = {"image_mix_7x280": ("7", "2520"), "video_32x70": ("32", "630")}  # (B, N)
    for (mix, _), row in rows.items():
        assert float(row["items_per_s"]) > 0 and int(row["peak_bytes"]) > 0 and int(row["output_bytes"]) > 0
        assert float(row["ms_p20"]) <= float(row["ms_p50"]) <= float(row["ms_p80"])
        assert (row["B"], row["N"]) == shapes[mix] and (row["D"], row["layers"]) == ("64", "1")  # the tiny tower
    assert rows["image_mix_7x280", "stock"]["real_patches"] == str(2394 * 2 + 2376 * 2 + 2304 + 2268 * 2)

    markdown = (out / "results.md").read_text()
    assert "| case | items | real patches | stock | padded | packed | packed / stock | packed / padded |" in markdown
    image = rows["image_mix_7x280", "packed"], rows["image_mix_7x280", "stock"], rows["image_mix_7x280", "padded"]
    ratios = [float(image[0]["items_per_s"]) / float(other["items_per_s"]) for other in image[1:]]
    line = next(line for line in markdown.splitlines() if line.startswith("| image_mix_7x280 | 7 | 92.9% |"))
    assert line.endswith(f"| {ratios[0]:.2f}× | {ratios[1]:.2f}× |")
    assert "tower_e2b_e4b with 1 of its 16 layers (--tiny)." in markdown
    target = ENCODER_TARGETS[DEVICE.type]
    assert f"Target ({target.device}): {target.goal}: " in markdown
    log = (out / "log.txt").read_text()
    assert "image_mix_7x280: 7 items of N=2520 patches, 92.9% real" in log
    assert "packed vs stock output: max |diff|" in log


def test_a_missing_processor_is_a_logged_skip(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "PIL", None)  # Pillow not installed: importing it raises ImportError
    out = run_cli(tmp_path, "--ops", "encoder_e2b_e4b")
    _, rows = read_csv(out / "results.csv")
    assert {row["op"] for row in rows} == {"copy", "matmul"}
    reason = "needs transformers' Gemma4ImageProcessorPil and Pillow"
    skipped = (out / "results.md").read_text()
    assert all(f"- encoder_e2b_e4b · {p} · {MIXES[0]} (D=64), {MIXES[1]} (D=64): {reason}" in skipped for p in EAGER)
    assert "building tower_e2b_e4b" not in (out / "log.txt").read_text(), "no tower without inputs"


def test_the_mixes_are_the_processors_aspect_ratios_with_padding():
    """Each item keeps its aspect ratio within the processor's grid of 3x3 pooling cells, and is padded to N."""
    image = encoder.Mix(Case.parse("image_7x280"))
    assert image.name == "image_mix_7x280" and image.aspect_ratios == list(encoder.ASPECT_RATIOS)
    pixels, ids = image.inputs(torch.device("cpu"))
    assert pixels.shape == (7, 2520, 768) and pixels.dtype == torch.float32
    assert ids.shape == (7, 2520, 2) and ids.dtype == torch.int64
    real = (ids != -1).all(dim=-1)
    assert real.sum(dim=1).tolist() == [2394, 2394, 2376, 2376, 2304, 2268, 2268]  # all padded, as most images are
    assert real.float().mean().item() == pytest.approx(0.929, abs=5e-4)
    assert not pixels[~real].any(), "padding patches are zero pixels"
    for (width, height), item_ids, item_real in zip(image.aspect_ratios, ids, real):
        grid_width, grid_height = (item_ids[item_real].max(dim=0).values + 1).tolist()
        assert grid_width * grid_height == int(item_real.sum()) and grid_width % 3 == grid_height % 3 == 0
        assert grid_width / grid_height == pytest.approx(width / height, rel=0.12)

    video = encoder.Mix(Case.parse("video_32x70"))
    assert video.name == "video_32x70"
    _, ids = video.inputs(torch.device("cpu"))
    assert ids.shape == (32, 630, 2) and (ids == ids[0]).all(), "the frames share one grid"
    assert int((ids[0] != -1).all(dim=-1).sum()) == 33 * 18


def test_the_encoders_run_after_the_towers_their_compiled_provider_last(tmp_path, monkeypatch):
    sections = []
    monkeypatch.setattr(runner, "bench_stem", lambda session, ops, providers, *_: sections.append((ops, providers)))
    monkeypatch.setattr(runner, "bench_tower", lambda session, op, *_: sections.append(op))
    monkeypatch.setattr(runner, "run_low_memory", lambda session: sections.append("low_memory"))
    monkeypatch.setattr(runner, "bench_encoder", lambda session, op, providers, _: sections.append((op, providers)))
    ops = ("patch_embed", "tower_e2b_e4b", "encoder_e2b_e4b", "encoder_26b_31b", "low_memory")
    options = plan.Options(device=DEVICE, out=tmp_path, ops=ops, providers=plan.PROVIDERS)
    chosen = plan.Plan.of(options)
    runner.run_sections(runner.Session(options, runner.Log(tmp_path / "log.txt"), chosen), chosen)
    eager = tuple(p for p in plan.PROVIDERS if p != "compiled")
    assert sections == [
        (("patch_embed",), eager),
        "tower_e2b_e4b",
        "low_memory",
        ("encoder_e2b_e4b", eager),
        ("encoder_26b_31b", eager),
        (("patch_embed",), ("compiled",)),
        ("encoder_e2b_e4b", ("compiled",)),
        ("encoder_26b_31b", ("compiled",)),
    ]


def test_the_defaults_add_the_encoders(tmp_path):
    def default(device):
        return plan.Plan.of(plan.Options(device=torch.device(device), out=tmp_path))

    cpu, gpu = default("cpu"), default("cuda")
    assert cpu.encoder_ops == ("encoder_e2b_e4b",) and set(cpu.providers) >= set(EAGER)
    assert "compiled" not in cpu.providers and [c.name for c in cpu.encoder_cases] == ["image_7x280", "video_32x70"]
    assert gpu.encoder_ops == ("encoder_e2b_e4b", "encoder_26b_31b")
    assert {"stock", "compiled", "padded", "packed"} <= set(gpu.providers)
    assert [case.name for case in gpu.encoder_cases] == ["image_8x280", "video_32x70"]
    assert _parser().parse_args(["bench", "--ops", "encoder"]).ops == ("encoder_e2b_e4b", "encoder_26b_31b")


def test_the_encoder_target_is_judged_from_the_rows():
    def rows(packed_rate, packed_peak, case="image_mix_7x280"):
        stock = dict(items_per_s=10.0, peak_bytes=100)
        return {case: {"stock": stock, "packed": dict(items_per_s=packed_rate, peak_bytes=packed_peak)}}

    cpu, gpu = ENCODER_TARGETS["cpu"], ENCODER_TARGETS["cuda"]
    assert cpu.judge(rows(10.8, 99), "float32").endswith(": met (1.08×, peak 0.99× stock's).")
    assert cpu.judge(rows(12.0, 100), "float32").endswith(": **not met** (1.20×, peak 1.00× stock's).")
    assert cpu.judge(rows(12.0, 90, case="video_32x70"), "float32").endswith("no stock and packed rows there.")
    assert gpu.judge(rows(13.0, 200, case="image_mix_8x280"), "bfloat16").endswith(": met (1.30×).")
    assert gpu.judge(rows(13.0, 200, case="image_mix_8x280"), "float32").endswith("not judged in float32.")
