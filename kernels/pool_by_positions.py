"""Gemma 4's pooler as a deterministic segmented sum: no (B, N, L) one-hot, no fp32 copy of the hidden states.

pooled[b, s] = round_hidden(sum_{n: slot(b, n) == s} hidden[b, n] / k^2) * sqrt(D)    (fp32 result;
               without round_hidden where ``round_average`` is False)
slot(b, n)   = x // k + ((max_x(b) + 1) // k) * (y // k),   with (x, y) = clamp(position_ids[b, n], 0, N / k)

Two launches:
1. ``_patch_slots_kernel``, one program per item, writes each patch's slot as int32 (-1 for padding, whose
   hidden state stock zeroes), the first and last patch of every slot, the mask of filled slots (padding
   counts, as in stock's one-hot) and the item's count of patches beyond the L slots: 4 bytes per patch
   and 8 per slot of scratch.
2. ``_pool_by_positions_kernel``: a program owns BLOCK_S slots x BLOCK_D columns of one item and walks
   only the patches between its slots' first and last, building the BLOCK_S x BLOCK_N slot-match matrix
   in registers and multiplying it into the hidden tile with a tensor-core dot. In the processors' row-major
   patch order that span is about BLOCK_S * k * k patches, so each hidden row is read about once and no
   program scans the whole item; any other order is still exact, just slower.
The sum order is fixed by the loop, so results are bit-identical across runs; the atomics of launch 1 only
take minima and maxima of integers, which no order changes.

The backward reruns launch 1 for the slots and gathers each patch's row of the pooled gradient
(``_pool_by_positions_backward_kernel``): one (B, N, D) write in the hidden dtype, where stock autograd first
writes an fp32 (B, N, D) matmul output.
"""

import math

import torch
import triton
import triton.language as tl

from .common import (
    TORCH_TO_TL,
    autotune_per_dtype,
    configs,
    gather_launch_config,
    int32_inner_offsets,
    interpreting,
    launcher,
    round_to,
)


