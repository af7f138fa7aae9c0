"""``python -m fused_vision`` and the ``fused-vision`` console script: the bench (``fused_vision.bench.cli``)."""

import sys

from .bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
