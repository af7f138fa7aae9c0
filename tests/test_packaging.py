"""kernels/ ships as fused_vision.kernels and never shadows another package named ``kernels`` (Hugging Face's
kernel hub, which transformers 5.25+ imports), from a checkout's root or from an installed wheel."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# What `import kernels` and `import fused_vision.kernels` resolve to, and whether transformers' Gemma 4 imports.
PROBE = """
import importlib.util, json, kernels
import fused_vision.kernels.position_embeddings as ours
if importlib.util.find_spec("transformers"):  # transformers 5.25+ imports Hugging Face's kernels here
    import transformers.models.gemma4.modeling_gemma4
print(json.dumps({"kernels": getattr(kernels, "__file__", None), "ours": ours.__file__}))
"""


def probe(cwd: Path, env: dict | None = None) -> dict:
    result = subprocess.run([sys.executable, "-c", PROBE], cwd=cwd, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def hub_kernels(tmp_path_factory) -> Path:
    """Hugging Face's installed ``kernels`` package, found from outside the checkout."""
    result = subprocess.run(
        [sys.executable, "-c", "import importlib.util as u; s = u.find_spec('kernels'); print(s and s.origin)"],
        cwd=tmp_path_factory.mktemp("elsewhere"),
        capture_output=True,
        text=True,
    )
    if result.stdout.strip() in ("", "None"):
        pytest.skip(f"Hugging Face's kernels is not installed (pip install kernels) {result.stderr}")
    return Path(result.stdout.strip())


@pytest.mark.parametrize("where", ["checkout_root", "elsewhere", "installed_wheel"])
def test_kernels_is_hugging_faces_and_ours_is_fused_vision_kernels(hub_kernels, where, tmp_path):
    env = None
    if where == "installed_wheel":
        pip = [sys.executable, "-m", "pip", "-q"]
        subprocess.run([*pip, "wheel", "--no-deps", "-w", tmp_path / "wheel", ROOT], check=True, capture_output=True)
        wheel = next((tmp_path / "wheel").glob("*.whl"))
        subprocess.run([*pip, "install", "--no-deps", "--target", tmp_path / "site", wheel], check=True)
        env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    found = probe(ROOT if where == "checkout_root" else tmp_path, env)
    if where == "installed_wheel":
        assert Path(found["ours"]).is_relative_to(tmp_path / "site" / "fused_vision" / "kernels"), found
    assert Path(found["kernels"]) == hub_kernels, f"`import kernels` from {where} gave {found['kernels']}"
    assert Path(found["ours"]).parent.name == "kernels" and Path(found["ours"]).parent != hub_kernels.parent


def test_the_kernels_folder_is_a_namespace_portion_only():
    """A folder with __init__.py first on sys.path would win over any installed ``kernels``."""
    assert not (ROOT / "kernels" / "__init__.py").exists()
    assert sorted(path.name for path in (ROOT / "kernels").glob("*.py"))


def test_every_subpackage_is_listed_for_the_wheel():
    """pyproject lists its packages by hand (kernels/ maps to fused_vision.kernels): a new subpackage
    missing from that list would be left out of wheels while editable installs still work."""
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ reads pyproject.toml (tomllib)")

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"fused_vision.kernels"} | {
        ".".join(init.parent.relative_to(ROOT).parts) for init in (ROOT / "fused_vision").rglob("__init__.py")
    }
    assert listed == found
