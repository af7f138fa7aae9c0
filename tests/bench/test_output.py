"""What a run's files say: no absolute paths, no empty CSV, the interpreter's rows labelled and never compared,
shares of a ceiling only where it was measured reliably and flagged above 100 %, captions of the columns
present, plots of dots that name the device, dtype and versions."""

import os
import re
import sysconfig

import matplotlib.pyplot as plt
import pytest
import torch

from fused_vision.bench import Case, plan, plots, report, runner
from fused_vision.bench.measure import Ceiling, Times
from fused_vision.bench.text import format_pct, portable

from bench_cli import run_cli
from helpers import DEVICE

ABSOLUTE_PATH = re.compile(r"(^|[\s'\"(\[=`])/[\w.+@-]+/")
MB = 10**6
ENVIRONMENT = dict(
    gpu="cpu x86_64 (2 threads)", torch="2.13.0", triton="3.7.1", transformers="5.25.0", fused_vision="0.1"
)


def test_portable_paths():
    here = os.path.join(os.getcwd(), "runs", "a")
    library = os.path.join(sysconfig.get_path("purelib"), "torch", "nn", "modules", "module.py")
    text = f'--out {here}; File "{library}", line 3; (/opt/data/x.bin) items/s, onehot / fused, 1/3, =/srv/y'
    assert portable(text) == (
        '--out runs/a; File "site-packages/torch/nn/modules/module.py", line 3; (…/x.bin) items/s, onehot / fused, '
        "1/3, =…/y"
    )


def test_no_output_file_holds_an_absolute_path_and_no_csv_is_empty(tmp_path, monkeypatch):
    """--out an absolute folder, and a skip whose error names a file by its absolute path."""

    def broken_setup(self, case, hidden, dtype, device):
        raise RuntimeError(f"cannot read {tmp_path}/weights/table.bin")

    from fused_vision.bench.ops import PoolByPositions

    monkeypatch.setattr(PoolByPositions, "__init__", broken_setup)
    out = run_cli(tmp_path, "--ops", "position_embeddings,pool_by_positions", "--providers", "onehot,embedding")
    assert out.is_absolute()
    written = sorted(path.name for path in out.iterdir())
    assert written == ["log.txt", "memory.png", "results.csv", "results.md", "time.png"], "no low_memory.csv: no rows"
    for name in ("log.txt", "results.csv", "results.md"):
        text = (out / name).read_text()
        assert str(tmp_path) not in text and not ABSOLUTE_PATH.search(text), name
    assert "RuntimeError: cannot read …/table.bin" in (out / "results.md").read_text(), "the skip's real error"


def ceiling(name: str, reps: int, spread: float, flops: int = 0) -> Ceiling:
    times = Times(p50=1.0, p20=1.0 - spread / 2, p80=1.0 + spread / 2, reps=reps)
    return Ceiling(name, "case", times, bytes_moved=10**9, flops=flops)


@pytest.mark.parametrize(
    "copy_reps, copy_spread, matmul_spread, shown",
    [(10, 0.09, 0.05, {"pct_of_copy", "pct_of_matmul", "floor_ms"}), (9, 0.0, 0.0, {"pct_of_matmul"})]
    + [(50, 0.3, 0.0, {"pct_of_matmul"}), (50, 0.0, 0.2, {"pct_of_copy"})],
)
def test_shares_and_floors_only_on_reliable_ceilings(tmp_path, copy_reps, copy_spread, matmul_spread, shown):
    options = plan.Options(device=torch.device("cpu"), out=tmp_path)
    session = runner.Session(options, runner.Log(tmp_path / "log.txt"), plan.Plan.of(options))
    session.copy = ceiling("copy", copy_reps, copy_spread)
    session.matmul = ceiling("matmul", 20, matmul_spread, flops=10**12)
    rates = session.rates(2.0, model_bytes=10**9, flops=10**12)
    assert rates.keys() == {"gbps", "tflops"} | shown
    assert "floor_ms" not in session.rates(2.0, model_bytes=10**9, flops=10**12, floor=False)


def op_row(provider: str, ms: float, **fields) -> dict:
    row = dict(op="position_embeddings", provider=provider, case="image_1x280", B=1, N=2520, D=1152)
    return row | dict(dtype="float32", ms_p50=ms, ms_p20=ms, ms_p80=ms, timing="speed", peak_bytes=None) | fields


def test_above_100_percent_of_the_floor_is_flagged_and_explained():
    assert format_pct(99.0) == "99%" and format_pct(139.0) == "139%†"
    rows = [op_row("onehot", 10.0, floor_ms=1.0), op_row("embedding", 0.5, floor_ms=1.0)]
    lines = report.op_tables(rows, plan.PROVIDERS, ("position_embeddings",))
    assert "| image_1x280 | 2,520 | 1.00 ms | 10.0 ms · 10% | 0.500 ms · 200%† |" in lines
    caption = " ".join(report._op_caption(rows, plan.PROVIDERS, "cpu"))
    assert "% of the floor" in caption and "† above 100 %" in caption


def test_the_interpreter_rows_are_labelled_and_compared_with_nothing():
    rows = [op_row("onehot", 100.0), op_row("reference", 2.0), op_row("fused", 900.0, timing="correctness")]
    lines = report.op_tables(rows, plan.PROVIDERS, ("position_embeddings",))
    assert "| case | patches | onehot | reference | fused | onehot / reference |" in lines
    assert "| image_1x280 | 2,520 | 100 ms | 2.00 ms | 900 ms (interpreter: correctness run) | 50× |" in lines
    caption = " ".join(report._op_caption(rows, plan.PROVIDERS, "cpu"))
    assert "interpreter: correctness run" in caption and "A ratio column" in caption


