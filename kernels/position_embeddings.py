"""Gemma 4's 2-D position-embedding lookup as a gather (no one-hot, one pass, one store), and its
table gradient as a scatter-add.

out[r] = round(residual[r] + round(table[0, x] + table[1, y]))   (residual optional)

over the flattened (B * N) rows r, with (x, y) = position_ids[r] clamped at 0, and zero in place of the
lookup on padding rows. Each program owns BLOCK_ROWS whole rows: it reads their ids once, then walks D in
BLOCK_D columns (an exact tiling of the real widths, 768 and 1152), reading the two table rows only for
rows that are not padding. Both roundings are the dtype's own adds, as stock's.
"""

import torch
import triton
import triton.language as tl

from .common import (
    TORCH_TO_TL,
    as_rows,
    block_mask,
    interpreting,
    launcher,
    offset_dtype,
    unit_inner_stride,
)


@triton.jit
def table_rows(table_ptr, ids_ptr, padding_ptr, rows, row_in, num_positions, stride_table_axis, stride_table_pos):
    """Per row of a tile, from (rows, 2) ids and (rows,) padding flags: the pointers to its x and y table
    rows, whether it reads them, and the value it holds where it does not (0 for padding, NaN for ids P or
    above: the host's check may be off, and such a row must not pass for a lookup)."""
    x = tl.load(ids_ptr + 2 * rows, mask=row_in, other=0)
    y = tl.load(ids_ptr + 2 * rows + 1, mask=row_in, other=0)
    padding = tl.load(padding_ptr + rows, mask=row_in, other=1) != 0
    ids_valid = (x < num_positions) & (y < num_positions)
    lookup = row_in & ~padding & ids_valid
    fill = tl.where(ids_valid, 0.0, float("nan"))
    # Stock's clamp(min=0): a negative id reads row 0.
    x_rows = table_ptr + tl.maximum(x, 0).to(rows.dtype) * stride_table_pos
    y_rows = table_ptr + stride_table_axis + tl.maximum(y, 0).to(rows.dtype) * stride_table_pos
    return x_rows, y_rows, lookup, fill


@triton.jit
def lookup_block(x_rows, y_rows, lookup, fill, cols, HIDDEN: tl.constexpr, BLOCK_D: tl.constexpr, DTYPE: tl.constexpr):
    """round(table[0, x] + table[1, y]) on a block of columns, in DTYPE: ``fill`` on rows that read nothing."""
    if HIDDEN % BLOCK_D == 0:
        mask = lookup[:, None]
    else:
        mask = lookup[:, None] & (cols < HIDDEN)[None, :]
    fill = fill.to(DTYPE)[:, None]
    x_row = tl.load(x_rows[:, None] + cols[None, :], mask=mask, other=fill)
    y_row = tl.load(y_rows[:, None] + cols[None, :], mask=mask, other=fill)
    return x_row + y_row


