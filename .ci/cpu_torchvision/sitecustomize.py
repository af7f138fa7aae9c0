"""torchvision's wheel on the package index is a CUDA build: beside a CPU-only torch its C++ ops do not load,
and its import then fails, registering a fake kernel for ``torchvision::nms``, an op that was never defined.
Where its library does not load, defining that op's schema (and ``qnms``'s) first lets the import through;
the pure-PyTorch transforms that transformers' Gemma 4 processors use work as they do. On PYTHONPATH for the
engine tests only (.ci/run)."""

import importlib.util
from pathlib import Path

import torch

_spec = importlib.util.find_spec("torchvision")
if _spec is not None and _spec.origin is not None:
    try:
        torch.ops.load_library(next(Path(_spec.origin).parent.glob("_C*.so")))
    except (OSError, StopIteration):
        _library = torch.library.Library("torchvision", "DEF")
        for _op in ("nms", "qnms"):
            _library.define(f"{_op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
