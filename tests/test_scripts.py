"""The GPU scripts run their own code at tiny sizes here, so the H200 run does not debug them."""

import json
import os
import subprocess
import sys
from pathlib import Path

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
    assert len(report["results"]) == 9 and all(row["ok"] for row in report["results"])


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
