"""The GPU run's scripts and tests run their own code at tiny sizes here, so a GPU run does not debug them."""

import os
import re
import runpy
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import numpy as np
import pytest

from helpers import DEVICE, TIME_BOXED

ROOT = Path(__file__).resolve().parents[1]


def run_gpu_tests_smoke(out, expected_code, *pytest_args, files=(), **env):
    """tests/gpu (or those of its ``files``) at tiny sizes (FUSED_VISION_GPU_TESTS_SMOKE=1), with JUnit XML as
    bench/gpu_run.sh writes it; returns the XML's path."""
    xml = out / "gpu_tests.xml"
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", *pytest_args]
    command += ["-o", "junit_family=xunit1", "--junitxml", str(xml)]
    gpu_tests = ROOT / "tests" / "gpu"
    command += [str(gpu_tests / name) for name in files] or [str(gpu_tests)]
    env = {**os.environ, "TRITON_INTERPRET": "1", "FUSED_VISION_GPU_TESTS_SMOKE": "1", **env}
    # About 3.5 minutes on an idle 2-core machine (the fused encoders under the interpreter); twice that
    # beside a busy test worker.
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == expected_code, result.stdout + result.stderr
    return xml


def outcomes(xml):
    """Each test's failures, errors and skips in JUnit XML, as (kind, message) pairs: none where it passed.
    (A test that fails, then errors at teardown, has a <testcase> for each.)"""
    found = {}
    for case in ElementTree.parse(xml).iter("testcase"):
        problems = [(child.tag, child.get("message")) for child in case if child.tag in ("failure", "error", "skipped")]
        found.setdefault(case.get("name"), []).extend(problems)
    return found


def test_gpu_tests_smoke(tmp_path):
    """Every GPU test runs and passes at tiny sizes, and the XML keeps the figures they record."""
    xml = run_gpu_tests_smoke(tmp_path, 0)
    results = outcomes(xml)
    cuda_only = {name for name, problems in results.items() if problems == [("skipped", "needs CUDA")]}
    assert len(cuda_only) == 36, "the packed encoder's attention paths: CUDA only, even in the smoke run"
    assert len(results) == 75 and not any(results[name] for name in results.keys() - cuda_only), results
    patch_embed = "test_patch_embed_as_accurate_as_stock_against_float64[bfloat16]"
    case = next(case for case in ElementTree.parse(xml).iter("testcase") if case.get("name") == patch_embed)
    assert {prop.get("name") for prop in case.iter("property")} == {"fused_error", "stock_error"}


def test_gpu_tests_fail_where_auto_falls_back_to_the_reference(tmp_path):
    """Three tests call the ops with backend "auto", as the patched model does: if a kernel fails there the
    reference runs and can pass the test, so the test must report the fallback and fail."""
    (tmp_path / "broken_lookup.py").write_text(
        "from fused_vision.kernels import position_embeddings as kernel\n"
        "def broken(*args, **kwargs):\n"
        "    raise RuntimeError('simulated launch failure')\n"
        "kernel.position_embeddings = broken\n"
    )
    pythonpath = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    # The files of those three only: the fused encoders' file would add three minutes to the suite.
    files = ("test_cuda_graphs.py", "test_no_sync.py")
    results = outcomes(run_gpu_tests_smoke(tmp_path, 1, "-p", "broken_lookup", files=files, PYTHONPATH=pythonpath))
    fell_back = f"backend 'auto' fell back to the reference: position_embeddings on {DEVICE.type}"
    no_sync = "test_no_sync_where_syncs_are_forbidden[position_embeddings]"
    for name in ("test_replay_on_new_inputs_matches_eager", "test_capture_at_a_new_batch_size_matches_eager", no_sync):
        assert any(kind == "error" and fell_back in message for kind, message in results[name]), results[name]
    # On a GPU the reference would meet the out-of-range id unchecked, a device-side assert that no later
    # test survives: the test stops before that call.
    stopped = "position_embeddings: 'auto' fell back to the reference, which must not meet out-of-range ids"
    assert any(kind == "failure" and stopped in message for kind, message in results[no_sync]), results[no_sync]


