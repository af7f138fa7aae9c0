"""Gemma 4 vision attention's q/k/v epilogue in one pass over the fused QKV projection's output: per head,
the optional output clamps, q_norm / k_norm / v_norm (RMS over head_dim in fp32), then the axial 2-D RoPE on
q and k, with cos and sin computed from each token's (x, y) position and the tower's inverse frequencies.

A head of d = 4F channels is four quarters of F: RoPE rotates quarter 0 with quarter 1 by the x angle and
quarter 2 with quarter 3 by the y angle (stock's split into x and y halves, then ``rotate_half`` in each).
Each program owns BLOCK_T tokens of one head and loads each quarter once. Every value is rounded to the
hidden dtype where stock rounds it: the norm's output, cos and sin, each RoPE product and their sum.
"""

import torch
import triton
import triton.language as tl

from .common import TORCH_TO_TL, clamp, clamp_bounds, interpreting, launcher, rms_inverse, round_to


@triton.jit
def _rotate(a, b, cos, sin, DTYPE: tl.constexpr):
    """Stock's ``x * cos + rotate_half(x) * sin`` on the pair of quarters (a, b), in DTYPE arithmetic."""
    rotated_a = round_to(round_to(a * cos, DTYPE).to(tl.float32) + round_to(-b * sin, DTYPE).to(tl.float32), DTYPE)
    rotated_b = round_to(round_to(b * cos, DTYPE).to(tl.float32) + round_to(a * sin, DTYPE).to(tl.float32), DTYPE)
    return rotated_a, rotated_b


@triton.jit
def _cos_sin(position, inv_freq, DTYPE: tl.constexpr):
    """Stock's rotary cos and sin of ``position * inv_freq`` in fp32, rounded to DTYPE."""
    angle = position[:, None] * inv_freq[None, :]
    return round_to(tl.cos(angle), DTYPE).to(tl.float32), round_to(tl.sin(angle), DTYPE).to(tl.float32)


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
    num_q_heads,
    num_kv_heads,
    head_dim_f,
    eps,
    stride_qkv_t,
    stride_ids_t,
    stride_ids_axis,
    stride_q_weight,
    stride_k_weight,
    stride_inv_freq,
    QUARTER: tl.constexpr,
    HAS_CLAMPS: tl.constexpr,
    DTYPE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    # int64 tokens: T * H * d may exceed 2**31 elements.
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    head = tl.program_id(1)
    cols = tl.arange(0, BLOCK_F)
    token_in = tokens < num_tokens
    col_in = cols < QUARTER
    tile_in = token_in[:, None] & col_in[None, :]

    # The head's projection (0: q, 1: k, 2: v), its index there, its head count, weight and output.
    is_q = head < num_q_heads
    is_v = head >= num_q_heads + num_kv_heads
    kind = tl.where(is_q, 0, tl.where(is_v, 2, 1))
    local = head - tl.where(is_q, 0, tl.where(is_v, num_q_heads + num_kv_heads, num_q_heads))
    heads = tl.where(is_q, num_q_heads, num_kv_heads)
    weight_ptr = tl.where(is_q, q_weight_ptr, k_weight_ptr)
    stride_weight = tl.where(is_q, stride_q_weight, stride_k_weight)
    out_ptr = tl.where(is_q, q_ptr, tl.where(is_v, v_ptr, k_ptr))

    source = qkv_ptr + tokens[:, None] * stride_qkv_t + head * (4 * QUARTER) + cols[None, :]
    x0 = tl.load(source, mask=tile_in, other=0.0).to(tl.float32)
    x1 = tl.load(source + QUARTER, mask=tile_in, other=0.0).to(tl.float32)
    x2 = tl.load(source + 2 * QUARTER, mask=tile_in, other=0.0).to(tl.float32)
    x3 = tl.load(source + 3 * QUARTER, mask=tile_in, other=0.0).to(tl.float32)
    if HAS_CLAMPS:
        # Gemma4ClippableLinear's output clamp, in the hidden dtype.
        low, high = clamp_bounds(clamps_ptr, kind, DTYPE)
        x0, x1 = clamp(x0, low, high), clamp(x1, low, high)
        x2, x3 = clamp(x2, low, high), clamp(x3, low, high)
    sum_squares = tl.sum(x0 * x0, axis=1) + tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1) + tl.sum(x3 * x3, axis=1)
    inverse = rms_inverse(sum_squares, head_dim_f, eps)[:, None]

    # v_norm has no scale: a weight of 1 multiplies exactly.
    weight = weight_ptr + cols * stride_weight
    w0 = tl.where(is_v, 1.0, tl.load(weight, mask=col_in, other=0.0).to(tl.float32))
    w1 = tl.where(is_v, 1.0, tl.load(weight + QUARTER * stride_weight, mask=col_in, other=0.0).to(tl.float32))
    w2 = tl.where(is_v, 1.0, tl.load(weight + 2 * QUARTER * stride_weight, mask=col_in, other=0.0).to(tl.float32))
    w3 = tl.where(is_v, 1.0, tl.load(weight + 3 * QUARTER * stride_weight, mask=col_in, other=0.0).to(tl.float32))
    # Stock's order: x * pow(...), then * weight, each in fp32; one rounding to the hidden dtype.
    n0 = round_to(x0 * inverse * w0[None, :], DTYPE).to(tl.float32)
    n1 = round_to(x1 * inverse * w1[None, :], DTYPE).to(tl.float32)
    n2 = round_to(x2 * inverse * w2[None, :], DTYPE).to(tl.float32)
    n3 = round_to(x3 * inverse * w3[None, :], DTYPE).to(tl.float32)

    if is_v:
        o0, o1, o2, o3 = round_to(n0, DTYPE), round_to(n1, DTYPE), round_to(n2, DTYPE), round_to(n3, DTYPE)
    else:
        ids = ids_ptr + tokens * stride_ids_t
        position_x = tl.load(ids, mask=token_in, other=0).to(tl.float32)
        position_y = tl.load(ids + stride_ids_axis, mask=token_in, other=0).to(tl.float32)
        inv_freq = tl.load(inv_freq_ptr + cols * stride_inv_freq, mask=col_in, other=0.0)
        cos_x, sin_x = _cos_sin(position_x, inv_freq, DTYPE)
        cos_y, sin_y = _cos_sin(position_y, inv_freq, DTYPE)
        o0, o1 = _rotate(n0, n1, cos_x, sin_x, DTYPE)
        o2, o3 = _rotate(n2, n3, cos_y, sin_y, DTYPE)

    out = out_ptr + (tokens[:, None] * heads + local) * (4 * QUARTER) + cols[None, :]
    tl.store(out, o0, mask=tile_in)
    tl.store(out + QUARTER, o1, mask=tile_in)
    tl.store(out + 2 * QUARTER, o2, mask=tile_in)
    tl.store(out + 3 * QUARTER, o3, mask=tile_in)


