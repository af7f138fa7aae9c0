"""pytest's setup for the tests: the kernels run under TRITON_INTERPRET=1 on CPU machines (set before
fused_vision is imported); shared fixtures. Helpers live in helpers.py."""

import os

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


@pytest.fixture
def poisoned(monkeypatch):
    poison_empty(monkeypatch)
