"""Backend choice: Triton where Triton drives the tensors' device, the PyTorch reference elsewhere.

backend="auto" picks Triton for CUDA/ROCm/XPU tensors, or for CPU tensors when TRITON_INTERPRET=1,
and the reference otherwise; FUSED_VISION_BACKEND ("triton" or "reference") overrides "auto".
Under "auto", a Triton compile or launch failure warns once and sends that op on that device type to
the reference from then on, so a broken toolchain costs one failed compile, not one per call.
Input errors (ValueError, TypeError) and running out of memory (torch.OutOfMemoryError) are never
swallowed by the fallback.
"""

import contextlib
import functools
import warnings
from collections.abc import Callable

import torch
import torch.autograd.forward_ad as fwAD
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from . import _device
from ._environment import choice

BACKENDS = ("auto", "triton", "reference")
ENV_BACKEND = "FUSED_VISION_BACKEND"
_TRITON_DEVICE_TYPES = ("cuda", "xpu")  # ROCm tensors report "cuda"

_failed: set[tuple[str, str]] = set()  # (op, device type) whose kernel failed under "auto"
_failure_reasons: dict[tuple[str, str], str] = {}  # the error of each, for an integration's report


@functools.cache
def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_drives(device: torch.device) -> bool:
    """Whether a Triton kernel can run on tensors of this device here."""
    if not triton_importable():
        return False
    from .kernels.common import interpreting

    return device.type in _TRITON_DEVICE_TYPES or (device.type == "cpu" and interpreting())


