"""Run pytest in parallel shards on one machine: the kernel tests on the GPU (bench/gpu_run.sh's kernel_tests step).

Their time goes to building kernels, not running them: ~216 kernels, which took ~250 s to build for sm_90
on this project's 2-core CPU machine, then seconds on the GPU. A process builds one kernel at a time, so N
processes share the building, each running every N-th collected test: neighbours in a parametrization
build different kernels and go to different shards, and a kernel one shard has built loads from Triton's
on-disk cache in the others.

    python bench/tools/pytest_shards.py --out DIR [--shards N] -- PYTEST_ARGS...

Each shard writes DIR/shard.I.log and DIR/shard.I.xml (JUnit). This prints each shard's failures
and summary line, and exits 0 if every shard passed, 1 if any failed, 130 if interrupted. A SIGINT (the
time box's) goes to every shard once, so each prints its summary and writes its XML; shards still running
10 s later are killed.

This module is also the pytest plugin that gives the shards their ``--shard I/N`` option (``-p pytest_shards``).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

GRACE_S = 10  # gpu_run.sh kills this runner 15 s after its SIGINT
# Prime: a parameter of 2 to 6 values cycling in step with the shards would give some shards every test of
# one value (8 shards: every `triton` test of a triton/reference pair to the even ones, every build to 4 cores).
# 13 on the GPU machine's 16 cores leaves three to ptxas, which each build runs beside its shard.
DEFAULT_SHARDS = 13


def pytest_addoption(parser):
    parser.addoption("--shard", metavar="I/N", help="run every N-th collected test from the I-th (0 <= I < N)")


def pytest_collection_modifyitems(config, items):
    shard = config.getoption("shard")
    if shard is None:
        return
    try:
        index, count = map(int, shard.split("/"))
    except ValueError:
        index, count = -1, 0
    if not 0 <= index < count:
        raise pytest.UsageError(f"--shard: expected I/N with 0 <= I < N, got {shard!r}")
    config.hook.pytest_deselected(items=[item for position, item in enumerate(items) if position % count != index])
    items[:] = items[index::count]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for each shard's log and JUnit XML")
    parser.add_argument(
        "--shards",
        type=int,
        default=min(DEFAULT_SHARDS, os.cpu_count() or 1),
        help=f"pytest processes (default: {DEFAULT_SHARDS}, or the CPUs where fewer)",
    )
    parser.add_argument("pytest_args", nargs="+", help="test files and pytest options, after --")
    args = parser.parse_args()
    if args.shards < 1:
        parser.error(f"--shards: expected at least 1, got {args.shards}")
    args.out.mkdir(parents=True, exist_ok=True)
    here = str(Path(__file__).resolve().parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))
    print(f"pytest_shards: {args.shards} shards of: {' '.join(args.pytest_args)}", flush=True)
    shards, interrupted = [], False
    try:
        for index in range(args.shards):
            command = [
                sys.executable, "-m", "pytest", "-q", "-p", "pytest_shards", f"--shard={index}/{args.shards}",
                "--junitxml", str(args.out / f"shard.{index}.xml"), *args.pytest_args,
            ]  # fmt: skip
            with open(args.out / f"shard.{index}.log", "w") as log:
                # A session of its own: a Ctrl-C at a terminal reaches the shards once, through this runner.
                shard = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            shards.append(shard)
        for shard in shards:
            shard.wait()
    except KeyboardInterrupt:
        interrupted = True
        for shard in shards:
            shard.send_signal(signal.SIGINT)
        for shard in shards:
            try:
                shard.wait(GRACE_S)
            except subprocess.TimeoutExpired:
                shard.kill()
                shard.wait()
    for index, shard in enumerate(shards):
        lines = (args.out / f"shard.{index}.log").read_text(errors="replace").splitlines()
        failures = [line for line in lines if line.startswith(("FAILED ", "ERROR "))]
        summary = next((line for line in reversed(lines) if line.strip()), "(no output)")
        print(*failures, f"shard {index}: exit {shard.returncode}: {summary}", sep="\n")
    if interrupted:
        return 130
    # pytest's exit 5: this shard drew no tests (more shards than tests).
    return 0 if all(shard.returncode in (0, 5) for shard in shards) else 1


if __name__ == "__main__":
    sys.exit(main())