@triton.jit
def _patch_slots_kernel(
    ids_ptr,
    padding_ptr,
    codes_ptr,
    bounds_ptr,
    mask_ptr,
    overflow_ptr,
    seq_len,
    output_length,
    k,
    stride_ids_b,
    stride_ids_n,
    stride_ids_axis,
    stride_padding_b,
    stride_padding_n,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    item = tl.program_id(0).to(tl.int64)
    ids_item = ids_ptr + item * stride_ids_b
    bounds_item = bounds_ptr + item * output_length * 2
    mask_item = mask_ptr + item * output_length

    # Ids clamped to k * L = N / k, as in the reference's pooling_slots: no verdict changes, no int64 wraps.
    id_limit = seq_len // k
    # The item's width in positions, then an empty span and mask for each of its slots.
    max_x = tl.zeros((BLOCK_N,), dtype=tl.int64)
    for n0 in range(0, seq_len, BLOCK_N):
        patches = n0 + tl.arange(0, BLOCK_N)
        x = tl.load(ids_item + patches.to(tl.int64) * stride_ids_n, mask=patches < seq_len, other=0).to(tl.int64)
        max_x = tl.maximum(max_x, tl.minimum(x, id_limit))
    slots_per_row = (tl.max(max_x, axis=0) + 1) // k
    for s0 in range(0, output_length, BLOCK_S):
        slots = s0 + tl.arange(0, BLOCK_S)
        slot_in = slots < output_length
        tl.store(bounds_item + slots * 2, tl.full((BLOCK_S,), seq_len, tl.int32), mask=slot_in)
        tl.store(bounds_item + slots * 2 + 1, tl.full((BLOCK_S,), -1, tl.int32), mask=slot_in)
        tl.store(mask_item + slots, tl.zeros((BLOCK_S,), tl.uint8), mask=slot_in)
    tl.debug_barrier()  # the atomics and mask stores below may hit entries other threads initialised

    overflow = tl.zeros((BLOCK_N,), dtype=tl.int32)
    for n0 in range(0, seq_len, BLOCK_N):
        patches = n0 + tl.arange(0, BLOCK_N)
        patch_in = patches < seq_len
        ids_row = ids_item + patches.to(tl.int64) * stride_ids_n
        x = tl.minimum(tl.maximum(tl.load(ids_row, mask=patch_in, other=0).to(tl.int64), 0), id_limit)
        y = tl.minimum(tl.maximum(tl.load(ids_row + stride_ids_axis, mask=patch_in, other=0).to(tl.int64), 0), id_limit)
        slot = x // k + slots_per_row * (y // k)
        in_slots = patch_in & (slot < output_length)
        overflow += (patch_in & ~in_slots).to(tl.int32)
        padding_row = padding_ptr + item * stride_padding_b + patches.to(tl.int64) * stride_padding_n
        padding = tl.load(padding_row, mask=patch_in, other=1) != 0
        summed = in_slots & ~padding
        slot = tl.where(in_slots, slot, 0).to(tl.int32)  # a safe address where the masks are off
        tl.store(codes_ptr + item * seq_len + patches, tl.where(summed, slot, -1), mask=patch_in)
        tl.atomic_min(bounds_item + slot * 2, patches, mask=summed, sem="relaxed")
        tl.atomic_max(bounds_item + slot * 2 + 1, patches, mask=summed, sem="relaxed")
        tl.store(mask_item + slot, tl.full((BLOCK_N,), 1, tl.uint8), mask=in_slots)
    tl.store(overflow_ptr + item, tl.sum(overflow, axis=0))


@triton.jit
def _pool_by_positions_kernel(
    hidden_ptr,
    codes_ptr,
    bounds_ptr,
    overflow_ptr,
    pooled_ptr,
    seq_len,
    hidden,
    output_length,
    inv_k_squared,
    scale,
    stride_hidden_b,
    stride_hidden_n,
    stride_hidden_d,
    DTYPE: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    ROUND_AVERAGE: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One grid axis, item-major so that an item's programs run together: CUDA caps the other axes at
    # 65,535, fewer programs than a batch of video frames can need.
    num_slot_blocks = tl.cdiv(output_length, BLOCK_S)
    programs_per_item = num_slot_blocks * tl.cdiv(hidden, BLOCK_D)
    pid = tl.program_id(0)
    item = (pid // programs_per_item).to(tl.int64)
    slots = (pid % num_slot_blocks) * BLOCK_S + tl.arange(0, BLOCK_S)
    cols = (pid % programs_per_item // num_slot_blocks) * BLOCK_D + tl.arange(0, BLOCK_D)
    slot_in = slots < output_length
    col_in = cols < hidden
    codes_item = codes_ptr + item * seq_len
    hidden_item = hidden_ptr + item * stride_hidden_b

    bounds = bounds_ptr + item * output_length * 2 + slots * 2
    start = tl.min(tl.load(bounds, mask=slot_in, other=seq_len), axis=0)
    stop = tl.max(tl.load(bounds + 1, mask=slot_in, other=-1), axis=0) + 1

    acc = tl.zeros((BLOCK_S, BLOCK_D), dtype=tl.float32)
    for n0 in range(start, stop, BLOCK_N):
        patches = n0 + tl.arange(0, BLOCK_N)
        codes = tl.load(codes_item + patches, mask=patches < stop, other=-1)
        match = codes[None, :] == slots[:, None]
        # Rows no slot of this program takes (padding among them) are not read: their zeros add nothing.
        hit = tl.max(match.to(tl.int32), axis=0) != 0
        rows = tl.load(
            hidden_item + patches[:, None].to(tl.int64) * stride_hidden_n + cols[None, :] * stride_hidden_d,
            mask=hit[:, None] & col_in[None, :],
            other=0.0,
        )
        if DOT_IN_FP32:  # fp32 hidden states, or the interpreter, which has no bf16 dot
            acc = tl.dot(match.to(tl.float32), rows.to(tl.float32), acc, input_precision="ieee")
        else:  # a 0/1 matrix and bf16/fp16 rows are exact operands; the sum is fp32
            acc = tl.dot(match.to(DTYPE), rows, acc)

    # Stock averages in fp32, rounds to the hidden dtype (transformers; not SGLang's EmbeddingGemma2), then
    # scales by sqrt(D) in fp32.
    average = acc * inv_k_squared
    if ROUND_AVERAGE:
        average = round_to(average, DTYPE).to(tl.float32)
    pooled = average * scale
    # If any patch fell outside the L slots (which the host raises on unless its checks are off), the
    # item's pooled values are NaN rather than short a patch.
    pooled = tl.where(tl.load(overflow_ptr + item) > 0, float("nan"), pooled)
    out_offsets = item * output_length * hidden + slots[:, None].to(tl.int64) * hidden + cols[None, :]
    tl.store(pooled_ptr + out_offsets, pooled, mask=slot_in[:, None] & col_in[None, :])


@triton.jit
def _pool_by_positions_backward_kernel(
    grad_pooled_ptr,
    codes_ptr,
    grad_hidden_ptr,
    num_rows,
    seq_len,
    hidden,
    inv_k_squared,
    scale,
    stride_grad_b,
    stride_grad_s,
    stride_grad_d,
    DTYPE: tl.constexpr,
    ROUND_AVERAGE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """grad_hidden[b, n] = round(round(grad_pooled[b, slot(b, n)] * sqrt(D)) * (1 / k^2)) for summed patches,
    0 for padding: stock autograd's roundings, whose one-hot matmul has one nonzero term per patch (the
    inner round only where the forward rounds the average, ``ROUND_AVERAGE``)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    row_in = rows < num_rows
    col_in = cols < hidden
    slot = tl.load(codes_ptr + rows, mask=row_in, other=-1)
    taken = row_in & (slot >= 0)
    batch = rows // seq_len
    grad = tl.load(
        grad_pooled_ptr
        + batch[:, None] * stride_grad_b
        + slot[:, None].to(tl.int64) * stride_grad_s
        + cols[None, :] * stride_grad_d,
        mask=taken[:, None] & col_in[None, :],
        other=0.0,
    ).to(tl.float32)
    grad = grad * scale
    if ROUND_AVERAGE:
        grad = round_to(grad, DTYPE).to(tl.float32)
    # A zero comes out +0.0, as from stock's one-hot matmul, whose sum adds +0.0 terms to it: a select, as
    # "+ 0.0" would fuse into an FMA that keeps the sign of a product underflowing to zero.
    grad = grad * inv_k_squared
    grad = round_to(tl.where(grad == 0.0, 0.0, grad), DTYPE)
    tl.store(grad_hidden_ptr + rows[:, None] * hidden + cols[None, :], grad, mask=row_in[:, None] & col_in[None, :])


# Each fits sm_90 without register spills (bench/tools/build_matrix.py checks); fp32 hidden states take
# ieee dots on the FMA units, whose operands need smaller tiles. Tuned per (D, L, dtype): the slots per
# item set how many programs share an item, and the best tile follows.
_TILE = ("BLOCK_S", "BLOCK_N", "BLOCK_D")
_NOT_SM80 = ("sm_86", "sm_89", "sm_90", "sm_100", "sm_120", "gfx")
_pool_by_positions_tuned, gpu_configs = autotune_per_dtype(
    _pool_by_positions_kernel,
    key=["hidden", "output_length"],
    dtype_of="hidden_ptr",
    half=configs(
        _TILE,
        [
            (64, 64, 128, 4, 3, 56, None),
            (64, 64, 256, 8, 3, 104, None),
            (64, 128, 128, 8, 3, 113, None),
            (128, 64, 128, 8, 3, 64, None),
        ],
    ),
    # fp32 (ieee dots): the first three spill on sm_80 from Triton 3.8 on (384 to 564 bytes); the last two
    # build clean on every target.
    fp32=configs(
        _TILE,
        [
            (64, 64, 64, 4, 2, 33, _NOT_SM80),
            (64, 64, 128, 8, 2, 49, _NOT_SM80),
            (32, 64, 128, 4, 2, 41, _NOT_SM80),
            (32, 32, 128, 4, 2, 21, None),
            (32, 64, 64, 8, 2, 25, None),
        ],
    ),
)


@launcher
def patch_slots(
    position_ids: torch.Tensor, padding_positions: torch.Tensor, output_length: int, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the slot pass on validated inputs with N = k * k * L.

    Returns (codes (B, N) int32: each patch's slot, -1 for padding and overflow; bounds (B, L, 2) int32:
    each slot's first and last summed patch, (N, -1) when it has none; mask (B, L) bool: the slots any
    patch falls in; overflow (B,) int32: patches whose slot is >= L).
    """
    batch, seq_len, _ = position_ids.shape
    device = position_ids.device
    codes = torch.empty((batch, seq_len), dtype=torch.int32, device=device)
    bounds = torch.empty((batch, output_length, 2), dtype=torch.int32, device=device)
    mask = torch.empty((batch, output_length), dtype=torch.bool, device=device)
    overflow = torch.empty((batch,), dtype=torch.int32, device=device)
    if batch == 0:
        return codes, bounds, mask, overflow
    # One program per item: wide blocks keep its three passes short; 8 warps, since at 4 a 1024-wide block
    # spills on sm_80 to sm_89 (bench/tools/build_matrix.py).
    _patch_slots_kernel[(batch,)](
        position_ids,
        padding_positions.view(torch.uint8),
        codes,
        bounds,
        mask.view(torch.uint8),
        overflow,
        seq_len,
        output_length,
        k,
        *position_ids.stride(),
        *padding_positions.stride(),
        BLOCK_N=min(512, triton.next_power_of_2(seq_len)),
        BLOCK_S=min(1024, triton.next_power_of_2(output_length)),
        num_warps=4,
    )
    return codes, bounds, mask, overflow


@launcher
def pool_by_positions(
    hidden_states: torch.Tensor,
    position_ids: torch.Tensor,
    padding_positions: torch.Tensor,
    output_length: int,
    k: int,
    *,
    round_average: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the pooler on validated inputs with N = k * k * L, k > 1; ``round_average``: round each
    average to the hidden dtype before the sqrt(D) scale.

    Returns (pooled fp32 (B, L, D), mask (B, L) bool, overflow (B,) int32: patches whose slot is >= L).
    Items with overflowing patches come out NaN.
    """
    hidden_states = int32_inner_offsets(hidden_states)
    batch, seq_len, hidden = hidden_states.shape
    pooled = torch.empty((batch, output_length, hidden), dtype=torch.float32, device=hidden_states.device)
    codes, bounds, mask, overflow = patch_slots(position_ids, padding_positions, output_length, k)
    if pooled.numel() == 0:
        return pooled, mask, overflow
    args = (
        hidden_states,
        codes,
        bounds,
        overflow,
        pooled,
        seq_len,
        hidden,
        output_length,
        1.0 / (k * k),
        math.sqrt(hidden),
        *hidden_states.stride(),
    )
    dtype = TORCH_TO_TL[hidden_states.dtype]

    def grid(meta):
        return (triton.cdiv(output_length, meta["BLOCK_S"]) * triton.cdiv(hidden, meta["BLOCK_D"]) * batch,)

    if interpreting():
        # Fixed large tiles: the interpreter pays per program, and autotuning needs a GPU.
        block_d = triton.next_power_of_2(hidden)
        _pool_by_positions_kernel[grid](
            *args, DTYPE=dtype, DOT_IN_FP32=True, ROUND_AVERAGE=round_average, BLOCK_S=32, BLOCK_N=64, BLOCK_D=block_d
        )
    else:
        dot_in_fp32 = hidden_states.dtype == torch.float32
        _pool_by_positions_tuned[grid](*args, DTYPE=dtype, DOT_IN_FP32=dot_in_fp32, ROUND_AVERAGE=round_average)
    return pooled, mask, overflow


@launcher
def pool_by_positions_backward(
    grad_pooled: torch.Tensor,
    position_ids: torch.Tensor,
    padding_positions: torch.Tensor,
    k: int,
    hidden_dtype: torch.dtype,
    *,
    round_average: bool = True,
) -> torch.Tensor:
    """Launch the pooler's backward on validated inputs with N = k * k * L, k > 1: a new (B, N, D)
    tensor in ``hidden_dtype``, bit-identical to stock autograd's gradient (through a forward that
    rounds its averages where ``round_average``)."""
    grad_pooled = int32_inner_offsets(grad_pooled)
    batch, output_length, hidden = grad_pooled.shape
    seq_len = position_ids.shape[1]
    grad_hidden = torch.empty((batch, seq_len, hidden), dtype=hidden_dtype, device=grad_pooled.device)
    if grad_hidden.numel() == 0:
        return grad_hidden
    codes, *_ = patch_slots(position_ids, padding_positions, output_length, k)
    num_rows = batch * seq_len
    block_rows, block_d, num_warps = gather_launch_config(hidden, interpreting())
    grid = (triton.cdiv(num_rows, block_rows), triton.cdiv(hidden, block_d))
    _pool_by_positions_backward_kernel[grid](
        grad_pooled,
        codes,
        grad_hidden,
        num_rows,
        seq_len,
        hidden,
        1.0 / (k * k),
        math.sqrt(hidden),
        *grad_pooled.stride(),
        DTYPE=TORCH_TO_TL[hidden_dtype],
        ROUND_AVERAGE=round_average,
        BLOCK_ROWS=block_rows,
        BLOCK_D=block_d,
        num_warps=num_warps,
    )
    return grad_hidden
