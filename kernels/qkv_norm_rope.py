"""Gemma 4 vision attention's q/k/v epilogue in one pass over the fused QKV projection's output: per head,
the optional output clamps, q_norm / k_norm / v_norm (RMS over head_dim in fp32), then the axial 2-D RoPE on
q and k, with cos and sin computed from each token's (x, y) position and the tower's inverse frequencies.

A head of d = 4F channels is four quarters of F: RoPE rotates quarter 0 with quarter 1 by the x angle and
quarter 2 with quarter 3 by the y angle (stock's split into x and y halves, then ``rotate_half`` in each).
Each program owns BLOCK_T tokens and every head of them. It computes each token's cos and sin once, then
walks the heads in power-of-two groups (16, or 12 = 8 + 4), each quarter a (tokens, heads, F) block cut
into a power-of-two main part and a tail (18 = 16 + 2), so no lane holds a channel past the quarter. Every
value is rounded to the hidden dtype where stock rounds it: the norm's output, cos and sin, each RoPE
product and their sum, the products and the sum in the dtype's own arithmetic.
"""

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .common import (
    TORCH_TO_TL,
    as_rows,
    clamp,
    clamp_bounds,
    interpreting,
    launcher,
    load_part,
    offset_dtype,
    rms_inverse,
    round_to,
    row_parts,
    store_part,
    target_backend,
)

# 2 pi = TWO_PI_HIGH + TWO_PI_LOW, the first with 8 significant bits: n * TWO_PI_HIGH is exact in fp32.
TWO_PI_HIGH = tl.constexpr(6.28125)
TWO_PI_LOW = tl.constexpr(0.0019353071795864769)
INV_TWO_PI = tl.constexpr(0.15915494309189535)


@triton.jit
def fast_cos_sin(angle):
    """cos and sin of fp32 angles: reduced by 2 pi in two exact steps, then the hardware's approximate pair,
    within 2**-21.19 and 2**-21.41 of the reduced angle's (docs/semantics.md has the whole path's error)."""
    turns = libdevice.rint(angle * INV_TWO_PI)
    reduced = tl.fma(-turns, TWO_PI_LOW, tl.fma(-turns, TWO_PI_HIGH, angle))
    return libdevice.fast_cosf(reduced), libdevice.fast_sinf(reduced)


@triton.jit
def _cos_sin(position, inv_freq, FAST_TRIG: tl.constexpr, DTYPE: tl.constexpr):
    """Stock's rotary cos and sin of ``position * inv_freq`` in fp32, rounded to DTYPE: (tokens, 1, F) blocks.

    With FAST_TRIG (bf16 and fp16 on NVIDIA GPUs), ``fast_cos_sin``: far within one rounding of the dtype.
    Otherwise libm's, as fp32 needs (and AMD's libdevice has no approximate pair)."""
    angle = position[:, None] * inv_freq[None, :]
    if FAST_TRIG and DTYPE != tl.float32:
        cos, sin = fast_cos_sin(angle)
    else:
        cos, sin = tl.cos(angle), tl.sin(angle)
    return round_to(cos, DTYPE)[:, None, :], round_to(sin, DTYPE)[:, None, :]


@triton.jit
def _projected(ptrs, bounds, cols, F: tl.constexpr, MASKED: tl.constexpr):
    """fp32 values of a projection's part (``load_part``), with Gemma4ClippableLinear's output clamp: ``bounds``
    (low, high) in the hidden dtype, None without clamps."""
    x = load_part(ptrs, cols, F, MASKED).to(tl.float32)
    return x if bounds is None else clamp(x, bounds[0], bounds[1])


@triton.jit
def _normed(x, inverse, weights, cols, F: tl.constexpr, MASKED: tl.constexpr, DTYPE: tl.constexpr):
    """Stock's order: x * pow(...), then * weight (``weights`` None: v_norm has none), each in fp32; one rounding
    to DTYPE."""
    x = x * inverse
    if weights is not None:
        x = x * load_part(weights, cols, F, MASKED).to(tl.float32)
    return round_to(x, DTYPE)


