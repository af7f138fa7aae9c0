"""Gemma 4's pooler as a gather-sum: each slot's k x k patch rows summed in a fixed order, no (B, N, L)
one-hot and no fp32 copy of the hidden states.

pooled[b, s] = round_hidden(sum_{n: slot(b, n) == s} hidden[b, n] / k^2) * sqrt(D)    (fp32 result;
               without round_hidden where ``round_average`` is False)
slot(b, n)   = x // k + ((max_x(b) + 1) // k) * (y // k),   with (x, y) = clamp(position_ids[b, n], 0, N / k)
place(b, n)  = x % k + k * (y % k),                          the patch's place in its slot's k x k block

Two launches:
1. ``_patch_slots_kernel``, one program per item, writes each patch's slot as int32 (-1 for padding,
   whose hidden state stock zeroes, and for overflow), each slot's k * k members (the patch at each
   place, -1 where none is: padding, an image's edge), the mask of filled slots (padding counts, as in
   stock's one-hot), and per item the patches beyond the L slots and the patches whose place another
   patch already holds (ids that repeat a position, which no processor's grid has): 8 bytes per patch
   of scratch.
2. ``_pool_by_positions_kernel``: a program owns BLOCK_S slots x BLOCK_D columns of one item and sums
   its slots' members' rows place by place, so each hidden row is read once and each pooled value
   written once. An item with repeated positions is summed instead by a walk over all its patches in
   index order: exact and deterministic, N / k^2 times the reads.
The sum order is fixed, so results are bit-identical across runs; the atomics of launch 1 only claim
places, and an item where two patches claim one takes the walk, whichever won.

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
    block_mask,
    gather_launch_config,
    int32_inner_offsets,
    interpreting,
    launcher,
    offset_dtype,
    round_to,
    unit_inner_stride,
)


@triton.jit
def _patch_slots_kernel(
    ids_ptr,
    padding_ptr,
    codes_ptr,
    members_ptr,
    mask_ptr,
    counts_ptr,
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
    members_item = members_ptr + item * seq_len  # L slots x k * k places = N entries
    mask_item = mask_ptr + item * output_length

    # Ids clamped to k * L = N / k, as in the reference's pooling_slots: no verdict changes, no int64 wraps.
    id_limit = seq_len // k
    # No slot filled, no member in any place, and the item's width in positions (int32: ids are clamped).
    for s0 in range(0, output_length, BLOCK_S):
        slots = s0 + tl.arange(0, BLOCK_S)
        tl.store(mask_item + slots, tl.zeros((BLOCK_S,), tl.uint8), mask=slots < output_length)
    max_x = tl.zeros((BLOCK_N,), dtype=tl.int32)
    for n0 in range(0, seq_len, BLOCK_N):
        patches = n0 + tl.arange(0, BLOCK_N)
        patch_in = patches < seq_len
        x = tl.load(ids_item + patches.to(tl.int64) * stride_ids_n, mask=patch_in, other=0).to(tl.int64)
        max_x = tl.maximum(max_x, tl.minimum(x, id_limit).to(tl.int32))
        tl.store(members_item + patches, tl.full((BLOCK_N,), -1, tl.int32), mask=patch_in)
    # int64: the slot's one product may pass 2**31 for ids far beyond the slots.
    slots_per_row = ((tl.max(max_x, axis=0) + 1) // k).to(tl.int64)
    tl.debug_barrier()  # the atomics and mask stores below may hit entries other threads initialised

    overflow = tl.zeros((BLOCK_N,), dtype=tl.int32)
    repeats = tl.zeros((BLOCK_N,), dtype=tl.int32)
    for n0 in range(0, seq_len, BLOCK_N):
        patches = n0 + tl.arange(0, BLOCK_N)
        patch_in = patches < seq_len
        ids_row = ids_item + patches.to(tl.int64) * stride_ids_n
        # Clamped in int64, then int32: N / k fits, and the slot's product below is the one wide term.
        x = tl.minimum(tl.maximum(tl.load(ids_row, mask=patch_in, other=0).to(tl.int64), 0), id_limit).to(tl.int32)
        y = tl.load(ids_row + stride_ids_axis, mask=patch_in, other=0).to(tl.int64)
        y = tl.minimum(tl.maximum(y, 0), id_limit).to(tl.int32)
        slot = x // k + slots_per_row * (y // k)
        in_slots = patch_in & (slot < output_length)
        overflow += (patch_in & ~in_slots).to(tl.int32)
        padding_row = padding_ptr + item * stride_padding_b + patches.to(tl.int64) * stride_padding_n
        padding = tl.load(padding_row, mask=patch_in, other=1) != 0
        summed = in_slots & ~padding
        slot = tl.where(in_slots, slot, 0).to(tl.int32)  # a safe address where the masks are off
        place = x % k + k * (y % k)
        tl.store(codes_ptr + item * seq_len + patches, tl.where(summed, slot, -1), mask=patch_in)
        held = tl.atomic_xchg(members_item + slot * k * k + place, patches, mask=summed, sem="relaxed")
        repeats += (summed & (held >= 0)).to(tl.int32)
        tl.store(mask_item + slot, tl.full((BLOCK_N,), 1, tl.uint8), mask=in_slots)
    tl.store(counts_ptr + item * 2, tl.sum(overflow, axis=0))
    tl.store(counts_ptr + item * 2 + 1, tl.sum(repeats, axis=0))


@triton.jit
def _slot_sums(
    hidden_item,
    codes_item,
    members,
    slots,
    slot_in,
    cols,
    seq_len,
    stride_hidden_n,
    repeats,
    HIDDEN: tl.constexpr,
    PLACES: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    OFFSETS: tl.constexpr,
):
    """fp32 sums of each slot's patch rows on a block of columns: place by place, or, where the item
    repeats a position, every patch in index order."""
    acc = tl.zeros((BLOCK_S, BLOCK_D), dtype=tl.float32)
    if repeats == 0:
        for place in tl.static_range(PLACES):
            member = tl.load(members + place, mask=slot_in, other=-1)
            # Empty places (padding, an image's edge) read nothing: their zeros add nothing.
            rows = hidden_item + member[:, None].to(OFFSETS) * stride_hidden_n + cols[None, :]
            acc += tl.load(rows, mask=block_mask(member >= 0, cols, HIDDEN, BLOCK_D), other=0.0).to(tl.float32)
    else:
        row = hidden_item + cols  # stepped a row at a time: 64-bit pointers, no offset to overflow
        for n in range(0, seq_len):
            slot = tl.load(codes_item + n)
            values = tl.load(row, mask=(cols < HIDDEN) & (slot >= 0), other=0.0)
            acc += tl.where(slots[:, None] == slot, values.to(tl.float32)[None, :], 0.0)
            row += stride_hidden_n
    return acc


@triton.jit
def _pool_by_positions_kernel(
    hidden_ptr,
    codes_ptr,
    members_ptr,
    counts_ptr,
    pooled_ptr,
    seq_len,
    output_length,
    inv_k_squared,
    scale,
    stride_hidden_b,
    stride_hidden_n,
    HIDDEN: tl.constexpr,
    PLACES: tl.constexpr,
    DTYPE: tl.constexpr,
    ROUND_AVERAGE: tl.constexpr,
    OFFSETS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One grid axis, item-major (CUDA caps the others at 65,535, fewer programs than a batch of video frames
    # can need), the column blocks of a slot block side by side: their programs read the same members.
    column_blocks: tl.constexpr = (HIDDEN + BLOCK_D - 1) // BLOCK_D
    pid = tl.program_id(0)
    slot_blocks = tl.cdiv(output_length, BLOCK_S)
    item = (pid // (slot_blocks * column_blocks)).to(OFFSETS)
    slots = (pid // column_blocks % slot_blocks) * BLOCK_S + tl.arange(0, BLOCK_S)
    cols = (pid % column_blocks) * BLOCK_D + tl.arange(0, BLOCK_D)
    slot_in = slots < output_length

    members = members_ptr + (item * output_length + slots) * PLACES
    acc = _slot_sums(
        hidden_ptr + item * stride_hidden_b,
        codes_ptr + item * seq_len,
        members,
        slots,
        slot_in,
        cols,
        seq_len,
        stride_hidden_n,
        tl.load(counts_ptr + item * 2 + 1),
        HIDDEN,
        PLACES,
        BLOCK_S,
        BLOCK_D,
        OFFSETS,
    )
    # Stock averages in fp32, rounds to the hidden dtype (transformers; not SGLang's EmbeddingGemma2), then
    # scales by sqrt(D) in fp32.
    average = acc * inv_k_squared
    if ROUND_AVERAGE:
        average = round_to(average, DTYPE).to(tl.float32)
    pooled = average * scale
    # If any patch fell outside the L slots (which the host raises on where its checks run), the item's
    # pooled values are NaN rather than short a patch.
    pooled = tl.where(tl.load(counts_ptr + item * 2) > 0, float("nan"), pooled)
    out_rows = pooled_ptr + (item * output_length + slots)[:, None] * HIDDEN
    tl.store(out_rows + cols[None, :], pooled, mask=block_mask(slot_in, cols, HIDDEN, BLOCK_D))


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


@launcher
def patch_slots(
    position_ids: torch.Tensor, padding_positions: torch.Tensor, output_length: int, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the slot pass on validated inputs with N = k * k * L.

    Returns (codes (B, N) int32: each patch's slot, -1 for padding and overflow; members (B, L, k * k)
    int32: the patch at each place of each slot, -1 where none; mask (B, L) bool: the slots any patch
    falls in; counts (B, 2) int32: per item the patches whose slot is >= L, and those whose place an
    earlier-claimed patch holds).
    """
    batch, seq_len, _ = position_ids.shape
    device = position_ids.device
    codes = torch.empty((batch, seq_len), dtype=torch.int32, device=device)
    members = torch.empty((batch, output_length, k * k), dtype=torch.int32, device=device)
    mask = torch.empty((batch, output_length), dtype=torch.bool, device=device)
    counts = torch.empty((batch, 2), dtype=torch.int32, device=device)
    if batch == 0:
        return codes, members, mask, counts
    # One program per item: wide blocks keep its three passes short, 8 warps keep them spill-free.
    _patch_slots_kernel[(batch,)](
        position_ids,
        padding_positions.view(torch.uint8),
        codes,
        members,
        mask.view(torch.uint8),
        counts,
        seq_len,
        output_length,
        k,
        *position_ids.stride(),
        *padding_positions.stride(),
        BLOCK_N=min(512, triton.next_power_of_2(seq_len)),
        BLOCK_S=min(512, triton.next_power_of_2(output_length)),
        num_warps=8,
    )
    return codes, members, mask, counts