def test_build_matrix_compiles_and_fits(tmp_path):
    """bench/tools/build_matrix.py, sampled to stay short: the tile kernels at every launch config, built for
    sm_90a with Triton's own ptxas and for gfx942 with its LLVM, within shared memory, without spills, and
    the table it writes from its CSV."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    tool = [sys.executable, str(ROOT / "bench" / "tools" / "build_matrix.py")]
    sample = ["--targets", "sm_90a,gfx942", "--kernels", "patch_embed,pool_by_positions", "--out", str(tmp_path)]
    result = subprocess.run(tool + sample, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    (table,) = tmp_path.glob("build_matrix-*.csv")
    rows = table.read_text().splitlines()
    assert len(rows) > 60 and all(row.endswith(",ok") for row in rows[1:] if ",True," in row), "\n".join(rows)
    assert any(",False," in row for row in rows), "gfx942's 64 KiB of LDS prunes the big tiles"
    summary = subprocess.run(tool + ["--markdown", str(tmp_path)], capture_output=True, text=True, env=env, check=True)
    assert "| patch_embed | gfx942 |" in summary.stdout, summary.stdout


SASS = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0020*/                   FMUL R4, R4, R4 ;
.L_x_1:
        /*0030*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR12], R6 ;
        /*0040*/              @!P0 BRA `(.L_x_1) ;
        /*0050*/                   STG.E.64 desc[UR4][R2.64], R4 ;
        /*0060*/               @P1 BRA `(.L_x_0) ;
        /*0070*/                   EXIT ;
.L_x_2:
        /*0080*/                   BRA `(.L_x_2);
        /*0090*/                   NOP;
"""


def speed_of_light_tool(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench" / "tools"))
    return __import__("speed_of_light")


def test_speed_of_light_counts_loops_by_their_trips(monkeypatch):
    """A loop's body counts its trip count times, a barrier's spin loop once, the padding after EXIT not
    at all; loops other than those declared are not counted, which the gated target refuses."""
    tool = speed_of_light_tool(monkeypatch)
    found, labels = tool.instructions(SASS)
    assert [text.split()[0] for _, text in found][-1] == "EXIT" and len(found) == 8
    spans = tool.loops(found, labels)
    assert spans == [(1, 6)]  # the TRYWAIT spin is no loop of work
    assert tool.executed(found, spans, (10,)) == 2 + 6 * 10
    assert tool.executed(found, spans, ()) is None
    assert tool.widths(found, "LDG") == "128-128" and tool.widths(found, "STG") == "64-64"


def test_speed_of_light_gate_bounds(monkeypatch):
    tool = speed_of_light_tool(monkeypatch)
    row = dict(target=tool.GATED_TARGET, gated=True, fraction=0.51)
    assert not tool.passes(row) and tool.passes(row | dict(fraction=0.5))
    assert tool.passes(row | dict(target="sm_80")) and tool.passes(row | dict(gated=False))
    mma = dict(target=tool.GATED_TARGET, gated=True, per_mma=48.5)
    assert not tool.passes(mma) and tool.passes(mma | dict(per_mma=48)) and not tool.passes(mma | dict(per_mma=None))


def test_speed_of_light_reads_a_real_build(tmp_path):
    """bench/tools/speed_of_light.py on one kernel's sm_90a build: hardware rounding, 128-bit accesses,
    within half its issue budget."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    tool = [sys.executable, str(ROOT / "bench" / "tools" / "speed_of_light.py")]
    result = subprocess.run(
        tool + ["--targets", "sm_90a", "--kernels", "gelu_gate"], capture_output=True, text=True, env=env, timeout=600
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("sm_90a")]
    assert len(rows) == 2 and all(row.endswith(" ok") and "integer rounding" not in row for row in rows), rows
    assert all("STG 128" in row or "-128" in row for row in rows), rows
    interpreted = subprocess.run(tool, capture_output=True, text=True, env=env | {"TRITON_INTERPRET": "1"})
    assert interpreted.returncode != 0 and "unset TRITON_INTERPRET" in interpreted.stderr


def test_fp32_accumulation_emulates_fma_and_ranks_the_orders():
    """bench/fp32_accumulation.py, whose figures back the fp32 embedder's fp64 block sums: its fma rounds
    once, and on the test's K the orders rank as kernels/patch_embed.py says."""
    script = runpy.run_path(str(ROOT / "bench" / "fp32_accumulation.py"))
    # (1 + 2**-12)**2 = 1 + 2**-11 + 2**-24 is a tie in fp32: a multiply rounds it to 1 + 2**-11, so a
    # separate add of -(1 + 2**-11) gives 0, where one fma keeps 2**-24.
    a = np.array([[1 + 2**-12]], np.float32)
    acc = np.array([[-(1 + 2**-11)]], np.float32)
    assert script["fma_chain"](a, a, acc)[0, 0] == np.float32(2**-24)

    rng = np.random.default_rng(0)
    a = (2 * rng.random((32, 768)) - 1).astype(np.float32)
    b = (rng.standard_normal((768, 24)) / 768**0.5).astype(np.float32)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    orders = script["orders"](a, b)
    error = {name: np.linalg.norm(result - exact) for name, result in orders.items()}
    split = script["split_name"]
    assert error["K blocks of 32, summed in fp64 (fused)"] < error[split(4)] < error[split(1)], error

    small = ["--rows", "4", "--cols", "3", "--features", "40", "--seeds", "2"]
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "fp32_accumulation.py"), *small],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert len(result.stdout.splitlines()) == 2 + len(orders), result.stdout


