"""The package's layout: the plugins' entry points name modules that exist and load first, and no module of
fused_vision or its kernels imports itself back, as it loads or later (an import inside a function closes a
cycle too, only later)."""

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import fused_vision
import fused_vision.kernels

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = Path(fused_vision.__file__).parent
KERNELS = Path(fused_vision.kernels.__path__[0])


def test_the_plugins_import_first_in_a_fresh_process():
    """As an engine's entry point loads them: before anything else of fused_vision."""
    probe = "from fused_vision.integrations.vllm import vllm_plugin\n"
    probe += "from fused_vision.integrations.sglang import sglang_plugin\n"
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_entry_points_name_the_plugins():
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ reads pyproject.toml (tomllib)")

    groups = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    plugins = {"vllm.general_plugins": "vllm_plugin", "sglang.srt.plugins": "sglang_plugin"}
    for group, name in plugins.items():
        module, _, attribute = groups[group]["fused_vision_gemma4"].partition(":")
        assert attribute == name and getattr(importlib.import_module(module), name).__name__ == name


def module_name(path: Path) -> str:
    if path.parent == KERNELS:  # kernels/ installs as fused_vision.kernels, wherever it lies
        return f"fused_vision.kernels.{path.stem}"
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules() -> dict[str, Path]:
    """Every module of fused_vision, its kernels included, by name."""
    paths = [*PACKAGE.rglob("*.py"), *KERNELS.glob("*.py")]
    return {module_name(path): path for path in paths}


def imports(path: Path, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that the module at ``path`` imports, at its top level or inside functions."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()

    class Imports(ast.NodeVisitor):
        def visit_Import(self, node):
            found.update(alias.name for alias in node.names)

        def visit_ImportFrom(self, node):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            source = ".".join(part for part in (base, node.module) if part)
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                found.add(submodule if submodule in modules else source)

    Imports().visit(ast.parse(path.read_text(), str(path)))
    return found & modules


def import_cycle() -> list[str] | None:
    """A cycle in the graph of fused_vision's imports, as its modules in order; None where there is none."""
    paths = package_modules()
    graph = {name: imports(path, set(paths)) for name, path in paths.items()}
    done, stack = set(), []

    def visit(name):
        if name in stack:
            return [*stack[stack.index(name) :], name]
        if name in done:
            return None
        stack.append(name)
        cycle = next(filter(None, map(visit, sorted(graph[name]))), None)
        stack.pop()
        done.add(name)
        return cycle

    return next(filter(None, map(visit, sorted(graph))), None)


def test_no_module_imports_itself_back():
    cycle = import_cycle()
    assert cycle is None, " -> ".join(cycle)


def test_the_encoder_imports_no_integration():
    """``encoder/`` computes; the integrations patch its calls in and hand it its backend, never the reverse."""
    paths = package_modules()
    for name, path in paths.items():
        if name.startswith("fused_vision.encoder"):
            reached = {module for module in imports(path, set(paths)) if module.startswith("fused_vision.integrations")}
            assert not reached, f"{name} imports {sorted(reached)}"