def launch_config(output_length: int, hidden: int, interpreted: bool) -> tuple[int, int, int]:
    """(BLOCK_S, BLOCK_D, num_warps). On a GPU 16 slots x 128 columns on 4 warps: each thread sums two
    slots' 16-byte row pieces, 9 loads in flight at k = 3, and 5,040 programs at image 32x280 to spread
    over the SMs. The interpreter pays per program: the largest tiles instead."""
    if interpreted:
        return min(64, triton.next_power_of_2(output_length)), triton.next_power_of_2(hidden), 1
    return 16, min(128, triton.next_power_of_2(hidden)), 4


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
    hidden_states = unit_inner_stride(hidden_states)
    batch, seq_len, hidden = hidden_states.shape
    pooled = torch.empty((batch, output_length, hidden), dtype=torch.float32, device=hidden_states.device)
    codes, members, mask, counts = patch_slots(position_ids, padding_positions, output_length, k)
    if pooled.numel() == 0:
        return pooled, mask, counts[:, 0]
    block_s, block_d, num_warps = launch_config(output_length, hidden, interpreting())
    grid = (batch * triton.cdiv(output_length, block_s) * triton.cdiv(hidden, block_d),)
    _pool_by_positions_kernel[grid](
        hidden_states,
        codes,
        members,
        counts,
        pooled,
        seq_len,
        output_length,
        1.0 / (k * k),
        math.sqrt(hidden),
        hidden_states.stride(0),
        hidden_states.stride(1),
        HIDDEN=hidden,
        PLACES=k * k,
        DTYPE=TORCH_TO_TL[hidden_states.dtype],
        ROUND_AVERAGE=round_average,
        OFFSETS=offset_dtype(hidden_states, pooled),
        BLOCK_S=block_s,
        BLOCK_D=block_d,
        num_warps=num_warps,
    )
    return pooled, mask, counts[:, 0]


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
