"""Triton's CPU interpreter made to compute what a GPU computes, for fused_vision's own launches.

The interpreter (TRITON_INTERPRET=1) stores bf16 as its uint16 bits and runs numpy on them, so the code a GPU
compiles gives other answers there: fp32 -> bf16 casts truncate, bf16 -> fp32 casts of subnormals are wrong,
bf16 arithmetic and dots compute on the integers, and libdevice has no implementation at all. While a launch
runs, ``hardware_arithmetic`` replaces those few builder methods and libdevice functions with the GPU's
semantics (docs/semantics.md lists each and the behaviour it corrects); after it, Triton is as it ships.
It knows the interpreters of Triton 3.6 to 3.9 and refuses any other.
"""

import contextlib
import functools

import numpy as np
import triton
import triton.language as tl
from triton.language.extra import libdevice

SUPPORTED_TRITONS = ((3, 6), (3, 7), (3, 8), (3, 9))
_BF16_NAN = np.uint16(0x7FFF)  # the GPU's cvt.rn.bf16.f32 of any NaN
_SMALLEST_NORMAL = np.float32(2.0**-126)


def _fp32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """fp32 values as bf16 bits, rounded to nearest even: ties, carries into the exponent, overflow to inf."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    return np.where((bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000), _BF16_NAN, rounded)


def _fp64_to_fp32_odd(x: np.ndarray) -> np.ndarray:
    """fp64 values rounded to fp32 toward zero with the last bit set where inexact ("round to odd"): rounding
    that to any format of at most 22 significant bits is the correct rounding of the fp64 value."""
    rounded = x.astype(np.float32)
    widened = rounded.astype(np.float64)
    bits = rounded.view(np.uint32).copy()
    inexact = (widened != x) & ~np.isnan(x)
    bits[inexact & (np.abs(widened) > np.abs(x))] -= np.uint32(1)  # one step toward zero, inf to the largest
    bits[inexact] |= np.uint32(1)
    return bits.view(np.float32)


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Values of any float (or integer) dtype as bf16 bits, correctly rounded to nearest even."""
    if x.dtype == np.float64:
        x = _fp64_to_fp32_odd(x)
    return _fp32_to_bf16_bits(x)


def from_bf16_bits(bits: np.ndarray) -> np.ndarray:
    """bf16 bits as the fp32 values they hold: exact, subnormals and NaN included."""
    return (np.asarray(bits).astype(np.uint32) << np.uint32(16)).view(np.float32)


def _handle(data, dtype):
    from triton.runtime.interpreter import TensorHandle

    return TensorHandle(data, dtype)


def _values(handle) -> np.ndarray:
    """A handle's values in a numpy float dtype: bf16 widened to fp32, others as stored."""
    return from_bf16_bits(handle.data) if handle.dtype.scalar == tl.bfloat16 else handle.data


def _narrowed(values: np.ndarray, dtype: tl.dtype) -> np.ndarray:
    """fp32 or fp64 ``values`` rounded to ``dtype``'s storage (bf16 to its bits)."""
    if dtype == tl.bfloat16:
        return to_bf16_bits(values)
    from triton.runtime.interpreter import _get_np_dtype

    return values.astype(_get_np_dtype(dtype))


def _cast(original, src, dst_type):
    """Any cast from or to bf16 through exact fp32 values; the others as Triton's."""
    src_type, dst = src.dtype.scalar, dst_type.scalar
    if tl.bfloat16 not in (src_type, dst):
        return original(src, dst_type)
    values = _values(src)
    if dst == tl.bfloat16 and values.dtype not in (np.float32, np.float64):
        values = values.astype(np.float64)  # integers and fp16: exact in fp64
    return _handle(_narrowed(values, dst), dst)


def _fp_to_fp(original, src, dst_type, rounding_mode):
    """A float cast with an explicit rounding: to nearest even as ``_cast``, toward zero by truncating bits."""
    from triton._C.libtriton import ir

    if tl.bfloat16 not in (src.dtype.scalar, dst_type.scalar):
        return original(src, dst_type, rounding_mode)
    if rounding_mode == ir.ROUNDING_MODE.RTZ and dst_type.scalar == tl.bfloat16:
        values = _values(src).astype(np.float32)
        bits = (values.view(np.uint32) >> np.uint32(16)).astype(np.uint16)
        return _handle(np.where(np.isnan(values), _BF16_NAN, bits), tl.bfloat16)
    return _cast(None, src, dst_type)