def start_pytest_shards(out, test_file, shards, **env):
    """bench/tools/pytest_shards.py over ``test_file`` in ``shards`` processes, started; returns the process."""
    command = [*TIME_BOXED, sys.executable, str(ROOT / "bench" / "tools" / "pytest_shards.py")]
    command += ["--out", str(out), "--shards", str(shards)]
    command += ["--", "-p", "no:cacheprovider", str(test_file)]
    env = {**os.environ, **env}
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def test_pytest_shards_run_every_test_in_one_shard(tmp_path):
    """Shard I of N runs every N-th test from the I-th; a failure in any shard fails the run, and the
    runner prints it with each shard's summary."""
    test_file = tmp_path / "test_seven.py"
    test_file.write_text("import pytest\n@pytest.mark.parametrize('i', range(7))\ndef test_n(i):\n    assert i != 5\n")
    process = start_pytest_shards(tmp_path / "out", test_file, 3)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 1, output
    for shard in range(3):
        cases = ElementTree.parse(tmp_path / "out" / f"shard.{shard}.xml").iter("testcase")
        assert [case.get("name") for case in cases] == [f"test_n[{i}]" for i in range(shard, 7, 3)]
    assert any(line.startswith("FAILED ") and "::test_n[5]" in line for line in output.splitlines()), output
    assert "shard 2: exit 1: 1 failed, 1 passed, 5 deselected" in output, output


def test_pytest_shards_pass_an_interrupt_to_every_shard(tmp_path):
    """At the time box's SIGINT every shard stops, prints its summary and writes its XML; a shard that
    ignores the SIGINT is killed after the grace period, so no test outlives the runner."""
    started, out = tmp_path / "started", tmp_path / "out"
    started.mkdir()
    test_file = tmp_path / "test_waits.py"
    test_file.write_text(
        "import os, pathlib, signal, time, pytest\n"
        "@pytest.mark.parametrize('shard', range(2))\n"
        "def test_waits(shard):\n"
        "    if shard == 1:\n"
        "        signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "    (pathlib.Path(os.environ['STARTED']) / str(shard)).touch()\n"
        "    time.sleep(60)\n"
    )
    process = start_pytest_shards(out, test_file, 2, STARTED=str(started))
    deadline = time.monotonic() + 120
    while len(list(started.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    process.send_signal(signal.SIGINT)
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 130, output
    assert "shard 0: exit 2: " in output and f"shard 1: exit {-signal.SIGKILL}: " in output, output
    assert "KeyboardInterrupt" in (out / "shard.0.log").read_text()
    ElementTree.parse(out / "shard.0.xml")  # written whole on the interrupt


def test_pytest_shards_refuse_a_bad_shard(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "pytest_shards", "--shard=2/2", str(tmp_path)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "bench" / "tools")},  # pytest and the plugin are all it needs
        timeout=120,
    )
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, result.stdout + result.stderr
    assert "--shard: expected I/N with 0 <= I < N, got '2/2'" in result.stderr, result.stderr


