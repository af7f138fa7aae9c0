"""The fused ops at real Gemma 4 shapes on a CUDA GPU: ``pytest -m gpu tests/gpu``.

Without CUDA the tests skip; FUSED_VISION_GPU_TESTS_SMOKE=1 runs them at tiny sizes instead (on a CPU under
TRITON_INTERPRET=1), so that their own code is tested where no GPU is. pytest runs the files in name order:
the checks only a GPU can make (graph capture, sync debug mode) come first and the slowest to build (the
pooler past 2**31 elements, whose int64 strides build its kernels again) last, so a time box cuts that one.
"""

import contextlib
import dataclasses

import pytest
import torch

import fused_vision
from fused_vision import _dispatch
from fused_vision._environment import flag

from helpers import DEVICE

SMOKE = flag("FUSED_VISION_GPU_TESTS_SMOKE")
P = 10240  # the position table's rows per axis


@dataclasses.dataclass(frozen=True)
class Sizes:
    batch: int
    soft_tokens: int  # per image; an image has 9 patches per soft token
    hidden: int
    features: int  # pixel values per patch (3 x 16 x 16 in Gemma 4)
    big: tuple[int, int, int]  # (B, N, D) of a lookup output with B * N * D over 2**31
    pool_big: tuple[int, int]  # (L, D) of one pooled item with L * D over 2**31
    past_2_31: bool  # whether big and pool_big do reach past 2**31 elements


# Image 32 x 280 soft tokens (N = 2520) at the 26B/31B width; big: a lookup output of 2.21e9 elements.
REAL_SIZES = Sizes(32, 280, 1152, 768, big=(190, 10080, 1152), pool_big=(1_865_000, 1152), past_2_31=True)
SMOKE_SIZES = Sizes(2, 28, 40, 48, big=(2, 630, 16), pool_big=(50, 16), past_2_31=False)
SIZES = SMOKE_SIZES if SMOKE else REAL_SIZES


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gpu: needs a CUDA GPU (FUSED_VISION_GPU_TESTS_SMOKE=1: tiny sizes on any device instead)"
    )


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") and not (torch.cuda.is_available() or SMOKE):
        pytest.skip("needs a CUDA GPU (FUSED_VISION_GPU_TESTS_SMOKE=1 runs it at tiny sizes on the CPU)")


@pytest.fixture(scope="session", autouse=True)
def environment(record_testsuite_property):
    """The machine and versions in the JUnit XML, and fp32 references that do not run on TF32, which an
    environment can switch on."""
    for name, value in dict(
        device=torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu",
        torch=torch.__version__,
        fused_vision=fused_vision.__version__,
        sizes=SIZES,
    ).items():
        record_testsuite_property(name, value)
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(previous)


@pytest.fixture(autouse=True)
def on_the_kernels():
    """Each test from seed 0; after it, its CUDA errors surface as its own, and it fails if backend "auto"
    fell back to the reference, whose results say nothing of the kernels."""
    torch.manual_seed(0)
    yield
    fell_back = sorted(_dispatch._failed)
    _dispatch._failed.clear()  # the next test runs the kernels again
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)
        torch.cuda.empty_cache()
    assert not fell_back, "backend 'auto' fell back to the reference: " + ", ".join(
        f"{op} on {device_type}" for op, device_type in fell_back
    )


@contextlib.contextmanager
def sync_debug_mode(mode: str):
    """torch's CUDA sync debug mode at ``mode`` ("warn" or "error") for the block, then as it was."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def image_ids(batch, soft_tokens, k=3, generator=None):
    """Ids as Gemma 4's processor makes them: a row-major grid of k*k*soft_tokens patches or fewer, then
    (-1, -1) padding. Widths vary per item so some items carry padding."""
    seq_len = k * k * soft_tokens
    ids = torch.full((batch, seq_len, 2), -1, dtype=torch.int64)
    for item in range(batch):
        width_slots = int(torch.randint(4, 2 * int(soft_tokens**0.5), (1,), generator=generator))
        height_slots = max(1, soft_tokens // width_slots)
        ys, xs = torch.meshgrid(torch.arange(k * height_slots), torch.arange(k * width_slots), indexing="ij")
        grid = torch.stack([xs.flatten(), ys.flatten()], dim=-1)
        ids[item, : len(grid)] = grid
    return ids.to(DEVICE)