def _binary_op(original, lhs, rhs, op):
    """bf16 operands as fp32 values, the result rounded once to bf16: the GPU's bf16 add, sub, mul, min, max
    (exact in fp32 for two bf16 operands, so one rounding is the correctly rounded result); compares as fp32."""
    if lhs.dtype.scalar != tl.bfloat16:
        return original(lhs, rhs, op)
    output = op(_values(lhs), _values(rhs))
    return _handle(to_bf16_bits(output) if output.dtype == np.float32 else output, tl.bfloat16)


def _unary_op(original, arg, op):
    """bf16 through fp32, rounded once (negation, for one)."""
    if arg.dtype.scalar != tl.bfloat16:
        return original(arg, op)
    return _handle(to_bf16_bits(op(_values(arg))), tl.bfloat16)


def _round_to_odd_sum(product: np.ndarray, addend: np.ndarray) -> np.ndarray:
    """product + addend in fp64 rounded to odd (TwoSum's error decides): correct after one more rounding."""
    total = product + addend
    back = total - addend
    error = (product - back) + (addend - (total - back))
    bits = total.view(np.uint64).copy()
    adjust = np.isfinite(total) & (error != 0) & ((bits & np.uint64(1)) == 0)
    toward = np.nextafter(total, np.where(error > 0, np.inf, -np.inf))
    return np.where(adjust, toward, total)


def _fma(original, x, y, z):
    """x * y + z rounded once, as the GPU's fma: the product of two fp32 (or narrower) values is exact in fp64,
    the sum rounds to odd there, then to the dtype. (Triton 3.6 to 3.8 round the fp32 product first.)"""
    dtype = z.dtype.scalar
    if dtype not in (tl.float32, tl.float16, tl.bfloat16):
        return original(x, y, z)
    a, b, c = np.broadcast_arrays(*(_values(h).astype(np.float64) for h in (x, y, z)))
    total = _round_to_odd_sum(a * b, c)
    if dtype == tl.float32:
        return _handle(total.astype(np.float32), dtype)
    return _handle(_narrowed(total, dtype), dtype)


def _dot(original, a, b, d, input_precision, max_num_imprecise_acc):
    """A bf16 dot on the fp32 values, accumulated in fp32, as the tensor cores'."""
    if tl.bfloat16 not in (a.dtype.scalar, b.dtype.scalar):
        return original(a, b, d, input_precision, max_num_imprecise_acc)
    product = np.matmul(_values(a), _values(b), dtype=np.float32)
    return _handle(product + _values(d).astype(np.float32), d.dtype.scalar)


def _flushed(x: np.ndarray) -> np.ndarray:
    """fp32 subnormals flushed to zero of their sign: Triton builds libdevice with ftz on NVIDIA."""
    return np.where(np.abs(x) < _SMALLEST_NORMAL, np.copysign(np.float32(0), x), x).astype(np.float32)


def _fast_dividef(x, y):
    """div.approx.ftz.f32: x times the reciprocal of y, so 0 (NaN for x = inf) once |y| > 2**126, whose
    reciprocal is subnormal and flushed; within 2 ulp elsewhere (two roundings here)."""
    return _flushed(_flushed(x) * _flushed(np.float32(1) / _flushed(y)))


def _approximate(function):
    """sin.approx / cos.approx: the function of the flushed fp32 input, flushed (more accurate than the
    hardware's 2**-21.4 and 2**-21.2 absolute on [-pi, pi]; tests/kernels bound the hardware's)."""
    return lambda x: _flushed(function(_flushed(x).astype(np.float64)).astype(np.float32))


# libdevice functions the kernels call, on fp32 numpy arrays (the only dtype they are called with).
_LIBDEVICE = {
    "fast_dividef": _fast_dividef,
    "fast_sinf": _approximate(np.sin),
    "fast_cosf": _approximate(np.cos),
    "rint": np.rint,  # round half to even, as rintf
}


