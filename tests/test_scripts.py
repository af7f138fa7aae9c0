"""The GPU scripts run their own code at tiny sizes here, so the H200 run does not debug them."""

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

from conftest import DEVICE

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_checks_smoke(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_checks.py"), "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "gpu_checks.json").read_text())
    assert len(report["results"]) == 17 and all(row["ok"] for row in report["results"])


def test_gpu_checks_fail_where_auto_falls_back_to_the_reference(tmp_path):
    """Two checks call the ops with backend "auto", as the patched model does: if a kernel fails there the
    reference runs and can pass the check, so the script must report the fallback and fail."""
    broken_lookup = (
        "import runpy, sys\n"
        "from fused_vision.kernels import position_embedding\n"
        "def broken(*args, **kwargs):\n"
        "    raise RuntimeError('simulated launch failure')\n"
        "position_embedding.position_embeddings = broken\n"
        f"sys.argv = ['gpu_checks.py', '--smoke', '--out', {str(tmp_path)!r}]\n"
        f"runpy.run_path({str(ROOT / 'bench' / 'gpu_checks.py')!r}, run_name='__main__')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", broken_lookup],
        capture_output=True,
        text=True,
        env=dict(os.environ, TRITON_INTERPRET="1"),
        timeout=300,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    rows = {row["check"]: row for row in json.loads((tmp_path / "gpu_checks.json").read_text())["results"]}
    for check in ("check_no_sync_where_syncs_are_forbidden", "check_cuda_graph_replay"):
        row = rows[f"{check}_ran_the_kernels"]
        assert not row["ok"] and "position_embeddings on cpu" in row["error"], row
    # On a GPU the reference would meet the out-of-range id unchecked, a device-side assert that no later
    # check survives: the check stops before that call.
    row = rows["check_no_sync_where_syncs_are_forbidden"]
    assert "lookup: 'auto' fell back to the reference" in row["error"], row


def test_every_kernel_compiles_for_hopper_and_fits(tmp_path):
    """bench/hopper_compile.py: each kernel at its GPU launch configs, built for sm_90a with Triton's own
    ptxas, within shared memory and without register spills."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "hopper_compile.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = (tmp_path / "hopper_compile.csv").read_text().splitlines()
    assert len(rows) > 30 and all(row.endswith(",ok") for row in rows[1:]), "\n".join(rows)


H200_STEPS = ("gpu_checks", "bench", "planner_check", "gpu_tests")
H200_FIRST_CALL = ("gpu_checks", "bench")  # what a call naming no steps runs
BENCH_FILES = ["log.txt", "low_memory.csv", "results.csv", "results.md", "time.png"]
BENCH_FILES += ["memory.png"] if DEVICE.type == "cuda" else []  # peaks are measured on CUDA only


def run_h200_dry(out, expected_code, *steps, **env):
    """bench/h200.sh at toy sizes into ``out``, with ``steps`` as its arguments; returns the finished process."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "H200_DRY_RUN": "1", "OUT": str(out), "PYTHON": sys.executable, **env}
    result = subprocess.run(
        ["bash", str(ROOT / "bench" / "h200.sh"), *steps], capture_output=True, text=True, env=env, timeout=600
    )
    assert result.returncode == expected_code, result.stdout + result.stderr
    return result


def h200_log(out, expected_code, *steps, **env):
    """The log of ``run_h200_dry``."""
    run_h200_dry(out, expected_code, *steps, **env)
    return (out / "h200.log").read_text()


def assert_ran(log, steps):
    """Each of ``steps`` ran without failing, in that order, and no other step ran."""
    for step in steps:
        assert f"=== {step} took" in log and f"=== {step} FAILED" not in log, log
    started = [line.split()[1] for line in log.splitlines() if line.startswith("=== ") and "(box " in line]
    assert started == list(steps), log


def archived(out):
    """The names of the files in ``out``'s checks.tgz."""
    with tarfile.open(out / "checks.tgz") as archive:
        return {Path(member.name).name for member in archive.getmembers() if member.isfile()}


def test_h200_script_dry_run(tmp_path):
    """bench/h200.sh end to end at toy sizes, as a lease makes it in two calls: with no arguments the
    install, the correctness checks and the bench (what the issues need first); then the other two steps,
    into an emptied $OUT as the device tool empties it. Each call hands back its files within the 8-file limit."""
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    assert_ran(h200_log(first, 0), H200_FIRST_CALL)
    assert sorted(path.name for path in first.iterdir()) == sorted([*BENCH_FILES, "checks.tgz", "h200.log"])
    assert archived(first) == {"gpu_checks.json"}
    rest = tuple(step for step in H200_STEPS if step not in H200_FIRST_CALL)
    assert_ran(h200_log(second, 0, *rest), rest)
    assert sorted(path.name for path in second.iterdir()) == ["checks.tgz", "h200.log"]
    assert archived(second) == {"planner_check.json", "planner_check.csv", "gpu_tests.xml"}


def test_h200_script_refuses_an_unknown_step(tmp_path):
    result = run_h200_dry(tmp_path, 2, "bench", "gpu_check")
    assert "unknown step 'gpu_check'" in result.stderr and "gpu_checks, bench" in result.stderr, result.stderr
    assert not any(tmp_path.iterdir()), "nothing ran"


def test_h200_script_past_its_deadline_skips_steps_and_still_archives(tmp_path):
    """With no time left before H200_DEADLINE_S, every step is skipped and said so, the run fails, and the
    archive and log still come back."""
    log = h200_log(tmp_path, 1, *H200_STEPS, H200_DEADLINE_S="0")
    for step in H200_STEPS:
        assert f"=== {step} skipped: " in log and f"=== {step} took" not in log, log
    assert sorted(path.name for path in tmp_path.iterdir()) == ["checks.tgz", "h200.log"]


def test_h200_script_runs_from_a_staged_copy_when_pip_cannot_install(tmp_path):
    """The device has no registry: should the offline install fail, the steps still run, from a copy of the
    source in the installed layout (fused_vision.kernels from kernels/)."""
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\n[ "$1 $2" = "-m pip" ] && exit 1\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    log = h200_log(out, 0, *H200_STEPS, PYTHON=str(python))
    staged = log.split("running from a staged copy of the source in ")[1].split()[0]
    assert f"from {staged}/fused_vision " in log, "the steps import the staged copy"
    assert_ran(log, H200_STEPS)
