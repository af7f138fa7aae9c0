"""Gemma 4's 2-D position-embedding lookup as a gather (no one-hot, one pass, one store), and its
table gradient as a scatter-add.

out[b, n] = round(residual[b, n] + round(table[0, x] + table[1, y]))   (residual optional)

with (x, y) = position_ids[b, n] clamped at 0 and zero in place of the lookup on padding rows. Each
program owns a BLOCK_ROWS x BLOCK_D tile of the flattened (B * N, D) output; the two table rows are
fetched only for rows that are not padding.
"""

import torch
import triton
import triton.language as tl

from .common import TORCH_TO_TL, gather_launch_config, int32_inner_offsets, interpreting, launcher, round_to


@triton.jit
def load_positions(
    ids_ptr,
    padding_ptr,
    batch,
    patch,
    row_in,
    stride_ids_b,
    stride_ids_n,
    stride_ids_axis,
    stride_padding_b,
    stride_padding_n,
):
    """The (x, y) ids as int64 and the padding flag of each row of a tile."""
    ids_row = ids_ptr + batch * stride_ids_b + patch * stride_ids_n
    x = tl.load(ids_row, mask=row_in, other=0).to(tl.int64)
    y = tl.load(ids_row + stride_ids_axis, mask=row_in, other=0).to(tl.int64)
    padding = tl.load(padding_ptr + batch * stride_padding_b + patch * stride_padding_n, mask=row_in, other=1) != 0
    return x, y, padding


@triton.jit
def table_rows(x, y, padding, row_in, num_positions):
    """Which table rows each row of a tile touches, in both directions (lookup and gradient).

    Returns the ids clamped at 0 (stock's clamp: a negative id reads row 0), whether they are below P,
    and whether the row touches the table at all: below P, not padding, inside the tensor. The host
    checks the range; rows that slip past it (a skipped check) touch nothing.
    """
    ids_valid = (x < num_positions) & (y < num_positions)
    touches = row_in & ~padding & ids_valid
    return tl.maximum(x, 0), tl.maximum(y, 0), ids_valid, touches


@triton.jit
def position_embeddings_tile(
    table_ptr,
    x,
    y,
    padding,
    row_in,
    cols,
    col_in,
    num_positions,
    stride_table_axis,
    stride_table_pos,
    stride_table_d,
    DTYPE: tl.constexpr,
):
    """fp32 tile holding round_DTYPE(table[0, x] + table[1, y]), 0 on padding rows, NaN on rows whose
    ids are P or above."""
    x, y, ids_valid, lookup = table_rows(x, y, padding, row_in, num_positions)
    lookup_tile = lookup[:, None] & col_in[None, :]
    col_offsets = cols[None, :] * stride_table_d
    x_row = tl.load(table_ptr + x[:, None] * stride_table_pos + col_offsets, mask=lookup_tile, other=0.0)
    y_row = tl.load(
        table_ptr + stride_table_axis + y[:, None] * stride_table_pos + col_offsets, mask=lookup_tile, other=0.0
    )
    # Stock sums the two rows in fp32 and rounds once to the table dtype.
    pe = round_to(x_row.to(tl.float32) + y_row.to(tl.float32), DTYPE).to(tl.float32)
    pe = tl.where(padding[:, None], 0.0, pe)
    return tl.where(ids_valid[:, None], pe, float("nan"))