@triton.jit
def _rotated(a, b, cos, sin):
    """Stock's ``x * cos + rotate_half(x) * sin`` on a pair of quarters (a, b) in the hidden dtype's own
    arithmetic: each product and the sum rounded."""
    return a * cos - b * sin, b * cos + a * sin


@triton.jit
def _part(source, target, weight, bounds, inverse, rotary, cols, F: tl.constexpr, MASKED: tl.constexpr):
    """One part (``cols``) of the heads' four quarters, given their inverse RMS: normalised in the output's dtype,
    rotated by ``rotary`` (cos x, sin x, cos y, sin y) and stored. ``weight`` and ``rotary`` None: v, which has
    neither."""
    normed = ()
    for quarter in tl.static_range(4):
        x = _projected(source + quarter * F + cols, bounds, cols, F, MASKED)
        weights = None if weight is None else weight + quarter * F + cols
        normed += (_normed(x, inverse, weights, cols, F, MASKED, target.dtype.element_ty),)
    if rotary is not None:
        cos_x, sin_x, cos_y, sin_y = rotary
        normed = _rotated(normed[0], normed[1], cos_x, sin_x) + _rotated(normed[2], normed[3], cos_y, sin_y)
    for quarter in tl.static_range(4):
        store_part(target + quarter * F + cols, normed[quarter], cols, F, MASKED)


@triton.jit
def _quarter_sum_squares(source, bounds, cols, F: tl.constexpr, MASKED: tl.constexpr):
    """Each head's sum of squares over one part of its four quarters: the loads the outputs' pass repeats,
    which the compiler then reads once."""
    squares = tl.zeros(source.shape, tl.float32)
    for quarter in tl.static_range(4):
        x = _projected(source + quarter * F + cols, bounds, cols, F, MASKED)
        squares = tl.fma(x, x, squares)  # one instruction: the kernel is built without fp fusion
    return tl.sum(squares, axis=2)


@triton.jit
def _row_sum_squares(source, bounds, D: tl.constexpr):
    """Each head's sum of squares over its row of D channels as one contiguous vector (a power-of-two main
    part and tail, as ``row_parts``: 72 = 64 + 8): aligned 16-byte loads in one layout where the quarters'
    offsets are not (36 bytes apart at d = 72), which would cost a layout change per quarter."""
    ROW_MAIN: tl.constexpr = 1 << (D.bit_length() - 1)
    ROW_TAIL: tl.constexpr = 0 if ROW_MAIN == D else 1 << (D - ROW_MAIN - 1).bit_length()
    channels = tl.arange(0, ROW_MAIN)[None, None, :]
    x = _projected(source + channels, bounds, channels, ROW_MAIN, False)
    sum_squares = tl.sum(x * x, axis=2)
    if ROW_TAIL > 0:
        channels = ROW_MAIN + tl.arange(0, ROW_TAIL)[None, None, :]
        x = _projected(source + channels, bounds, channels, D, ROW_MAIN + ROW_TAIL > D)
        sum_squares += tl.sum(x * x, axis=2)
    return sum_squares