def test_captions_describe_only_the_columns_present():
    rows = [op_row("onehot", 10.0), op_row("embedding", 1.0)]
    caption = " ".join(report._op_caption(rows, plan.PROVIDERS, "cpu"))
    assert caption.startswith("Cells: median time. Providers: onehot: ")
    assert not any(word in caption for word in ("peak", "floor", "ratio", "reference", "interpreter", "†"))
    encoder_rows = [dict(provider="stock", peak_bytes=None, tflops=None), dict(provider="padded", peak_bytes=None)]
    caption = " ".join(report._encoder_caption(encoder_rows, "cpu"))
    assert "peak" not in caption and "TFLOP/s" not in caption and "ratio" not in caption
    with_peaks = [dict(provider="stock", peak_bytes=5, tflops=1.0), dict(provider="packed", peak_bytes=4, tflops=1.0)]
    caption = " ".join(report._encoder_caption(with_peaks, "cpu"))
    assert "CPU allocator" in caption and "TFLOP/s" in caption and "% of the matmul" not in caption
    assert "A ratio column" in caption


def test_the_plots_are_dots_naming_device_dtype_and_versions(tmp_path, monkeypatch):
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    session = type("Session", (), dict(environment=ENVIRONMENT, dtype_name="float32", log=print))()
    rows = [
        op_row("onehot", 100.0, peak_bytes=619_000_000, ms_p20=90.0, ms_p80=110.0),
        op_row("reference", 2.0, peak_bytes=35_000_000),
        op_row("fused", 900.0, timing="correctness"),
    ]
    assert plots.plot(session, rows, plan.PROVIDERS, tmp_path) == ["time.png", "memory.png"]
    for figure in figures:
        title = figure._suptitle.get_text()
        assert "cpu x86_64 (2 threads) · float32" in title and "torch 2.13.0, triton 3.7.1" in title
        axis = figure.axes[0]
        assert not axis.patches, "no bars"
        labels = [text.get_text() for axis in figure.axes for text in axis.texts]
        assert labels in (["50× faster"], ["18× smaller"]), "the ratio to the baseline, as measured"
        providers = [text.get_text() for text in figure.legends[0].get_texts()]
        assert "fused" not in providers, "no interpreter's time"
    ticks = [label.get_text() for label in figures[1].axes[0].get_yticklabels()]
    assert ticks and all(re.fullmatch(r"[\d.,]+ (kB|MB|GB)", tick) for tick in ticks), ticks


def test_a_skip_names_the_real_error(tmp_path, monkeypatch):
    """Where Triton does not drive the device, the fused provider's skip says so, in the kernel's own words."""
    from fused_vision import _dispatch

    if DEVICE.type == "cuda":
        pytest.skip("Triton drives a CUDA device")
    monkeypatch.setattr(_dispatch, "triton_drives", lambda device: False)
    out = run_cli(tmp_path, "--ops", "position_embeddings", "--providers", "fused")
    reason = "RuntimeError: backend='triton': Triton does not drive cpu tensors (set TRITON_INTERPRET=1"
    assert f"- position_embeddings · fused · image_2x4 (D=64): {reason}" in (out / "results.md").read_text()


def test_the_gpu_stem_tables_are_those_of_before(tmp_path):
    """The fused provider's speed rows keep the GPU's table: a floor, the peaks, onehot / fused."""
    rows = [op_row(p, ms, floor_ms=0.01, peak_bytes=10**6) for p, ms in (("onehot", 18.6), ("fused", 0.05))]
    lines = report.op_tables(rows, plan.GPU_PROVIDERS, ("position_embeddings",))
    assert "| case | patches | floor | onehot | fused | onehot / fused |" in lines
    assert Case.parse("image_1x280").patches == 2520


def test_a_gpu_row_keeps_its_peak_rates_and_floor(tmp_path, monkeypatch):
    """The CUDA path of a measurement under stubs: do_bench's times, the allocator's peaks, rates and a floor on
    reliable ceilings; no CPU profiler."""
    from fused_vision.bench import measure

    monkeypatch.setattr(runner, "environment", lambda device: ENVIRONMENT | dict(gpu="NVIDIA H200"))
    monkeypatch.setattr(runner, "time_call", lambda *args, **kwargs: Times(2.0, 1.9, 2.1, reps=48))
    monkeypatch.setattr(runner, "peak_memory", lambda call, device: (measure.Peak(3 * MB, 2 * MB), call()))
    monkeypatch.setattr(runner, "synchronize", lambda device: None)
    monkeypatch.setattr(runner, "call_peak", None)  # never called on CUDA
    options = plan.Options(device=torch.device("cuda"), out=tmp_path)
    session = runner.Session(options, runner.Log(tmp_path / "log.txt"), plan.Plan.of(options))
    session.copy, session.matmul = ceiling("copy", 200, 0.02), ceiling("matmul", 60, 0.03, flops=10**12)
    case = Case.parse("image_1x280")
    session.run(
        "patch_embed",
        "fused",
        case,
        1152,
        lambda: lambda: torch.zeros(1),
        budget=runner.STEM_BUDGET,
        model_bytes=10**9,
        flops=10**12,
    )
    row = session.rows[0]
    assert (row["timing"], row["reps"], row["peak_bytes"], row["peak_requested_bytes"]) == ("speed", 48, 3 * MB, 2 * MB)
    assert row["pct_of_copy"] == pytest.approx(50.0) and row["pct_of_matmul"] == pytest.approx(50.0)
    assert row["floor_ms"] == pytest.approx(1.0)


def test_every_provider_has_a_colour():
    assert set(plan.PROVIDERS) <= set(plots.PROVIDER_COLORS)
