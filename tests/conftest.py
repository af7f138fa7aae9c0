"""pytest's setup for the tests: the kernels run under TRITON_INTERPRET=1 on CPU machines (set before
fused_vision is imported); shared fixtures. Helpers live in helpers.py."""

import atexit
import os
import shutil
import tempfile

import pytest
import torch

from helpers import poison_empty

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:
    # Stock's half-precision GEMMs accumulate in fp32 throughout, as the tests' rounding bounds assume;
    # torch's default lets cuBLAS round split-K partial sums to bf16/fp16, one more rounding per split.
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False

# torch.compile's graphs in a cache of this run's own: a graph another version of the ops left on disk
# (a backward op of another name, say) must not stand in for the one under test.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="fused_vision_tests_inductor_")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)


@pytest.fixture
def checked_ids(monkeypatch):
    """The id checks on wherever they can run: on a GPU the kernels' paths check only on request."""
    monkeypatch.setenv("FUSED_VISION_CHECK_IDS", "1")


@pytest.fixture
def poisoned(monkeypatch):
    poison_empty(monkeypatch)


@pytest.fixture
def fused_layers(monkeypatch):
    """The calls of the fused layer, one entry each: how many layers ran fused."""
    from fused_vision.encoder import fused_layer

    calls, layer = [], fused_layer._fused_layer
    monkeypatch.setattr(fused_layer, "_fused_layer", lambda *args, **kwargs: calls.append(1) or layer(*args, **kwargs))
    return calls
