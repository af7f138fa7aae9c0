"""The benchmark from a source checkout: ``python bench/run.py [options]`` = ``python -m fused_vision bench [options]``.

Options: ``python bench/run.py --help``. The H200 run of the README's table is ``bash bench/h200.sh``
(its correctness checks, then this).
"""

import sys

from fused_vision.__main__ import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