GPU_RUN_STEPS = (
    "kernel_tests",
    "bench",
    "attention",
    "planner_check",
    "gpu_tests",
    "vllm_encoder",
    "profile",
    "ncu",
    "encoder_compiled",
    "epilogue",
)
GPU_RUN_DEFAULT_STEPS = GPU_RUN_STEPS[:4]  # what a call naming no steps runs
BENCH_FILES = ["log.txt", "memory.png", "results.csv", "results.md", "time.png"]
BENCH_FILES += ["low_memory.csv"] if DEVICE.type == "cuda" else []  # the scenario runs on CUDA; no empty CSV


def run_gpu_run_dry(expected_code, *args, cwd, **env):
    """bench/gpu_run.sh at toy sizes from ``cwd`` with ``args``; returns the finished process."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "GPU_RUN_DRY": "1", "PYTHON": sys.executable, **env}
    result = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_run.sh"), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=1800,
    )
    assert result.returncode == expected_code, result.stdout + result.stderr
    return result


def gpu_run_log(out, expected_code, *args, **env):
    """The log of ``run_gpu_run_dry`` into ``out``."""
    run_gpu_run_dry(expected_code, *args, cwd=out.parent, **env)
    return (out / "gpu_run.log").read_text()


def assert_ran(log, steps):
    """Each of ``steps`` ran without failing, in that order, and no other step ran."""
    for step in steps:
        assert f"=== {step} took" in log and f"=== {step} FAILED" not in log, log
    started = [line.split()[1] for line in log.splitlines() if line.startswith("=== ") and "(box " in line]
    assert started == list(steps), log


def archived(out):
    """The paths of the files in ``out``'s checks.tgz."""
    with tarfile.open(out / "checks.tgz") as archive:
        return {os.path.normpath(member.name) for member in archive.getmembers() if member.isfile()}


def test_gpu_run_kernel_tests_exist():
    """The dry run runs one file of the kernel tests: the others must exist for the run on a GPU to find them."""
    listed = re.search(r"^kernel_tests=\(([^)]*)\)", (ROOT / "bench" / "gpu_run.sh").read_text(), re.MULTILINE)
    paths = listed[1].split()
    assert paths and all((ROOT / path).is_file() for path in paths), paths


def test_gpu_run_dry_run(tmp_path):
    """bench/gpu_run.sh end to end at toy sizes, in its two calls: with no steps named the install, the kernel
    tests, the bench, the attention paths and the planner; then the other steps, into a folder of their own
    (named by GPU_RUN_OUT this time). Each keeps the folder to a few files: the bench's, the log, and an
    archive of the rest."""
    first, second = tmp_path / "first", tmp_path / "second"
    first_log = gpu_run_log(first, 0, "--out", str(first))
    assert_ran(first_log, GPU_RUN_DEFAULT_STEPS)
    assert "### targets" in first_log, "bench/goals.py judges the bench's results.csv"
    assert "--headline" in first_log, "the bench step runs the headline rows"
    assert sorted(path.name for path in first.iterdir()) == sorted([*BENCH_FILES, "checks.tgz", "gpu_run.log"])
    shards = {f"kernel_tests/shard.{shard}.{kind}" for shard in range(2) for kind in ("log", "xml")}
    assert archived(first) == {*shards, "attention_paths.md", "planner_check.json", "planner_check.csv"}
    rest = GPU_RUN_STEPS[len(GPU_RUN_DEFAULT_STEPS) :]
    assert_ran(gpu_run_log(second, 0, *rest, GPU_RUN_OUT=str(second)), rest)
    assert sorted(path.name for path in second.iterdir()) == ["checks.tgz", "gpu_run.log"]
    profiled = ["profile.csv", "profile.md"]  # the encoder rows' --profile
    compiled = {f"encoder_compiled/{name}" for name in [*BENCH_FILES, *profiled] if name != "low_memory.csv"}
    epilogue = {f"epilogue/{name}" for name in BENCH_FILES if name != "low_memory.csv"}
    checks = {"gpu_tests.xml", "vllm_encoder.md", *compiled, *epilogue}
    assert archived(second) == checks  # no ncu.txt: the dry run's profiled calls run without the profiler