def launch_config(quarter: int, interpreted: bool) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_F, num_warps): 256-element quarter tiles on a GPU at 8 warps, one value per thread
    per quarter, the shape that spills on no target under Triton 3.6 to 3.9 (512 at 4 or 8 warps, and 1024,
    spill 8 to 12 bytes on some: bench/tools/build_matrix.py); the interpreter pays per program: more tokens."""
    block_f = triton.next_power_of_2(quarter)
    if interpreted:
        return 128, block_f, 1
    return max(1, 256 // block_f), block_f, 8


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
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    num_tokens, head_dim = qkv.shape[0], q_weight.shape[0]
    q = torch.empty((num_tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty((num_tokens, num_kv_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    v = torch.empty_like(k)
    if num_tokens == 0:
        return q, k, v
    block_t, block_f, num_warps = launch_config(head_dim // 4, interpreting())
    grid = (triton.cdiv(num_tokens, block_t), num_heads + 2 * num_kv_heads)
    _qkv_norm_rope_kernel[grid](
        qkv,
        position_ids,
        q_weight,
        k_weight,
        inv_freq,
        q if clamps is None else clamps.contiguous(),  # read as (3, 2) rows; HAS_CLAMPS=False: never read
        q,
        k,
        v,
        num_tokens,
        num_heads,
        num_kv_heads,
        float(head_dim),
        eps,
        qkv.stride(0),
        *position_ids.stride(),
        q_weight.stride(0),
        k_weight.stride(0),
        inv_freq.stride(0),
        QUARTER=head_dim // 4,
        HAS_CLAMPS=clamps is not None,
        DTYPE=TORCH_TO_TL[qkv.dtype],
        BLOCK_T=block_t,
        BLOCK_F=block_f,
        num_warps=num_warps,
        enable_fp_fusion=False,  # stock rounds each RoPE product before the sum: no fma
    )
    return q, k, v
