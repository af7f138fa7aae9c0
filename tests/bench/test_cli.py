"""The command line's usage errors and header, and the time budget as a cap on the run."""

import itertools
import subprocess
import sys
import time

import pytest
import torch

from fused_vision.bench import Case, plan
from fused_vision.bench.cli import main
from fused_vision.bench.measure import Budget, interleaved_times, time_call

from bench_cli import read_csv, run_cli
from helpers import DEVICE

CPU = torch.device("cpu")


def test_an_unknown_option_prints_the_bench_usage(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--bogus"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: fused-vision bench [-h] [--device DEVICE]"), err
    assert "fused-vision bench: error: unrecognized arguments: --bogus" in err


def test_an_unknown_device_type_is_a_usage_error_not_a_traceback():
    command = [sys.executable, "-m", "fused_vision", "bench", "--device", "tpu"]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 2
    assert "argument --device: 'tpu': the bench runs on cuda or cpu" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_time_budget_defaults_by_device_and_zero_lifts_it(tmp_path):
    def budget(device, seconds=None):
        return plan.Plan.of(plan.Options(device=torch.device(device), out=tmp_path, time_budget_s=seconds))

    assert budget("cuda").time_budget_s == 210 and budget("cpu").time_budget_s == 160
    assert budget("cpu", 0).time_budget_s == 0 and budget("cuda", 30).time_budget_s == 30
    usage = subprocess.check_output([sys.executable, "-m", "fused_vision", "bench", "-h"], text=True)
    assert "(default 210 on a GPU, 160 on a CPU; 0: no limit)" in " ".join(usage.split())


def header_lines(tmp_path, device: str, **options) -> list[str]:
    chosen = plan.Plan.of(plan.Options(device=torch.device(device), out=tmp_path, **options))
    return chosen.describe(torch.device(device))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_header_never_lists_nothing(tmp_path, device):
    """Every combination of a few ops and providers: a line per section run, each naming what it runs or why
    nothing, never an empty list."""
    ops = ("position_embeddings", "qkv_norm_rope", "tower_e2b_e4b", "encoder_e2b_e4b", "low_memory")
    providers = ("onehot", "stock", "padded", "fused")
    for op_count, provider_count in itertools.product((1, 2), (1, 2)):
        for chosen_ops, chosen_providers in itertools.product(
            itertools.combinations(ops, op_count), itertools.combinations(providers, provider_count)
        ):
            lines = header_lines(tmp_path, device, ops=chosen_ops, providers=chosen_providers)
            assert len(lines) == len(chosen_ops), (chosen_ops, lines)
            for line in lines:
                assert not any(empty in line for empty in ("()", ": at", ", ,", ": ;", " at ,")), line
                assert not line.rstrip().endswith((":", ",")), line
    lines = header_lines(tmp_path, device, ops=("tower_e2b_e4b",), providers=("padded",))
    assert lines == ["tower_e2b_e4b: nothing to run, none of its providers is among --providers"]


def test_the_cpu_header_names_each_section_it_runs(tmp_path):
    assert header_lines(tmp_path, "cpu") == [
        "position_embeddings, patch_embed, pool_by_positions: onehot, embedding, reference at image_1x280, D 1152",
        "encoder_e2b_e4b: stock, packed, fused at image_mix_7x140",
        "low_memory: vLLM's and the planner's chunks, computed (running them needs CUDA)",
    ]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_headline_runs_the_targets_rows_and_explicit_choices_still_win(tmp_path, device):
    headline = plan.Plan.of(plan.Options(device=torch.device(device), out=tmp_path, headline=True))
    assert headline.ops == (
        "position_embeddings", "patch_embed", "pool_by_positions",
        "qkv_norm_rope", "residual_rms_norm", "gelu_gate", "gate_up_gelu",
        "encoder_e2b_e4b", "encoder_26b_31b",
    )  # fmt: skip
    assert [case.name for case in headline.stem_cases] == ["image_32x280"]
    assert [case.name for case in headline.encoder_cases] == ["image_8x280", "video_32x70"]
    assert headline.encoder_providers == ("stock", "compiled", "packed", "fused")
    assert "compiled" in headline.providers and "reference" not in headline.providers
    chosen = plan.Options(device=torch.device(device), out=tmp_path, headline=True, ops=("gelu_gate",), tiny=True)
    assert plan.Plan.of(chosen).ops == ("gelu_gate",) and plan.Plan.of(chosen).stem_cases[0].name == "image_2x4"
    usage = subprocess.check_output([sys.executable, "-m", "fused_vision", "bench", "-h"], text=True)
    assert "--headline" in usage