def untiled(gpu_configs: Callable, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why an autotuned kernel, whose ``gpu_configs(dtype, limits)`` lists its tiles, has none for ``dtype``
    on ``device``; None where it has (or the device's limits are not known: every tile is offered)."""
    limits = _device.device_limits(device)
    if limits is None or gpu_configs(dtype, limits):
        return None
    if limits.family is None:
        families = ", ".join(_device.FAMILIES)
        return f"has no tile for {limits.arch}, outside every tensor-core family its tiles are built for ({families})"
    if not limits.multiplies(dtype):
        return f"has no {dtype} tile for {limits.arch}, where Triton builds its dots on the FMA units"
    return f"has no {dtype} tile within the {limits.shared_memory // 1024} KiB of shared memory of {limits.arch}"


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")


def _requested(backend: str) -> str:
    check_backend(backend)
    if backend != "auto":
        return backend
    return choice(ENV_BACKEND, BACKENDS, "auto")


def _named(backend: str) -> str:
    """How the caller asked for Triton: the argument, or the environment variable under "auto"."""
    return "backend='triton'" if backend == "triton" else f"{ENV_BACKEND}=triton"


def resolve_backend(backend: str, device: torch.device) -> str:
    """The backend a call will use: "triton", "reference", or "auto" (Triton, falling back on failure)."""
    requested = _requested(backend)
    if requested == "reference":
        return "reference"
    if triton_drives(device):
        return requested
    if requested == "triton":
        why = "triton is not installed" if not triton_importable() else f"Triton does not drive {device.type} tensors"
        raise RuntimeError(
            f"{_named(backend)}: {why} "
            "(set TRITON_INTERPRET=1 to run the kernels on the CPU, or use backend='reference')"
        )
    return "reference"


_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor  # vmap's and torch.func's tensors
_grad_tracking = torch._C._functorch.is_gradtrackingtensor  # torch.func.grad's, jacrev's, jvp's, ...
_functorch_transform = torch._C._functorch.peek_interpreter_stack  # None outside every torch.func transform
_functorch_unwrap = torch._C._functorch.get_unwrapped
_profiling = torch._C._autograd._profiler_enabled  # torch.profiler is recording


def every_item(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor beneath torch.func's wrappers, for the checks that read values.

    Under ``vmap`` it holds every mapped item, so a whole-tensor max or any asks all of them at once,
    and reading the answer is allowed (vmap refuses ``.item()`` on its own tensors). Elsewhere: ``tensor``.
    """
    while _functorch_wrapped(tensor):
        tensor = _functorch_unwrap(tensor)
    return tensor


def _grad_tracked(tensor: torch.Tensor) -> bool:
    """Whether a differentiating transform wraps ``tensor`` at any level: under grad(vmap(...)) a mapped
    input's grad wrapper lies beneath vmap's."""
    while _functorch_wrapped(tensor):
        if _grad_tracking(tensor):
            return True
        tensor = _functorch_unwrap(tensor)
    return False


def _plain(t: torch.Tensor) -> bool:
    """A tensor whose data a kernel can read: not a subclass, a transform's wrapper, a meta tensor or a
    lazily negated view (``x.conj().imag``, whose memory holds -x; the registered op resolves it)."""
    return type(t) in _PLAIN_TENSOR_TYPES and not t.is_meta and not _functorch_wrapped(t) and not t.is_neg()


def through_dispatcher(*tensors: torch.Tensor | None) -> bool:
    """Whether a call must go through its registered torch.library op: under torch.compile or another
    tracer (a dispatch mode, fake or other tensor subclasses, vmap's batched tensors), for meta tensors
    (the op's fake implementation gives their shapes), or when autograd will record it. Plain eager
    inference skips the dispatcher's overhead and calls the implementation directly; a kernel never
    sees a tensor it cannot read. Every tensor argument counts, the ids and padding mask included. Under
    torch's profiler too: the op's name then marks its kernels and ops in the trace."""
    if torch.compiler.is_compiling() or is_in_torch_dispatch_mode() or _profiling():
        return True
    grad = torch.is_grad_enabled()
    return any(t is not None and (not _plain(t) or grad and t.requires_grad) for t in tensors)


def reference_only(op: str, backend: str, *tensors: torch.Tensor | None) -> bool:
    """Whether the call must run the PyTorch reference, whose PyTorch ops the kernels and the registered
    ops cannot stand in for here: a torch.func differentiating transform (grad, jacrev, jvp, ...) wraps
    one of ``tensors`` (the registered ops' autograd lacks the ``setup_context`` functorch wants, an open
    torch bug: pytorch/pytorch#168393; vmap alone takes the registered op), or forward-mode AD carries a
    tangent on one (the kernels would drop it silently). Warned once; with backend="triton" this raises
    instead."""
    # The cheap global checks first: the tensors are looked at only inside a transform or a dual level.
    # (dynamo cannot trace the wrapper check: under torch.compile the registered op runs, as before.)
    in_transform = not torch.compiler.is_compiling() and _functorch_transform() is not None
    if in_transform and any(t is not None and _grad_tracked(t) for t in tensors):
        missing, runs = (
            "no torch.func support",
            "torch.func transforms run the PyTorch reference (pytorch/pytorch#168393)",
        )
    elif fwAD._current_level >= 0 and any(t is not None and fwAD.unpack_dual(t).tangent is not None for t in tensors):
        missing, runs = "no forward-mode AD", "forward-mode AD runs the PyTorch reference, which carries tangents"
    else:
        return False
    requested = _requested(backend)
    if requested == "triton":
        raise RuntimeError(f"{_named(backend)}: fused_vision.{op} has {missing}; use backend='reference'")
    if requested == "auto":
        warn_once(f"fused_vision.{op}: {runs}")
    return True


def route(op: str, backend: str, args: tuple, *, reference: Callable, registered: Callable, direct: Callable):
    """One public call of ``op`` on ``args``, its route decided here once: ``reference(*args)`` where only
    the PyTorch reference can run (``reference_only``), ``registered(*args, backend)``, the torch.library
    op, where the dispatcher must see the call (``through_dispatcher``), else ``direct(*args, backend)``,
    the same implementation without the dispatcher's overhead."""
    check_backend(backend)
    tensors = [arg for arg in args if isinstance(arg, torch.Tensor)]
    if reference_only(op, backend, *tensors):
        return reference(*args)
    if through_dispatcher(*tensors):
        return registered(*args, backend)
    return direct(*args, backend)


_WARNED: set[str] = set()


def warn_once(message: str, stacklevel: int = 3) -> None:
    """A RuntimeWarning once per process and message, for every fallback and integration's missing piece;
    ``stacklevel`` counts from the caller of ``warn_once`` (3: the caller of the public function calling it)."""
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=stacklevel + 1)


def fallbacks() -> list[str]:
    """Every fallback this process has taken so far, with its reason: each ``warn_once`` message, and each op
    whose Triton kernel failed under "auto" (then the reference runs it on that device type)."""
    failed = [
        f"fused_vision.{op} on {device_type} runs the PyTorch reference: its Triton kernel failed "
        f"({_failure_reasons.get((op, device_type), 'no reason kept')})"
        for op, device_type in sorted(_failed)
    ]
    return [*sorted(_WARNED), *failed]


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """Make ``device`` the current one while a kernel launches: Triton launches on the current device,
    whatever device its arguments are on, and a model spread over GPUs (``device_map="auto"``) calls the
    ops with tensors on another one. A no-op, without a device switch, in the usual case."""
    if device.type not in _TRITON_DEVICE_TYPES or device.index is None:
        return contextlib.nullcontext()
    runtime = getattr(torch, device.type)  # torch.cuda or torch.xpu
    if runtime.current_device() == device.index:
        return contextlib.nullcontext()
    return runtime.device(device.index)


def dispatch(
    op: str,
    backend: str,
    device: torch.device,
    triton_fn: Callable,
    reference_fn: Callable,
    *args,
    untiled_by: Callable[..., str | None] | None = None,
):
    """Run ``triton_fn(*args)`` (on ``device``) or ``reference_fn(*args)`` as ``backend`` says.

    ``untiled_by(*args)``: why the kernel has no tile for these arguments on this device (``untiled``), if
    it has none: then "auto" warns once and runs the reference, and "triton" raises."""
    chosen = resolve_backend(backend, device)
    if chosen == "reference" or (chosen == "auto" and (op, device.type) in _failed):
        return reference_fn(*args)
    if untiled_by is not None and (why := untiled_by(*args)):
        if chosen == "triton":
            raise RuntimeError(f"{_named(backend)}: fused_vision.{op}'s kernel {why}; use backend='reference'")
        warn_once(f"fused_vision.{op}: its kernel {why}: the PyTorch reference runs it", stacklevel=4)
        return reference_fn(*args)
    try:
        with on_device(device):
            return triton_fn(*args)
    except (ValueError, TypeError):  # the input's fault: the reference would raise it too
        raise
    except torch.OutOfMemoryError:  # the device's state, not the kernel's: it runs again once memory frees
        raise
    except Exception as exc:  # compile and launch errors of any kind
        if chosen == "triton":  # asked for by name: its errors are the caller's to see
            raise
        _failed.add((op, device.type))
        _failure_reasons[op, device.type] = f"{type(exc).__name__}: {exc}"
        warnings.warn(
            f"fused_vision.{op}: the Triton kernel failed on {device.type} ({type(exc).__name__}: {exc}); "
            "this op uses the PyTorch reference from now on. "
            f"Set {ENV_BACKEND}=reference to silence this, or pass backend='triton' to raise the error.",
            RuntimeWarning,
            stacklevel=3,
        )
        return reference_fn(*args)