@triton.jit
def _heads(source, target, weight, bounds, rotary, eps, F: tl.constexpr, MAIN: tl.constexpr, TAIL: tl.constexpr):
    """A group of heads of one projection: ``source`` and ``target`` the (tokens, heads, 1) starts of their rows
    in the projections and in the output, ``rotary`` the main part's and the tail's (``_part``). The inputs are
    read twice, for the sums and for the outputs: the second read hits L1, and no value waits in a register
    across the reduction."""
    main = tl.arange(0, MAIN)[None, None, :]
    tail = MAIN + tl.arange(0, max(TAIL, 1))[None, None, :]
    MASK_TAIL: tl.constexpr = MAIN + TAIL > F
    if (F * source.dtype.element_ty.primitive_bitwidth) % 128 == 0:  # every quarter starts on a 16-byte boundary
        sum_squares = _quarter_sum_squares(source + main * 0, bounds, main, F, False)
        if TAIL > 0:
            sum_squares += _quarter_sum_squares(source + tail * 0, bounds, tail, F, MASK_TAIL)
    else:
        sum_squares = _row_sum_squares(source, bounds, 4 * F)
    inverse = rms_inverse(sum_squares, 4 * F, eps)[:, :, None]
    _part(source, target, weight, bounds, inverse, rotary[0], main, F=F, MASKED=False)
    if TAIL > 0:
        _part(source, target, weight, bounds, inverse, rotary[1], tail, F=F, MASKED=MASK_TAIL)


@triton.jit
def _projection(
    source,
    target,
    weight,
    bounds,
    rotary,
    eps,
    HEADS: tl.constexpr,
    F: tl.constexpr,
    MAIN: tl.constexpr,
    TAIL: tl.constexpr,
):
    """All HEADS heads of one projection in power-of-two groups (its binary digits, largest first): ``source``
    and ``target`` the tokens' rows in the projections and in the output."""
    for bit in tl.static_range(7, -1, -1):
        if HEADS >> bit & 1:
            # The group's heads follow the larger groups': HEADS with this bit and those below it cleared.
            heads = ((HEADS >> (bit + 1) << (bit + 1)) + tl.arange(0, 1 << bit))[None, :, None] * (4 * F)
            group_source, group_target = source[:, None, None] + heads, target[:, None, None] + heads
            _heads(group_source, group_target, weight, bounds, rotary, eps, F=F, MAIN=MAIN, TAIL=TAIL)