def test_gpu_run_refuses_an_unknown_step_or_option(tmp_path):
    result = run_gpu_run_dry(2, "--out", str(tmp_path), "bench", "gpu_test", cwd=tmp_path)
    assert "unknown step 'gpu_test'" in result.stderr and "kernel_tests, bench" in result.stderr, result.stderr
    result = run_gpu_run_dry(2, "--outdir", str(tmp_path), cwd=tmp_path)
    assert "unknown option '--outdir'" in result.stderr, result.stderr
    assert not any(tmp_path.iterdir()), "nothing ran"


@pytest.mark.skipif(DEVICE.type == "cuda", reason="a CUDA GPU is here")
def test_gpu_run_stops_without_a_gpu_unless_dry(tmp_path):
    """Without CUDA the GPU tests skip, which pytest counts a pass: a run that is not dry stops first."""
    log = gpu_run_log(tmp_path / "out", 2, "--out", "out", GPU_RUN_DRY="0")
    assert "no CUDA GPU here" in log and "===" not in log, log


def test_gpu_run_notes_a_missing_ncu_and_goes_on(tmp_path):
    """A GPU machine without Nsight Compute: the ncu step says so, fails nothing, and the next step runs. The
    run is not dry (a dry run profiles without ncu), so a stand-in python answers every call, the GPU check too."""
    if shutil.which("ncu") or Path("/usr/local/cuda/bin/ncu").exists():
        pytest.skip("Nsight Compute is installed here")
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\nexit 0\n")
    python.chmod(0o755)
    log = gpu_run_log(tmp_path / "out", 0, "--out", "out", "ncu", "planner_check", GPU_RUN_DRY="0", PYTHON=str(python))
    assert "=== ncu skipped: no Nsight Compute (ncu) on this machine" in log, log
    assert_ran(log, ("planner_check",))


def test_gpu_run_past_its_deadline_skips_steps_and_still_archives(tmp_path):
    """With no time left before GPU_RUN_DEADLINE_S, every step is skipped and said so, the run fails, and the
    archive and log are still written (into an --out relative to the caller's folder)."""
    log = gpu_run_log(tmp_path / "out", 1, "--out", "out", *GPU_RUN_STEPS, GPU_RUN_DEADLINE_S="0")
    for step in GPU_RUN_STEPS:
        assert f"=== {step} skipped: " in log and f"=== {step} took" not in log, log
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == ["checks.tgz", "gpu_run.log"]


def test_gpu_run_runs_from_a_staged_copy_when_pip_cannot_install(tmp_path):
    """Where pip cannot install offline, the steps still run, from a copy of the source in the installed
    layout (fused_vision.kernels from kernels/): a step of each kind, a pytest run (from the copy's tests/),
    a bench tool and a bench script (test_gpu_run_dry_run runs every step)."""
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\n[ "$1 $2" = "-m pip" ] && exit 1\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    out = tmp_path / "out"
    steps = ("kernel_tests", "attention", "planner_check")
    log = gpu_run_log(out, 0, "--out", str(out), *steps, PYTHON=str(python))
    staged = log.split("running from a staged copy of the source in ")[1].split()[0]
    assert f"from {staged}/fused_vision " in log, "the steps import the staged copy"
    assert_ran(log, steps)
