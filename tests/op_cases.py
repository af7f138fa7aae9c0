"""Inputs and stock comparisons shared by the ops' tests."""

import torch

from fused_vision import reference

from conftest import DEVICE

# One unit in the last place, relative: 2**-(stored mantissa bits).
ULP = {torch.float32: 2**-23, torch.float16: 2**-10, torch.bfloat16: 2**-7}
# fp32 accumulation over K terms in another order than stock's: a bound on sum |w_k x_k| far above the
# typical sqrt(K) * 2**-24 and well under the worst case K * 2**-24.
ACCUMULATION = 1e-5


def make_ids(batch, seq_len, num_positions, *, id_dtype=torch.int64, padded_tail=0, half_padded=0, generator=None):
    """Random (x, y) ids in [0, P) with the last `padded_tail` patches of each item (-1, -1), then
    `half_padded` patches at the front with only x = -1 and as many after them with only y = -1 (each
    clamped to 0 and looked up, not padding)."""
    ids = torch.randint(0, num_positions, (batch, seq_len, 2), generator=generator)
    if padded_tail:
        ids[:, seq_len - padded_tail :] = -1
    if half_padded:
        ids[:, :half_padded, 0] = -1
        ids[:, half_padded : 2 * half_padded, 1] = -1
    return ids.to(id_dtype)


def make_inputs(batch, seq_len, features, hidden, num_positions, dtype, pixel_dtype, padded_tail):
    """Random pixels on every row, padding rows too: what the kernel writes there is their projection
    (processors pad with zero pixels, which would hide a kernel that skips them)."""
    pixels = torch.rand(batch, seq_len, features, device=DEVICE).to(pixel_dtype)
    weight = (torch.randn(hidden, features, device=DEVICE) / features**0.5).to(dtype)
    table = torch.randn(2, num_positions, hidden, device=DEVICE).to(dtype)
    ids = make_ids(batch, seq_len, num_positions, padded_tail=padded_tail, half_padded=2).to(DEVICE)
    return pixels, weight, table, ids


def assert_matches_stock(actual, pixels, weight, table, ids):
    """Elementwise against stock. The GEMM sums in another order: its fp32 sums differ by accumulation
    error, the projection's rounding may then differ by one unit, and the output's by one more."""
    stock = reference.patch_embed(pixels, weight, table, ids).double()
    prescaled = (2 * (pixels - 0.5)).to(weight.dtype).double()
    projection = prescaled @ weight.double().t()
    terms = prescaled.abs() @ weight.double().abs().t()
    bound = ULP[weight.dtype] * (projection.abs() + stock.abs()) + ACCUMULATION * terms
    error = (actual.double() - stock).abs()
    if (error > bound).any():
        worst = (error - bound).flatten().topk(min(5, error.numel())).indices
        coords = [tuple(int(c) for c in torch.unravel_index(i, error.shape)) for i in worst]
        detail = "; ".join(
            f"{c}: {actual[c].item():.7g} vs {stock[c].item():.7g} (bound {bound[c].item():.3g})" for c in coords
        )
        raise AssertionError(
            f"{int((error > bound).sum())} elements differ from stock beyond rounding; worst: {detail}"
        )


def grid_ids(width, height, seq_len):
    """Row-major (x fastest) ids of a width x height patch grid, padded with (-1, -1) to seq_len."""
    ys, xs = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    ids = torch.stack([xs.flatten(), ys.flatten()], dim=-1)
    return torch.cat([ids, torch.full((seq_len - len(ids), 2), -1)])


def make_batch(grids, k, output_length, hidden, dtype, shuffle=False):
    seq_len = k * k * output_length
    ids = torch.stack([grid_ids(w, h, seq_len) for w, h in grids])
    if shuffle:  # the pooler is defined by positions, not by patch order
        ids = ids[:, torch.randperm(seq_len)]
    hidden_states = torch.randn(len(grids), seq_len, hidden).to(dtype)
    return hidden_states.to(DEVICE), ids.to(DEVICE), (ids == -1).all(-1).to(DEVICE)


def assert_within(actual, expected, bound, what="output"):
    """|actual - expected| <= bound elementwise (NaN where both are NaN), the worst elements named."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    error = (actual.double() - expected.double()).abs()
    both_nan = actual.isnan() & expected.isnan()
    over = ~both_nan & ~(error <= bound)
    if over.any():
        where = over.nonzero()[:5].tolist()
        detail = "; ".join(
            f"{tuple(i)}: {actual[tuple(i)].item():.7g} vs {expected[tuple(i)].item():.7g} "
            f"(bound {bound[tuple(i)]:.3g})"
            for i in where
        )
        raise AssertionError(f"{what}: {int(over.sum())} elements beyond the bound; first: {detail}")


def exactly_summable(*shape, dtype, generator=None):
    """Multiples of 1/8 in [-4, 4]: their squares sum exactly in fp32 over a few thousand values, in any
    order, so a row norm's sum cannot depend on the reduction order."""
    return (torch.randint(-32, 33, shape, generator=generator) / 8).to(DEVICE, dtype)


def sum_order_error(size):
    """A bound on the relative error of an RMS norm's output from summing ``size`` fp32 squares in another
    order: each order is off by at most size * 2**-24 relative, and the -0.5 power halves it."""
    return size * 2**-25
