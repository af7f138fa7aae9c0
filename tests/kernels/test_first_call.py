"""First calls of an autotuned kernel from several threads at once, without a GPU.

Triton's autotuner keeps a call's arguments on itself (``nargs``) while it prunes and times the candidates,
and sets them to None when its launch is done: a second thread's call in between prunes or times against
None. The interpreter's lock hides that from the CPU tests, so here the lock is off (as on a GPU), the
timing takes a while (as on a GPU), and the kernel's own launch is a stand-in that records its config.
"""

import threading
import time

import pytest
import torch

from fused_vision.kernels import common
from fused_vision.kernels import patch_embed as patch_embed_kernels

THREADS = 4


@pytest.fixture
def gpu_launches(monkeypatch):
    """The launchers as on a GPU (no interpreter, no lock), each kernel launch recorded, not run, and the
    autotuner fresh, timing each candidate for 20 ms."""
    tuned = patch_embed_kernels._patch_embed_tuned
    monkeypatch.setattr(common, "interpreting", lambda: False)
    monkeypatch.setattr(patch_embed_kernels, "interpreting", lambda: False)
    monkeypatch.setattr(tuned.autotuner, "cache", {})
    monkeypatch.setattr(tuned, "_best", {})
    timed, launched = [], []

    def timing(kernel_call, quantiles):
        timed.append(threading.get_ident())
        time.sleep(0.02)
        return [1.0 + len(timed) * 1e-3] * 3  # the first candidate timed is the fastest

    def launch(*args, **kwargs):
        launched.append(kwargs["BLOCK_M"])

    monkeypatch.setattr(tuned.autotuner, "_do_bench", timing)
    kernel = tuned.autotuner.fn.fn  # under the autotuner, its heuristics; under those, the kernel
    monkeypatch.setattr(kernel, "run", launch)
    return timed, launched


def test_first_calls_at_once_tune_once(gpu_launches):
    timed, launched = gpu_launches
    pixels, weight = torch.rand(2, 70, 48), torch.randn(40, 48, dtype=torch.float16)
    table, ids = torch.randn(2, 30, 40, dtype=torch.float16), torch.randint(0, 30, (2, 70, 2))
    padding = torch.zeros(2, 70, dtype=torch.bool)
    start, errors = threading.Barrier(THREADS), []

    def first_call():
        start.wait()
        try:
            patch_embed_kernels.patch_embed(pixels, weight, table, ids, padding)
        except Exception as error:  # handed to the test's thread
            errors.append(error)

    threads = [threading.Thread(target=first_call) for _ in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    candidates = len(patch_embed_kernels.gpu_configs(torch.float16))
    assert len(timed) == candidates and len(set(timed)) == 1, "one thread times each candidate once"
    assert len(launched) == THREADS and len(set(launched)) == 1, "every call launches the one config tuned"
