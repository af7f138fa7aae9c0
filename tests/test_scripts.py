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
