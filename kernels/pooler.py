"""Gemma 4's pooler as a deterministic segmented sum: no (B, N, L) one-hot, no fp32 copy of the hidden states.

pooled[b, s] = round_hidden(sum_{n: slot(b, n) == s} hidden[b, n] / k^2) * sqrt(D)    (fp32 result)
slot(b, n)   = x // k + ((max_x(b) + 1) // k) * (y // k),   with (x, y) = clamp(position_ids[b, n], 0)

A program owns BLOCK_S slots x BLOCK_D columns of one item. It scans the item's ids (small, L2-resident),
builds the BLOCK_S x BLOCK_N slot-match matrix in registers and multiplies it into the hidden tile with
a tensor-core dot, skipping chunks with no patch in its slots, so each hidden row is read about once.
The sum order is fixed by the loop, so results are bit-identical across runs. Padding rows are loaded
as zero (stock's masked_fill) but still count for the mask, as stock's one-hot weights do.
"""

import math

import torch
import triton
import triton.language as tl

from .common import TORCH_TO_TL, interpreting, round_to


@triton.jit
def _pool_by_positions_kernel(
    hidden_ptr,
    ids_ptr,
    padding_ptr,
    pooled_ptr,
    mask_ptr,
    overflow_ptr,
    seq_len,
    hidden,
    output_length,
    k,
    inv_k_squared,
    scale,
    stride_hidden_b,
    stride_hidden_n,
    stride_hidden_d,
    stride_ids_b,
    stride_ids_n,
    stride_ids_axis,
    stride_padding_b,
    stride_padding_n,
    DTYPE: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    item = tl.program_id(2).to(tl.int64)
    slots = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_in = cols < hidden
    ids_item = ids_ptr + item * stride_ids_b

    # Pass 1: the item's width in positions.
    max_x = tl.zeros((BLOCK_N,), dtype=tl.int64)
    for n0 in range(0, seq_len, BLOCK_N):
        patches = n0 + tl.arange(0, BLOCK_N)
        x = tl.load(ids_item + patches * stride_ids_n, mask=patches < seq_len, other=0).to(tl.int64)
        max_x = tl.maximum(max_x, x)
    slots_per_row = (tl.max(max_x, axis=0) + 1) // k

    # Pass 2: sum the hidden rows of each slot.
    acc = tl.zeros((BLOCK_S, BLOCK_D), dtype=tl.float32)
    count = tl.zeros((BLOCK_S,), dtype=tl.int32)
    overflow = tl.zeros((BLOCK_N,), dtype=tl.int32)
    for n0 in range(0, seq_len, BLOCK_N):
        patches = n0 + tl.arange(0, BLOCK_N)
        patch_in = patches < seq_len
        ids_row = ids_item + patches * stride_ids_n
        x = tl.maximum(tl.load(ids_row, mask=patch_in, other=0).to(tl.int64), 0)
        y = tl.maximum(tl.load(ids_row + stride_ids_axis, mask=patch_in, other=0).to(tl.int64), 0)
        patch_slot = x // k + slots_per_row * (y // k)
        overflow += (patch_in & (patch_slot >= output_length)).to(tl.int32)
        match = (patch_slot[None, :] == slots[:, None]) & patch_in[None, :]
        count += tl.sum(match.to(tl.int32), axis=1)
        hit = tl.max(match.to(tl.int32), axis=0) != 0
        if tl.max(hit.to(tl.int32), axis=0) != 0:
            padding = tl.load(
                padding_ptr + item * stride_padding_b + patches * stride_padding_n, mask=patch_in, other=1
            ) != 0
            load = hit & ~padding
            rows = tl.load(
                hidden_ptr
                + item * stride_hidden_b
                + patches[:, None] * stride_hidden_n
                + cols[None, :] * stride_hidden_d,
                mask=load[:, None] & col_in[None, :],
                other=0.0,
            )
            if DOT_IN_FP32:  # fp32 hidden states, or the interpreter, which has no bf16 dot
                acc = tl.dot(match.to(tl.float32), rows.to(tl.float32), acc, input_precision="ieee")
            else:  # a 0/1 matrix and bf16/fp16 rows are exact operands; the sum is fp32
                acc = tl.dot(match.to(DTYPE), rows, acc)

    # Stock averages in fp32, rounds to the hidden dtype, then scales by sqrt(D) in fp32.
    pooled = round_to(acc * inv_k_squared, DTYPE).to(tl.float32) * scale
    # Every program scanned the whole item: if any patch fell outside the L slots (which the host
    # raises on unless its checks are off), the item's pooled values are NaN rather than short a patch.
    item_overflows = tl.sum(overflow, axis=0) > 0
    pooled = tl.where(item_overflows, float("nan"), pooled)
    slot_in = slots < output_length
    out_offsets = item * output_length * hidden + slots[:, None].to(tl.int64) * hidden + cols[None, :]
    tl.store(pooled_ptr + out_offsets, pooled, mask=slot_in[:, None] & col_in[None, :])
    if tl.program_id(1) == 0:
        tl.store(mask_ptr + item * output_length + slots, (count > 0).to(tl.uint8), mask=slot_in)
        if tl.program_id(0) == 0:
            tl.store(overflow_ptr + item, tl.sum(overflow, axis=0))


def pool_by_positions(
    hidden_states: torch.Tensor,
    position_ids: torch.Tensor,
    padding_positions: torch.Tensor,
    output_length: int,
    k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the pooler on validated inputs with N = k * k * L, k > 1.

    Returns (pooled fp32 (B, L, D), mask (B, L) bool, overflow (B,) int32: patches whose slot is >= L).
    Items with overflowing patches come out NaN.
    """
    batch, seq_len, hidden = hidden_states.shape
    device = hidden_states.device
    pooled = torch.empty((batch, output_length, hidden), dtype=torch.float32, device=device)
    mask = torch.empty((batch, output_length), dtype=torch.bool, device=device)
    overflow = torch.empty((batch,), dtype=torch.int32, device=device)
    if pooled.numel() == 0:
        return pooled, mask.zero_(), overflow.zero_()
    if interpreting():
        block_s, block_n, block_d, num_warps = 32, 64, triton.next_power_of_2(hidden), 1
    else:
        # 8 warps: at 4, the fp32 (ieee) dot's 64 x 128 accumulator and operands spill registers.
        block_s, block_n, block_d, num_warps = 64, 64, min(128, triton.next_power_of_2(hidden)), 8
    grid = (triton.cdiv(output_length, block_s), triton.cdiv(hidden, block_d), batch)
    _pool_by_positions_kernel[grid](
        hidden_states,
        position_ids,
        padding_positions.view(torch.uint8),
        pooled,
        mask.view(torch.uint8),
        overflow,
        seq_len,
        hidden,
        output_length,
        k,
        1.0 / (k * k),
        math.sqrt(hidden),
        *hidden_states.stride(),
        *position_ids.stride(),
        *padding_positions.stride(),
        DTYPE=TORCH_TO_TL[hidden_states.dtype],
        DOT_IN_FP32=hidden_states.dtype == torch.float32 or interpreting(),
        BLOCK_S=block_s,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        num_warps=num_warps,
    )
    return pooled, mask, overflow
