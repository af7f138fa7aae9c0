"""kernels/ ships as fused_vision.kernels, never as a top-level `kernels` (Hugging Face's kernel hub)."""

import subprocess
import sys

import pytest


def test_kernels_is_not_a_top_level_module(tmp_path):
    probe = (
        "import importlib.util, fused_vision.kernels.position_embeddings as k; "
        "print(importlib.util.find_spec('kernels'))"
    )
    # Run outside the source tree so the checkout itself is not on sys.path.
    result = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "None", f"a top-level `kernels` module is importable: {result.stdout}"


def test_every_subpackage_is_listed_for_the_wheel():
    """pyproject lists its packages by hand (kernels/ maps to fused_vision.kernels): a new subpackage
    missing from that list would be left out of wheels while editable installs still work."""
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ reads pyproject.toml (tomllib)")
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"fused_vision.kernels"} | {
        ".".join(init.parent.relative_to(root).parts) for init in (root / "fused_vision").rglob("__init__.py")
    }
    assert listed == found