def _elementwise(name, function):
    """A libdevice function for the interpreter: tensors and Python numbers in, an fp32 tensor out."""

    def call(*args, **_):
        from triton.runtime.interpreter import interpreter_semantic

        tensors = [interpreter_semantic.to_tensor(arg) for arg in args]
        if any(t.dtype != tl.float32 for t in tensors):
            raise TypeError(f"libdevice.{name}: the interpreter implements fp32 only, got {[t.dtype for t in tensors]}")
        shapes = [tuple(t.type.shape) for t in tensors if t.type.is_block()]
        out_type = tl.block_type(tl.float32, list(np.broadcast_shapes(*shapes))) if shapes else tl.float32
        data = np.broadcast_arrays(*(t.handle.data for t in tensors))
        return tl.tensor(_handle(function(*data).astype(np.float32), tl.float32), out_type)

    return call


# The builder methods replaced: every supported interpreter routes its casts, arithmetic and dots through them.
_BUILDER = {
    "cast_impl": _cast,
    "create_fp_to_fp": _fp_to_fp,
    "binary_op": _binary_op,
    "unary_op": _unary_op,
    "create_fma": _fma,
    "create_dot": _dot,
}


# What the corrections use of the interpreter module besides its builder.
_INTERNALS = ("_patch_lang", "interpreter_semantic", "TensorHandle", "_get_np_dtype")


class _Patched:
    """A language patch already in place: nothing of its own to undo."""

    @staticmethod
    def restore():
        pass


def _patch_lang_once(patch_lang):
    """Triton's ``_patch_lang``, which its interpreter repeats on every call of a jit helper, walking the
    members of triton.language each time (most of an interpreted launch's time): done once per launch for
    the language modules it has patched. The launch's own patch, undone at its end, starts it afresh."""
    patched = set()

    def once(fn):
        langs = {id(value) for value in fn.__globals__.values() if value is tl or value is tl.core}
        if langs and langs <= patched:
            return _Patched
        scope = patch_lang(fn)
        patched.update(langs)
        restore = scope.restore

        def restore_and_forget():
            patched.clear()
            restore()

        scope.restore = restore_and_forget
        return scope

    return once


def _quiet(function):
    """``function`` without numpy's warnings on overflow and NaN: the GPU computes them silently."""

    @functools.wraps(function)
    def quiet(*args):
        with np.errstate(all="ignore"):
            return function(*args)

    return quiet


def _check_known(interpreter):
    """Raise unless ``interpreter`` is one of the Tritons whose internals this module replaces."""
    version = tuple(int(part) for part in triton.__version__.split(".")[:2])
    if version not in SUPPORTED_TRITONS:
        known = ", ".join(f"{major}.{minor}" for major, minor in SUPPORTED_TRITONS)
        raise RuntimeError(
            f"fused_vision corrects the arithmetic of the interpreters of Triton {known}; Triton "
            f"{triton.__version__}'s is unknown to it: run on a GPU, or interpret with one of those Tritons"
        )
    builder = interpreter.interpreter_builder
    missing = [name for name in _BUILDER if not hasattr(type(builder), name) or name in vars(builder)]
    missing += [name for name in _INTERNALS if not hasattr(interpreter, name)]
    missing += [name for name in _LIBDEVICE if not hasattr(libdevice, name)]
    if missing:
        raise RuntimeError(f"Triton {triton.__version__}'s interpreter lacks what fused_vision replaces: {missing}")


_depth = 0  # launches inside the launch lock: a launcher may call another


@contextlib.contextmanager
def hardware_arithmetic():
    """While in it, Triton's interpreter computes as the GPU does (see the module). Call it holding the
    interpreter's lock only: the interpreter and this state are global."""
    global _depth
    if _depth:
        _depth += 1
        try:
            yield
        finally:
            _depth -= 1
        return
    from triton.runtime import interpreter

    _check_known(interpreter)
    builder = interpreter.interpreter_builder
    stubs = {name: getattr(libdevice, name) for name in _LIBDEVICE}
    patch_lang = interpreter._patch_lang
    interpreter._patch_lang = _patch_lang_once(patch_lang)
    for name, replacement in _BUILDER.items():
        setattr(builder, name, _quiet(functools.partial(replacement, getattr(builder, name))))
    for name, function in _LIBDEVICE.items():
        setattr(libdevice, name, _elementwise(name, _quiet(function)))
    _depth = 1
    try:
        yield
    finally:
        _depth = 0
        interpreter._patch_lang = patch_lang
        for name in _BUILDER:
            delattr(builder, name)
        for name, stub in stubs.items():
            setattr(libdevice, name, stub)
