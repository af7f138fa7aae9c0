"""The encoder section: stock, padded, packed and fused calls on processor mixes, interleaved, in items/s, FLOP
rates and peaks."""

import re
import sys

import pytest
import torch

from fused_vision.bench import Case, encoder, plan, runner
from fused_vision.bench.cli import build_parser
from fused_vision.bench.tower import build_tower, tower_shape
from fused_vision.encoder.attention import attention_path

from bench_cli import read_csv, reliable, run_cli
from helpers import DEVICE

EAGER = ("stock", "padded", "packed", "fused")
CASES = ("image_7x280", "video_32x70")
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
    out = run_cli(tmp_path, "--ops", "encoder_e2b_e4b", "--providers", ",".join(EAGER), "--cases", ",".join(CASES))

    first_calls = 2 if DEVICE.type == "cuda" else 1  # a GPU's warm-up, then the peak's call
    per_mix = [p for p in EAGER for _ in range(first_calls)] + [*EAGER, *EAGER]
    assert calls == per_mix * len(MIXES)
    _, rows = read_csv(out / "results.csv")
    matmul = next(row for row in rows if row["op"] == "matmul")
    rows = {(row["case"], row["provider"]): row for row in rows if row["op"] == "encoder_e2b_e4b"}
    assert sorted(rows) == sorted((mix, provider) for mix in MIXES for provider in EAGER)
    shapes = {"image_mix_7x280": ("7", "2520"), "video_32x70": ("32", "630")}  # (B, N)
    for (mix, _), row in rows.items():
        assert float(row["items_per_s"]) > 0 and int(row["peak_bytes"]) > 0 and int(row["output_bytes"]) > 0
        assert float(row["tflops"]) > 0 and row["timing"] == "speed" and row["reps"] == "2"
        assert float(row["ms_p20"]) <= float(row["ms_p50"]) <= float(row["ms_p80"])
        assert (row["B"], row["N"]) == shapes[mix] and (row["D"], row["layers"]) == ("64", "1")  # the tiny tower
    shape, dtype = tower_shape("tower_e2b_e4b", tiny=True), torch.float32 if DEVICE.type == "cpu" else torch.bfloat16
    heads = torch.empty(0, shape["num_attention_heads"], shape["head_dim"], dtype=dtype, device=DEVICE)
    packed_attention = attention_path(heads)  # the path the packed encoder takes for the tiny tower's heads
    attention = {provider: {row["attention"] for (_, p), row in rows.items() if p == provider} for provider in EAGER}
    padded_attention = {"stock": {"sdpa (padded, masked)"}, "padded": {"sdpa (padded, masked)"}}
    assert attention == {**padded_attention, "packed": {packed_attention}, "fused": {packed_attention}}
    assert rows["image_mix_7x280", "stock"]["real_patches"] == str(2394 * 2 + 2376 * 2 + 2304 + 2268 * 2)
    for mix in MIXES:  # the same useful FLOPs for every provider: the rates are in the ratio of the times
        stock, fused = rows[mix, "stock"], rows[mix, "fused"]
        expected = float(stock["tflops"]) * float(stock["ms_p50"]) / float(fused["ms_p50"])
        assert float(fused["tflops"]) == pytest.approx(expected, rel=1e-4)

    markdown = (out / "results.md").read_text()
    header = "| case | items | real patches | stock | padded | packed | fused | packed / stock | packed / padded |"
    assert header + " fused / stock | fused / packed |" in markdown
    rate = {provider: float(rows["image_mix_7x280", provider]["items_per_s"]) for provider in EAGER}
    ratios = [rate[a] / rate[b] for a, b in (("packed", "stock"), ("packed", "padded"), ("fused", "stock"))]
    ratios.append(rate["fused"] / rate["packed"])
    line = next(line for line in markdown.splitlines() if line.startswith("| image_mix_7x280 | 7 | 92.9% |"))
    assert line.endswith("".join(f" {ratio:.2f}× |" for ratio in ratios))
    assert ("TFLOP/s (" in line) == reliable(matmul), "a share of the matmul ceiling only where it is reliable"
    assert "tower_e2b_e4b with 1 of its 16 layers (--tiny). TFLOP/s counts every provider's useful FLOPs" in markdown
    padded_paths = "stock sdpa (padded, masked); padded sdpa (padded, masked)"
    assert f"Attention: {padded_paths}; packed {packed_attention}; fused {packed_attention}." in markdown
    assert "Target (" not in markdown, "the bench measures; bench/goals.py judges the goals"
    log = (out / "log.txt").read_text()
    assert "image_mix_7x280: 7 items of N=2520 patches, 92.9% real" in log
    assert "packed vs stock output: max |diff|" in log
    tolerance = 1e-4 if DEVICE.type == "cpu" else 3e-2  # fp32 on a CPU; bf16 on a GPU
    for difference, scale in re.findall(r"fused vs stock output: max \|diff\| (\S+) \(max \|value\| (\S+)\)", log):
        assert float(difference) <= tolerance * float(scale), "the fused encoder computes stock's soft tokens"


