"""kernels/ ships as fused_vision.kernels, never as a top-level `kernels` (Hugging Face's kernel hub)."""

import subprocess
import sys


def test_kernels_is_not_a_top_level_module(tmp_path):
    probe = (
        "import importlib.util, fused_vision.kernels.position_embedding as k; "
        "print(importlib.util.find_spec('kernels'))"
    )
    # Run outside the source tree so the checkout itself is not on sys.path.
    result = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "None", f"a top-level `kernels` module is importable: {result.stdout}"
