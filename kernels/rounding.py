"""Rounding fp32 values to the storage dtype, identically on GPUs and under TRITON_INTERPRET=1."""

import triton
import triton.language as tl


@triton.jit
def round_to_bf16(x):
    """fp32 -> bf16 with round-to-nearest-even.

    Done with integer ops because the interpreter's cast truncates; the same code compiles to a
    handful of integer instructions on a GPU, where it matches the hardware cast bit for bit.
    NaN stays NaN (its quiet bit is in the high half) and overflow rounds to +-inf, as the cast does.
    """
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """Round an fp32 tensor to DTYPE (bf16, fp16 or fp32) exactly as a PyTorch cast would."""
    if DTYPE == tl.bfloat16:
        return round_to_bf16(x)
    else:
        return x.to(DTYPE)
