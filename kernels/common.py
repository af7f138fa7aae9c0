"""Helpers shared by the kernels: dtype mapping, interpreter detection, launch configs, autotuning per
operand dtype, rounding to the storage dtype."""

import functools
import threading

import torch
import triton
import triton.language as tl

from .. import _device
from .._device import MFMA, MMA_SYNC, TCGEN05, WGMMA, WMMA, DeviceLimits
from .._interpreter import hardware_arithmetic

TORCH_TO_TL = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def interpreting() -> bool:
    """Whether kernels run in Triton's CPU interpreter: TRITON_INTERPRET as Triton reads it (1, true, on or
    yes, in any case)."""
    return triton.knobs.runtime.interpret


def target_backend(device: torch.device) -> str:
    """The vendor a launch on ``device`` compiles for, as Triton's active driver names it ("cuda", "hip").
    Host and meta tensors (the interpreter's, and the build tools', which apply each target's own) take
    NVIDIA's: AMD's variants differ only in calling libm where NVIDIA's call approximations."""
    return "cuda" if device.type in ("cpu", "meta") else _driver_backend()


@functools.cache
def _driver_backend() -> str:
    return triton.runtime.driver.active.get_current_target().backend


# Triton's interpreter keeps global state while it runs a kernel: two threads inside it at once crash it.
_INTERPRETER_LOCK = threading.RLock()  # re-entrant: a launcher may call another (the pooler's slot pass)


def launcher(fn):
    """``fn``, a kernel launcher, serialised by one lock while kernels run in Triton's interpreter, which then
    computes as the GPU does (``hardware_arithmetic``); on a GPU, where launches are thread-safe, called as
    it is, with no lock."""

    @functools.wraps(fn)
    def serialised(*args, **kwargs):
        if not interpreting():
            return fn(*args, **kwargs)
        with _INTERPRETER_LOCK, hardware_arithmetic():
            return fn(*args, **kwargs)

    return serialised


