"""The bench tests' shared helpers: a tiny, quick run through the command line, its CSV files read back, and
bench/goals.py imported by its path."""

import csv
import importlib.util
import sys
from pathlib import Path

from fused_vision.bench.cli import main

from helpers import DEVICE


def read_csv(path):
    with path.open(newline="") as file:
        reader = csv.DictReader(file)
        return tuple(reader.fieldnames), list(reader)


def reliable(ceiling: dict) -> bool:
    """The rule for showing shares of a ceiling, from its CSV row: 10 calls or more, within 10 % of the median."""
    spread = (float(ceiling["ms_p80"]) - float(ceiling["ms_p20"])) / float(ceiling["ms_p50"])
    return int(ceiling["reps"]) >= 10 and spread <= 0.1


def run_cli(tmp_path, *args: str):
    out = tmp_path / "bench"
    assert main(["bench", "--device", DEVICE.type, "--tiny", "--quick", "--out", str(out), *args]) == 0
    return out


def load_goals():
    """bench/goals.py, a script rather than a module of the package."""
    spec = importlib.util.spec_from_file_location("bench_goals", Path(__file__).parents[2] / "bench" / "goals.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