def test_the_graphed_encoder_is_a_provider_on_the_fused_towers_copy(tmp_path):
    """Off CUDA its calls run the bucketed layout eagerly: the rows and the fused tower's soft tokens."""
    out = run_cli(tmp_path, "--ops", "encoder_e2b_e4b", "--providers", "fused,graphed", "--cases", "video_4x70")
    _, rows = read_csv(out / "results.csv")
    rows = {row["provider"]: row for row in rows if row["op"] == "encoder_e2b_e4b"}
    assert sorted(rows) == ["fused", "graphed"] and float(rows["graphed"]["items_per_s"]) > 0
    log = (out / "log.txt").read_text()
    difference, scale = re.search(r"graphed vs fused output: max \|diff\| (\S+) \(max \|value\| (\S+)\)", log).groups()
    assert float(difference) <= 1e-4 * float(scale), "the graphed encoder computes the fused tower's soft tokens"


def test_a_missing_processor_is_a_logged_skip(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "PIL", None)  # Pillow not installed: importing it raises ImportError
    out = run_cli(tmp_path, "--ops", "encoder_e2b_e4b", "--providers", ",".join(EAGER), "--cases", ",".join(CASES))
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
    assert cpu.encoder_ops == ("encoder_e2b_e4b",) and cpu.encoder_providers == ("stock", "packed", "fused")
    assert "fused" not in cpu.providers, "a CPU's stem and layer ops run Triton only in its interpreter"
    assert "compiled" not in cpu.providers and [c.name for c in cpu.encoder_cases] == ["image_7x140"]
    assert gpu.encoder_ops == ("encoder_e2b_e4b", "encoder_26b_31b")
    assert set(encoder.ENCODER_PROVIDERS) <= set(gpu.providers) == set(gpu.encoder_providers)
    assert [case.name for case in gpu.encoder_cases] == ["image_8x280", "video_32x70", "image_8x1120"]
    assert build_parser().parse_args(["bench", "--ops", "encoder"]).ops == ("encoder_e2b_e4b", "encoder_26b_31b")


def test_encoder_flops_count_the_gemms_attention_and_the_embedder_by_hand():
    shape = tower_shape("tower_26b_31b", tiny=False)  # D 1152, 16 heads of 72 (no grouping), I 4304, 27 layers
    tokens = 2484 + 2394
    per_layer = 2 * tokens * 1152 * 3 * 1152 + 2 * tokens * 1152 * 1152 + 2 * tokens * 1152 * 2 * 4304
    per_layer += 2 * tokens * 4304 * 1152 + 4 * (2484**2 + 2394**2) * 16 * 72
    assert encoder.encoder_flops(shape, [2484, 2394]) == 2 * tokens * 768 * 1152 + 27 * per_layer
    grouped = dict(shape, num_key_value_heads=4, num_hidden_layers=1)
    kv_saving = 2 * 100 * 1152 * 2 * (16 - 4) * 72  # k and v project to 4 heads, not 16
    assert encoder.encoder_flops(dict(shape, num_hidden_layers=1), [100]) - encoder.encoder_flops(grouped, [100]) == (
        kv_saving
    )
    padded, packed = encoder.encoder_flops(shape, [2520, 2520]), encoder.encoder_flops(shape, [2484, 2394])
    assert padded > packed, "padding costs GEMM rows and attention's square"


def test_the_fused_tower_is_a_patched_copy_that_leaves_the_stock_tower_stock():
    mix = encoder.Mix(Case.parse("image_2x70"))
    pixels, ids = mix.inputs(DEVICE)
    torch.manual_seed(0)
    stock = build_tower("tower_e2b_e4b", DEVICE, torch.float32, tiny=True, layers=1)
    towers = {"stock": stock}
    before = encoder.provider_call("stock", towers, pixels, ids)()
    towers["fused"] = encoder.fused_tower(stock, DEVICE)
    fused = encoder.flat(encoder.provider_call("fused", towers, pixels, ids)())
    after = encoder.provider_call("stock", towers, pixels, ids)()
    assert torch.equal(before, after), "the stock tower computes as before"
    stock_storage = {p.untyped_storage().data_ptr() for p in stock.parameters()}
    assert not stock_storage & {p.untyped_storage().data_ptr() for p in towers["fused"].parameters()}
    torch.testing.assert_close(fused, encoder.flat(before), atol=1e-4, rtol=1e-4)