@triton.jit
def _qkv_norm_rope_kernel(
    qkv_ptr,
    ids_ptr,
    q_weight_ptr,
    k_weight_ptr,
    inv_freq_ptr,
    clamps_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    num_tokens,
    eps,
    stride_qkv,
    stride_inv_freq,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    F: tl.constexpr,
    MAIN: tl.constexpr,
    TAIL: tl.constexpr,
    HAS_CLAMPS: tl.constexpr,
    DTYPE: tl.constexpr,
    FAST_TRIG: tl.constexpr,
    OFFSETS: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    # The last program's tokens past the end repeat the last token, rewriting it with the same values.
    tokens = tl.minimum(tl.program_id(0).to(OFFSETS) * BLOCK_T + tl.arange(0, BLOCK_T), num_tokens - 1)
    position_x = tl.load(ids_ptr + 2 * tokens).to(tl.float32)
    position_y = tl.load(ids_ptr + 2 * tokens + 1).to(tl.float32)
    # The main part's and the tail's (cos x, sin x, cos y, sin y), shared by every head of q and k.
    main = tl.arange(0, MAIN)
    inv_freq = tl.load(inv_freq_ptr + main * stride_inv_freq)
    rotary = (_cos_sin(position_x, inv_freq, FAST_TRIG, DTYPE) + _cos_sin(position_y, inv_freq, FAST_TRIG, DTYPE),)
    if TAIL > 0:
        tail = MAIN + tl.arange(0, TAIL)
        inv_freq = tl.load(inv_freq_ptr + tail * stride_inv_freq, mask=tail < F, other=0.0)
        rotary += (_cos_sin(position_x, inv_freq, FAST_TRIG, DTYPE) + _cos_sin(position_y, inv_freq, FAST_TRIG, DTYPE),)
    q_bounds, k_bounds, v_bounds = None, None, None
    if HAS_CLAMPS:
        q_bounds = clamp_bounds(clamps_ptr, 0, DTYPE)
        k_bounds = clamp_bounds(clamps_ptr, 1, DTYPE)
        v_bounds = clamp_bounds(clamps_ptr, 2, DTYPE)

    D: tl.constexpr = 4 * F
    source = qkv_ptr + tokens * stride_qkv
    q_rows = q_ptr + tokens * (HEADS * D)
    _projection(source, q_rows, q_weight_ptr, q_bounds, rotary, eps, HEADS=HEADS, F=F, MAIN=MAIN, TAIL=TAIL)
    source += HEADS * D
    k_rows = k_ptr + tokens * (KV_HEADS * D)
    _projection(source, k_rows, k_weight_ptr, k_bounds, rotary, eps, HEADS=KV_HEADS, F=F, MAIN=MAIN, TAIL=TAIL)
    source += KV_HEADS * D
    # v_norm has no scale and v no RoPE: no weight, nor cos and sin for either part.
    v_rows = v_ptr + tokens * (KV_HEADS * D)
    _projection(source, v_rows, None, v_bounds, (None, None), eps, HEADS=KV_HEADS, F=F, MAIN=MAIN, TAIL=TAIL)


# Meta-parameters that follow from the GPU's vendor ("cuda" or "hip"): the tools that build for another
# target apply them too.
BACKEND_CONSTANTS = {"FAST_TRIG": lambda backend: backend == "cuda"}


def launch_config(interpreted: bool, dtype: torch.dtype, quarter: int) -> tuple[int, int]:
    """(BLOCK_T, num_warps): 4 tokens a program on 2 warps, the fewest instructions per element on sm_90a
    (bench/tools/speed_of_light.py) of the configs that build spill-free on every target with Triton 3.6 to
    3.9 (bench/tools/build_matrix.py; 2 tokens on 2 warps spill on sm_100a and sm_120 at d = 64), 20,160
    programs at 80,640 tokens. fp32 heads of unaligned quarters (d = 72) hold their row and their quarters
    both: 4 warps, or they spill. The interpreter pays per program: 32 tokens."""
    if interpreted:
        return 32, 1
    unaligned = quarter * dtype.itemsize % 16 != 0
    return (2, 2) if dtype == torch.float32 and unaligned else (4, 2)


@launcher
def qkv_norm_rope(
    qkv: torch.Tensor,
    position_ids: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    inv_freq: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    eps: float,
    clamps: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch on already-validated inputs; returns new contiguous (T, H, d) q and (T, Hkv, d) k and v."""
    qkv = as_rows(qkv)
    q_weight, k_weight = q_weight.contiguous(), k_weight.contiguous()
    num_tokens, head_dim = qkv.shape[0], q_weight.shape[0]
    q = torch.empty((num_tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty((num_tokens, num_kv_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    v = torch.empty_like(k)
    if num_tokens == 0:
        return q, k, v
    quarter = head_dim // 4
    main, tail = row_parts(quarter)
    block_t, num_warps = launch_config(interpreting(), qkv.dtype, quarter)
    _qkv_norm_rope_kernel[(triton.cdiv(num_tokens, block_t),)](
        qkv,
        position_ids.contiguous(),
        q_weight,
        k_weight,
        inv_freq,
        q if clamps is None else clamps.contiguous(),  # read as (3, 2) rows; HAS_CLAMPS=False: never read
        q,
        k,
        v,
        num_tokens,
        eps,
        qkv.stride(0),
        inv_freq.stride(0),
        HEADS=num_heads,
        KV_HEADS=num_kv_heads,
        F=quarter,
        MAIN=main,
        TAIL=tail,
        HAS_CLAMPS=clamps is not None,
        DTYPE=TORCH_TO_TL[qkv.dtype],
        FAST_TRIG=BACKEND_CONSTANTS["FAST_TRIG"](target_backend(qkv.device)),
        OFFSETS=offset_dtype(qkv, q, k),
        BLOCK_T=block_t,
        num_warps=num_warps,
        enable_fp_fusion=False,  # stock rounds each product before the sum: no fma
    )
    return q, k, v
