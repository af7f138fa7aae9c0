"""Print a row of docs/compatibility.md's table for the running environment.

    python bench/tools/tested_with.py RESULT     # e.g. "all pass", after running the suite here

The versions come from the interpreter and the installed packages, so a row is never typed by hand.
"""

import importlib.metadata
import platform
import sys


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def row(result: str) -> str:
    python = ".".join(platform.python_version_tuple()[:2])
    cells = (python, version("torch"), version("triton"), version("transformers"), result)
    return "| " + " | ".join(cells) + " |"


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python bench/tools/tested_with.py RESULT")
    print(row(sys.argv[1]))