@triton.jit
def _position_embeddings_kernel(
    table_ptr,
    ids_ptr,
    padding_ptr,
    residual_ptr,
    out_ptr,
    num_rows,
    num_positions,
    stride_table_axis,
    stride_table_pos,
    stride_residual,
    HIDDEN: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    DTYPE: tl.constexpr,
    OFFSETS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0).to(OFFSETS) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_in = rows < num_rows
    x_rows, y_rows, lookup, fill = table_rows(
        table_ptr, ids_ptr, padding_ptr, rows, row_in, num_positions, stride_table_axis, stride_table_pos
    )
    for start in tl.static_range(0, HIDDEN, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        store = block_mask(row_in, cols, HIDDEN, BLOCK_D)
        pe = lookup_block(x_rows, y_rows, lookup, fill, cols, HIDDEN, BLOCK_D, DTYPE)
        if HAS_RESIDUAL:
            # Stock's `hidden + pe`: one more add in the dtype.
            residual = tl.load(residual_ptr + rows[:, None] * stride_residual + cols[None, :], mask=store)
            pe = residual + pe
        tl.store(out_ptr + rows[:, None] * HIDDEN + cols[None, :], pe, mask=store)


def launch_config(hidden: int, interpreted: bool) -> tuple[int, int, int]:
    """(BLOCK_ROWS, BLOCK_D, num_warps). On a GPU, 128-column blocks (16-byte vectors, 16 threads a row; they
    tile 768 and 1152 exactly) and 16 rows per 4-warp program, each thread 2 rows: ids read once per row,
    5,040 programs at 80,640 rows to spread over the SMs. The interpreter pays per program and per block:
    the largest tiles instead."""
    if interpreted:
        return 64, triton.next_power_of_2(hidden), 1
    return 16, min(128, triton.next_power_of_2(hidden)), 4


def flat_ids(position_ids: torch.Tensor, padding_positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, N, 2) ids and (B, N) padding as contiguous (B * N, 2) and (B * N,) uint8: the kernels index them
    by row alone (a copy only for views, 17 bytes a row against the 2 D a row they write)."""
    return position_ids.reshape(-1, 2).contiguous(), padding_positions.reshape(-1).contiguous().view(torch.uint8)


@launcher
def position_embeddings(
    table: torch.Tensor,
    position_ids: torch.Tensor,
    padding_positions: torch.Tensor,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch the lookup on already-validated inputs; returns a new contiguous (B, N, D) tensor."""
    table = unit_inner_stride(table)
    batch, seq_len, _ = position_ids.shape
    _, num_positions, hidden = table.shape
    out = torch.empty((batch, seq_len, hidden), dtype=table.dtype, device=table.device)
    if out.numel() == 0:
        return out
    ids, padding = flat_ids(position_ids, padding_positions)
    # A null residual still needs a pointer argument; HAS_RESIDUAL keeps it from being read.
    residual_rows = out.view(-1, hidden) if residual is None else as_rows(residual)
    block_rows, block_d, num_warps = launch_config(hidden, interpreting())
    _position_embeddings_kernel[(triton.cdiv(ids.shape[0], block_rows),)](
        table,
        ids,
        padding,
        residual_rows,
        out,
        ids.shape[0],
        num_positions,
        table.stride(0),
        table.stride(1),
        residual_rows.stride(0),
        HIDDEN=hidden,
        HAS_RESIDUAL=residual is not None,
        DTYPE=TORCH_TO_TL[table.dtype],
        OFFSETS=offset_dtype(out, table, residual_rows),
        BLOCK_ROWS=block_rows,
        BLOCK_D=block_d,
        num_warps=num_warps,
    )
    return out


@triton.jit
def _position_embeddings_backward_kernel(
    grad_ptr,
    ids_ptr,
    padding_ptr,
    acc_ptr,
    num_rows,
    num_positions,
    stride_grad,
    stride_acc_axis,
    HIDDEN: tl.constexpr,
    OFFSETS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """acc[0, x] += grad[row] and acc[1, y] += grad[row] for every row that reads the table, in fp32 atomics."""
    rows = tl.program_id(0).to(OFFSETS) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_in = rows < num_rows
    x_rows, y_rows, scatter, _ = table_rows(
        acc_ptr, ids_ptr, padding_ptr, rows, row_in, num_positions, stride_acc_axis, HIDDEN
    )
    for start in tl.static_range(0, HIDDEN, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        mask = block_mask(scatter, cols, HIDDEN, BLOCK_D)
        grad = tl.load(grad_ptr + rows[:, None] * stride_grad + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.atomic_add(x_rows[:, None] + cols[None, :], grad, mask=mask, sem="relaxed")
        tl.atomic_add(y_rows[:, None] + cols[None, :], grad, mask=mask, sem="relaxed")


@launcher
def position_embeddings_backward(
    grad: torch.Tensor, position_ids: torch.Tensor, padding_positions: torch.Tensor, num_positions: int
) -> torch.Tensor:
    """The fp32 (2, P, D) gradient of the lookup's table; the order of the atomic adds is not fixed."""
    batch, seq_len, hidden = grad.shape
    acc = torch.zeros((2, num_positions, hidden), dtype=torch.float32, device=grad.device)
    if batch * seq_len == 0 or hidden == 0:
        return acc
    ids, padding = flat_ids(position_ids, padding_positions)
    grad_rows = as_rows(grad)
    block_rows, block_d, num_warps = launch_config(hidden, interpreting())
    _position_embeddings_backward_kernel[(triton.cdiv(ids.shape[0], block_rows),)](
        grad_rows,
        ids,
        padding,
        acc,
        ids.shape[0],
        num_positions,
        grad_rows.stride(0),
        acc.stride(0),
        HIDDEN=hidden,
        OFFSETS=offset_dtype(acc, grad_rows),
        BLOCK_ROWS=block_rows,
        BLOCK_D=block_d,
        num_warps=num_warps,
    )
    return acc