def int32_inner_offsets(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or a contiguous copy of it where the kernels' int32 offsets within a row would overflow.

    The kernels compute the offset of every row of their inputs (of every dimension but the last) in
    int64, so any size and any row strides are exact, and the offsets within a row, the last
    dimension's index times its stride, in int32: exact while ``(size - 1) * stride`` stays below 2**31,
    as it does in a contiguous tensor whose rows are shorter. A view can exceed it, such as a (B, D, N)
    tensor transposed to (B, N, D) with N * D >= 2**31; only such a view is copied. (The pooler numbers
    patches and slots in int32 too, which bounds N and 2 * L below 2**31, far past any real item.)
    """
    span = (tensor.shape[-1] - 1) * tensor.stride(-1)
    return tensor if span < 2**31 else tensor.contiguous()


def gather_launch_config(hidden: int, interpreted: bool) -> tuple[int, int, int]:
    """(BLOCK_ROWS, BLOCK_D, num_warps) for the kernels that gather rows into a (B, N, D) output.

    They are bound by that write: 128-column tiles keep the stores wide and leave enough programs to
    fill the chip at real sizes (80,640 x 1152 gives 22,680). The interpreter pays per program, so it
    gets the largest tiles instead.
    """
    if interpreted:
        return 64, triton.next_power_of_2(hidden), 1
    return 32, min(128, triton.next_power_of_2(hidden)), 4


# Where a tile is offered: tensor-core families (every device of one, named or not), or an architecture
# prefix for a generation within a family whose builds differ from the family's others.
# wgmma and tcgen05 take operand A from registers: there a big tile's fp32 pixel prologue fits in them, where
# mma.sync's own operand registers make it spill.
ASYNC_MMA = (WGMMA, TCGEN05)
SYNC_MMA = (MMA_SYNC, MFMA, WMMA)  # the others: mma.sync, and AMD's MFMA and WMMA


def configs(names: tuple[str, str, str], tiles) -> list[tuple[triton.Config, int, tuple[str, ...] | None]]:
    """(triton.Config, shared memory, where) from (block, block, block, num_warps, num_stages, KiB, where)
    rows, blocks named by ``names``. KiB: the most shared memory (LDS) the tile takes on any architecture;
    where: the families and architecture prefixes it is offered on, None for every family
    (bench/tools/build_matrix.py checks that each offered tile builds, fits and does not spill there)."""
    return [
        (triton.Config(dict(zip(names, blocks)), num_warps=w, num_stages=s), kib * 1024, where)
        for *blocks, w, s, kib, where in tiles
    ]


def offered(limits: DeviceLimits | None, dtype: torch.dtype, shared: int, where: tuple[str, ...] | None) -> bool:
    """Whether a tile needing ``shared`` bytes, offered ``where``, runs ``dtype`` on a device with ``limits``:
    every tile for None (no limits to read); none on a device whose dots do not take ``dtype`` or that lies
    outside every family, whose builds no one has checked (``fused_vision._dispatch.untiled``)."""
    if limits is None:
        return True
    if not limits.multiplies(dtype) or shared > limits.shared_memory:
        return False
    return where is None or limits.family in where or limits.arch.startswith(tuple(where))


def autotune_per_dtype(kernel, *, key: list[str], dtype_of: str, half: list, fp32: list):
    """``kernel`` autotuned over the candidates of one operand's dtype: ``half`` for bf16 and fp16,
    ``fp32`` for float32, whose ieee dots need smaller tiles to stay spill-free; on each device only
    those it has the shared memory, the tensor-core family and the dtype for (``configs``' rows).

    Returns the autotuner, tuning each key once (``TunedOnce``), and ``gpu_configs(dtype, limits=None)``, the
    candidates it offers for a dtype on a device with those limits (every one for ``None``).
    """

    def gpu_configs(dtype: torch.dtype, limits: DeviceLimits | None = None) -> list[triton.Config]:
        tiles = fp32 if dtype == torch.float32 else half
        return [config for config, shared, where in tiles if offered(limits, dtype, shared, where)]

    def candidates(configs, named_args, **kwargs):
        operand = named_args[dtype_of]
        return gpu_configs(operand.dtype, _device.device_limits(operand.device))

    every = [config for config, _, _ in half + fp32]
    tuned = triton.autotune(configs=every, key=key, prune_configs_by={"early_config_prune": candidates})(kernel)
    return TunedOnce(tuned), gpu_configs


class TunedOnce:
    """``autotuner``'s launches, each key tuned once under a lock, then launched with its best config
    without the autotuner: Triton's keeps a call's arguments on itself while it prunes and times, so two
    first calls at once (or a launch during another key's tuning) would prune against the other's None."""

    def __init__(self, autotuner):
        self.autotuner = autotuner
        self._best: dict[tuple, triton.Config] = {}
        self._tuning = threading.Lock()

    def key(self, args: tuple, kwargs: dict) -> tuple:
        """The autotuner's own cache key: its key arguments' values, then every tensor argument's dtype."""
        named = {**dict(zip(self.autotuner.arg_names, args)), **kwargs}
        named = {name: value for name, value in named.items() if name in self.autotuner.arg_names}
        values = [named[name] for name in self.autotuner.keys if name in named]
        return tuple(values + [str(value.dtype) for value in named.values() if hasattr(value, "dtype")])

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            key = self.key(args, kwargs)
            config = self._best.get(key)
            if config is None:
                with self._tuning:
                    config = self._best.get(key)
                    if config is None:  # the first call of this key: tune it, and launch as the tuner does
                        result = self.autotuner[grid](*args, **kwargs)
                        self._best[key] = self.autotuner.best_config
                        return result
            return self.autotuner.fn[grid](*args, **kwargs, **config.all_kwargs())

        return launch


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """Round ``x`` to DTYPE to nearest even, as a PyTorch cast: the hardware's cvt.rn, one instruction per
    two values."""
    return x.to(DTYPE, fp_downcast_rounding="rtne")


@triton.jit
def clamp(x, low, high):
    """torch.clamp(x, low, high) in fp32: max then min, NaN in x or a bound propagating as in PyTorch."""
    x = tl.maximum(x, low, propagate_nan=tl.PropagateNan.ALL)
    return tl.minimum(x, high, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def clamp_bounds(clamps_ptr, row, DTYPE: tl.constexpr):
    """Row ``row`` of a (rows, 2) fp32 (min, max) table, rounded to DTYPE as torch.clamp casts its bounds."""
    low = round_to(tl.load(clamps_ptr + 2 * row), DTYPE).to(tl.float32)
    high = round_to(tl.load(clamps_ptr + 2 * row + 1), DTYPE).to(tl.float32)
    return low, high


@triton.jit
def rms_inverse(sum_squares, SIZE: tl.constexpr, eps):
    """Gemma4RMSNorm's pow(mean(x²) + eps, -0.5) from an fp32 sum of squares over SIZE values, as torch's
    CUDA pow(-0.5): the hardware's reciprocal square root (within 2 ulp of fp32) of the sum times 1 / size
    (within 1 ulp of the quotient), a few instructions a row where the correctly rounded pair costs dozens."""
    return tl.rsqrt(sum_squares * (1.0 / SIZE) + eps)


@triton.jit
def block_mask(row_mask, cols, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    """``row_mask`` over a block of columns; the column test only where the blocks do not divide WIDTH."""
    if WIDTH % BLOCK == 0:
        return row_mask[:, None]
    else:
        return row_mask[:, None] & (cols < WIDTH)[None, :]


@triton.jit
def load_part(ptrs, cols, WIDTH: tl.constexpr, MASKED: tl.constexpr):
    """A row part's values at ``cols``; zeros past WIDTH, masked only where the part passes it (``row_parts``)."""
    if MASKED:
        return tl.load(ptrs, mask=cols < WIDTH, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def store_part(ptrs, value, cols, WIDTH: tl.constexpr, MASKED: tl.constexpr):
    """``value`` at a row part's ``cols``, masked only where the part passes WIDTH."""
    if MASKED:
        tl.store(ptrs, value, mask=cols < WIDTH)
    else:
        tl.store(ptrs, value)


def row_parts(width: int) -> tuple[int, int]:
    """A row of ``width`` columns as a power-of-two main part and a tail (0 for a power of two), the tail
    rounded up to a power of two: 1152 = 1024 + 128 and 768 = 512 + 256 leave no lane past the row."""
    main = 1 << (width.bit_length() - 1)
    return main, 0 if main == width else triton.next_power_of_2(width - main)


def unit_inner_stride(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or a contiguous copy where its last dimension is strided: the kernels read rows as
    contiguous vectors."""
    return tensor if tensor.stride(-1) == 1 or tensor.shape[-1] <= 1 else tensor.contiguous()


def as_rows(tensor: torch.Tensor) -> torch.Tensor:
    """A (..., D) tensor as (rows, D) with unit column stride, for the row kernels: a view where the
    strides allow one, a copy otherwise."""
    return unit_inner_stride(tensor.reshape(-1, tensor.shape[-1]))


def offset_dtype(*tensors: torch.Tensor) -> tl.dtype:
    """tl.int32 for the kernels' element offsets where every operand's farthest element lies below 2**31
    (so index math costs one 32-bit op), else tl.int64: chosen per launch on the host."""
    span = max(sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride())) for t in tensors)
    return tl.int32 if span < 2**31 else tl.int64
