"""Shared test helpers: devices and dtypes, poisoned allocations, exact and bounded comparisons, threads."""

import contextlib
import threading
import warnings

import pytest
import torch
from torch import nn

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# A command prefix that time-boxes a step as bench/gpu_run.sh does: SIGINT at the box, SIGKILL 15 s later. It also
# gives a Python child default SIGINT handling where pytest runs with SIGINT ignored (a shell's `cmd &`).
TIME_BOXED = ["timeout", "--foreground", "-s", "INT", "-k", "15", "300"]
MEETING_TIMEOUT_S = 120  # how long a thread of ``run_together`` waits for the others


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def poison_empty(monkeypatch) -> None:
    """Make every torch.empty/empty_like NaN-filled (or -1 for integers), so unwritten outputs fail."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def fill(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            return t.fill_(float("nan"))
        return t.fill_(True if t.dtype == torch.bool else -1)

    monkeypatch.setattr(torch, "empty", lambda *a, **k: fill(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: fill(real_empty_like(*a, **k)))


@contextlib.contextmanager
def fallbacks_fail():
    """Every RuntimeWarning raises: an op or a layer that falls back fails the test. Except the packed
    encoder's attention per item for fp32, which is that dtype's path on CUDA (no varlen kernel takes it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        warnings.filterwarnings("ignore", "packed encoder: no varlen kernel for torch.float32", RuntimeWarning)
        yield


def assert_bit_identical(actual: torch.Tensor, expected: torch.Tensor, what: str = "output") -> None:
    """Exact equality, bit for bit (NaN == NaN when the bits agree), with the worst elements on failure."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    int_view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[actual.element_size()]
    differ = actual.contiguous().view(int_view) != expected.contiguous().view(int_view)
    if differ.any():
        where = differ.nonzero()[:5].tolist()
        detail = "; ".join(f"{tuple(i)}: {actual[tuple(i)].item()!r} vs {expected[tuple(i)].item()!r}" for i in where)
        raise AssertionError(f"{what}: {int(differ.sum())} of {differ.numel()} elements differ; first: {detail}")


def assert_close(actual, expected, *, atol, rtol, what="output") -> None:
    """torch.testing.assert_close with the worst elements named."""
    try:
        torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, equal_nan=False)
    except AssertionError as exc:
        error = (actual.double() - expected.double()).abs()
        worst = error.flatten().topk(min(5, error.numel())).indices
        coords = [tuple(int(c) for c in torch.unravel_index(i, error.shape)) for i in worst]
        detail = "; ".join(f"{c}: {actual[c].item():.6g} vs {expected[c].item():.6g}" for c in coords)
        raise AssertionError(f"{what}: {exc}\nworst: {detail}") from None


def relative_error(actual: torch.Tensor, exact: torch.Tensor, ord: float = 2) -> float:
    """‖actual − exact‖ / ‖exact‖ in float64, in the vector norm ``ord`` (inf: the worst element)."""
    exact = exact.double()
    return (torch.linalg.vector_norm(actual.double() - exact, ord) / torch.linalg.vector_norm(exact, ord)).item()


def assert_as_accurate_as_stock(actual, stock, exact, *, slack=1.5, floor=0.0, ords=(2,), what="output") -> None:
    """``actual``'s relative error against the float64 ``exact`` is at most ``slack`` times ``stock``'s, or
    ``floor``, in each norm of ``ords``: for results that are not bit-identical to stock because sums run
    in another order."""
    for ord in ords:
        actual_error, stock_error = relative_error(actual, exact, ord), relative_error(stock, exact, ord)
        bound = max(slack * stock_error, floor)
        assert actual_error <= bound, (
            f"{what}: relative error (norm {ord}) {actual_error:.3g} vs float64, stock's {stock_error:.3g}"
        )


def run_together(meeting_point: nn.Module, *calls):
    """Each of ``calls`` in a thread of its own, all of them meeting at ``meeting_point``'s first forward
    before any goes on (one call: it runs alone, through the same hook); their results, in order."""
    barrier = threading.Barrier(len(calls), timeout=MEETING_TIMEOUT_S)
    met = threading.local()

    def meet(module, args):
        if not getattr(met, "done", False):
            met.done = True
            barrier.wait()

    results, errors = [None] * len(calls), []

    def run(index, call):
        try:
            results[index] = call()
        except BaseException as exc:  # handed to the test's thread; the others stop waiting for this one
            errors.append(exc)
            barrier.abort()

    handle = meeting_point.register_forward_pre_hook(meet)
    try:
        threads = [threading.Thread(target=run, args=(index, call)) for index, call in enumerate(calls)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        handle.remove()
    if errors:
        raise errors[0]
    return results


def reverting_to_stock(*reverts, before=False, fresh_warnings=False):
    """The autouse fixture ``stock_after_each_test`` for a module to assign: it calls ``reverts`` in order
    after each test (and before it too, with ``before``); with ``fresh_warnings`` each test starts with an
    empty record of fused_vision's once-only warnings, so it sees the ones it causes."""

    @pytest.fixture(autouse=True, name="stock_after_each_test")
    def fixture(monkeypatch):
        if fresh_warnings:
            from fused_vision import _dispatch  # not at import: conftest imports this before it sets TRITON_INTERPRET

            monkeypatch.setattr(_dispatch, "_WARNED", set())
        if before:
            for revert in reverts:
                revert()
        yield
        for revert in reverts:
            revert()

    return fixture