@triton.jit
def _position_embeddings_kernel(
    table_ptr,
    ids_ptr,
    padding_ptr,
    residual_ptr,
    out_ptr,
    num_rows,
    seq_len,
    num_positions,
    hidden,
    stride_table_axis,
    stride_table_pos,
    stride_table_d,
    stride_ids_b,
    stride_ids_n,
    stride_ids_axis,
    stride_padding_b,
    stride_padding_n,
    stride_residual_b,
    stride_residual_n,
    stride_residual_d,
    HAS_RESIDUAL: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # int64 row indices: B * N * D may exceed 2**31 elements.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    row_in = rows < num_rows
    col_in = cols < hidden
    tile_in = row_in[:, None] & col_in[None, :]
    batch = rows // seq_len
    patch = rows % seq_len

    x, y, padding = load_positions(
        ids_ptr,
        padding_ptr,
        batch,
        patch,
        row_in,
        stride_ids_b,
        stride_ids_n,
        stride_ids_axis,
        stride_padding_b,
        stride_padding_n,
    )
    pe = position_embeddings_tile(
        table_ptr,
        x,
        y,
        padding,
        row_in,
        cols,
        col_in,
        num_positions,
        stride_table_axis,
        stride_table_pos,
        stride_table_d,
        OUT_DTYPE,
    )
    if HAS_RESIDUAL:
        residual = tl.load(
            residual_ptr
            + batch[:, None] * stride_residual_b
            + patch[:, None] * stride_residual_n
            + cols[None, :] * stride_residual_d,
            mask=tile_in,
            other=0.0,
        )
        # Stock `hidden + pe`: one more fp32 add and one more rounding.
        pe = residual.to(tl.float32) + pe

    tl.store(out_ptr + rows[:, None] * hidden + cols[None, :], round_to(pe, OUT_DTYPE), mask=tile_in)


@launcher
def position_embeddings(
    table: torch.Tensor,
    position_ids: torch.Tensor,
    padding_positions: torch.Tensor,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch the lookup on already-validated inputs; returns a new contiguous (B, N, D) tensor."""
    table = int32_inner_offsets(table)
    batch, seq_len, _ = position_ids.shape
    _, num_positions, hidden = table.shape
    out = torch.empty((batch, seq_len, hidden), dtype=table.dtype, device=table.device)
    num_rows = batch * seq_len
    if out.numel() == 0:
        return out
    block_rows, block_d, num_warps = gather_launch_config(hidden, interpreting())
    grid = (triton.cdiv(num_rows, block_rows), triton.cdiv(hidden, block_d))
    # A null residual still needs a pointer argument; HAS_RESIDUAL keeps it from being read.
    residual_arg = out if residual is None else int32_inner_offsets(residual)
    _position_embeddings_kernel[grid](
        table,
        position_ids,
        padding_positions.view(torch.uint8),
        residual_arg,
        out,
        num_rows,
        seq_len,
        num_positions,
        hidden,
        *table.stride(),
        *position_ids.stride(),
        *padding_positions.stride(),
        *residual_arg.stride(),
        HAS_RESIDUAL=residual is not None,
        OUT_DTYPE=TORCH_TO_TL[table.dtype],
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
    seq_len,
    num_positions,
    hidden,
    stride_grad_b,
    stride_grad_n,
    stride_grad_d,
    stride_ids_b,
    stride_ids_n,
    stride_ids_axis,
    stride_padding_b,
    stride_padding_n,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """acc[0, x] += grad[row] and acc[1, y] += grad[row] for every non-padding row, in fp32 atomics."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    row_in = rows < num_rows
    col_in = cols < hidden
    batch = rows // seq_len
    patch = rows % seq_len
    x, y, padding = load_positions(
        ids_ptr,
        padding_ptr,
        batch,
        patch,
        row_in,
        stride_ids_b,
        stride_ids_n,
        stride_ids_axis,
        stride_padding_b,
        stride_padding_n,
    )
    x, y, _, scatter_rows = table_rows(x, y, padding, row_in, num_positions)
    scatter = scatter_rows[:, None] & col_in[None, :]
    grad = tl.load(
        grad_ptr + batch[:, None] * stride_grad_b + patch[:, None] * stride_grad_n + cols[None, :] * stride_grad_d,
        mask=scatter,
        other=0.0,
    ).to(tl.float32)
    x_rows = acc_ptr + x[:, None] * hidden + cols[None, :]
    y_rows = acc_ptr + (num_positions + y)[:, None] * hidden + cols[None, :]
    tl.atomic_add(x_rows, grad, mask=scatter, sem="relaxed")
    tl.atomic_add(y_rows, grad, mask=scatter, sem="relaxed")


@launcher
def position_embeddings_backward(
    grad: torch.Tensor, position_ids: torch.Tensor, padding_positions: torch.Tensor, num_positions: int
) -> torch.Tensor:
    """The fp32 (2, P, D) gradient of the lookup's table; the order of the atomic adds is not fixed."""
    grad = int32_inner_offsets(grad)
    batch, seq_len, hidden = grad.shape
    acc = torch.zeros((2, num_positions, hidden), dtype=torch.float32, device=grad.device)
    num_rows = batch * seq_len
    if num_rows == 0 or hidden == 0:
        return acc
    block_rows, block_d, num_warps = gather_launch_config(hidden, interpreting())
    grid = (triton.cdiv(num_rows, block_rows), triton.cdiv(hidden, block_d))
    _position_embeddings_backward_kernel[grid](
        grad,
        position_ids,
        padding_positions.view(torch.uint8),
        acc,
        num_rows,
        seq_len,
        num_positions,
        hidden,
        *grad.stride(),
        *position_ids.stride(),
        *padding_positions.stride(),
        BLOCK_ROWS=block_rows,
        BLOCK_D=block_d,
        num_warps=num_warps,
    )
    return acc