def sleeper(seconds: float, calls: list):
    def call():
        calls.append(time.monotonic())
        time.sleep(seconds)

    return call


def test_host_repetitions_stop_before_the_deadline():
    start = time.monotonic()
    times = time_call(sleeper(0.05, []), CPU, Budget(warmup_ms=0, rep_ms=10_000), deadline=start + 0.22)
    assert 1 <= times.reps <= 4, "10 s of repetitions cut to the 0.22 s left"
    assert time.monotonic() - start < 0.22 + 0.1, "no call predicted to end past it started (0.1 s: a sleep's slack)"
    assert time_call(sleeper(0.001, []), CPU, Budget(warmup_ms=0, rep_ms=0)).reps == 3, "without one, 3 calls"
    late = time_call(sleeper(0.001, []), CPU, Budget(warmup_ms=50, rep_ms=50), deadline=time.monotonic() - 1)
    assert late.reps == 1, "past it, one call still times the measurement started before it"


def test_interleaved_rounds_stop_before_the_deadline():
    calls = {"a": sleeper(0.1, []), "b": sleeper(0.1, [])}
    start = time.monotonic()
    times = interleaved_times(calls, CPU, reps=10, deadline=start + 0.5)
    assert 1 <= times["a"].reps == times["b"].reps <= 2, "10 rounds of 0.2 s cut to the 0.5 s left"
    assert time.monotonic() - start < 0.5 + 0.2, "no round predicted to end past it started"
    late = interleaved_times(calls, CPU, reps=3, deadline=start)
    assert late["a"].reps == late["b"].reps == 1, "past it, the first round still runs"


def test_past_the_budget_an_encoder_mix_starts_nothing_more(tmp_path, monkeypatch):
    """The encoder checks the budget before each first call and before its rounds: where it is spent during
    stock's first call, packed's never starts, nor any round, and both are skips that say why."""
    from fused_vision.bench import encoder, runner

    real_provider_call, late = encoder.provider_call, []

    def budget_ends_during(provider, *args):
        call = real_provider_call(provider, *args)

        def first_call():
            late.append(provider)
            return call()

        return first_call

    monkeypatch.setattr(encoder, "provider_call", budget_ends_during)
    monkeypatch.setattr(runner.Session, "out_of_time", lambda self, ahead_s=0.0: bool(late))
    out = run_cli(tmp_path, "--ops", "encoder_e2b_e4b", "--providers", "stock,packed", "--cases", "image_1x70")
    _, rows = read_csv(out / "results.csv")
    assert late == ["stock"] and not [row for row in rows if row["op"] == "encoder_e2b_e4b"]
    skipped = "image_mix_1x70 (D=64): past the time budget of 160 s (--time-budget)"
    markdown = (out / "results.md").read_text()
    assert DEVICE.type == "cuda" or all(f"encoder_e2b_e4b · {p} · {skipped}" in markdown for p in ("stock", "packed"))


def test_a_measurement_whose_first_call_shows_it_would_end_late_is_a_skip(tmp_path):
    from fused_vision.bench import runner

    options = plan.Options(device=CPU, out=tmp_path, time_budget_s=100)
    session = runner.Session(options, runner.Log(tmp_path / "log.txt"), plan.Plan.of(options))
    session.copy = session.matmul = None
    session.deadline = time.monotonic() + 0.5
    assert session.out_of_time(ahead_s=1.0) and not session.out_of_time(ahead_s=0.1)
    slow = sleeper(0.3, [])
    assert (
        session.run("pool_by_positions", "onehot", Case.parse("image_1x4"), 64, lambda: slow, budget=Budget(0, 1000))
        is None
    )
    assert session.rows == [] and session.skipped[0]["reason"] == "past the time budget of 100 s (--time-budget)"


def test_cuda_times_are_do_benchs_quantiles_with_their_count(monkeypatch):
    """On a GPU the times stay do_bench's: the same calls, the same quantiles, now with their count."""
    import triton.testing

    asked = {}

    def do_bench(fn, warmup, rep, return_mode):
        asked.update(warmup=warmup, rep=rep, return_mode=return_mode)
        return [4.0, 1.0, 3.0, 2.0, 5.0]

    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    times = time_call(lambda: None, torch.device("cuda"), Budget(warmup_ms=25, rep_ms=100), deadline=0.0)
    assert asked == dict(warmup=25, rep=100, return_mode="all")
    assert (times.p50, times.p20, times.p80, times.reps) == (3.0, 1.8, 4.2, 5)
