"""The pooler against stock's one-hot: same slots and mask, averages within one rounding, deterministic."""

import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import fused_vision
from fused_vision import reference
from fused_vision.kernels.common import int32_inner_offsets

from helpers import DEVICE, FLOAT_DTYPES, assert_bit_identical, assert_close, dtype_id, poison_empty
from op_cases import grads, grid_ids, make_batch

BACKENDS = ["triton", "reference"]
# The average rounds to the hidden dtype before the fp32 scale: allow one unit in its last place.
TOLERANCE = {torch.float32: 1e-6, torch.float16: 2**-10, torch.bfloat16: 2**-7}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize(
    "grids,k,output_length,hidden,shuffle",
    [
        ([(12, 9), (6, 6), (9, 3)], 3, 12, 40, False),
        ([(8, 10), (4, 4)], 2, 20, 33, True),
        ([(15, 6), (3, 3)], 3, 10, 130, False),
    ],
    ids=["k3_three_items", "k2_shuffled", "k3_D130"],
)
@pytest.mark.parametrize("round_average", [True, False], ids=["rounded_average", "fp32_average"])
def test_matches_onehot_pooler(poisoned, backend, dtype, grids, k, output_length, hidden, shuffle, round_average):
    hidden_states, ids, padding = make_batch(grids, k, output_length, hidden, dtype, shuffle)
    pooled, mask = fused_vision.pool_by_positions(
        hidden_states, ids, padding, output_length, round_average=round_average, backend=backend
    )
    expected, expected_mask = reference.onehot_pool_by_positions(
        hidden_states, ids, padding, output_length, round_average
    )
    assert pooled.dtype == torch.float32
    assert_bit_identical(mask, expected_mask, "mask")
    tol = TOLERANCE[dtype]
    assert_close(pooled, expected, atol=tol * hidden**0.5, rtol=tol)


@pytest.mark.parametrize("round_average", [True, False], ids=["rounded_average", "fp32_average"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_bit_identical_to_stock_where_the_sums_are_exact(poisoned, backend, dtype, round_average):
    """Hidden states of the dtype's full precision on one grid (fp32: two bits short) and k = 2: stock's
    terms h / 4 and their sums are exact in fp32 in any order, so the average, its rounding to the hidden
    dtype (two bits more than the dtype holds) or not, and the fp32 sqrt(D) scale must match stock bit
    for bit; the tolerance of the other tests would let a skipped or an extra rounding through. With
    k = 3 stock rounds every term h * fl(1/9) before summing, so only the tolerance applies there."""
    hidden_states, ids, padding = make_batch([(8, 10), (4, 4), (6, 7)], 2, 20, 40, dtype, shuffle=True)
    bits = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 22}[dtype]
    generator = torch.Generator().manual_seed(3)
    grid_values = torch.randint(-(2 ** (bits - 1)), 2 ** (bits - 1), hidden_states.shape, generator=generator)
    hidden_states = (grid_values / 2 ** (bits - 4)).to(DEVICE, dtype)
    pooled, mask = fused_vision.pool_by_positions(
        hidden_states, ids, padding, 20, round_average=round_average, backend=backend
    )
    expected, expected_mask = reference.onehot_pool_by_positions(hidden_states, ids, padding, 20, round_average)
    assert_bit_identical(pooled, expected, "pooled")
    assert_bit_identical(mask, expected_mask, "mask")


@pytest.mark.parametrize("backend", BACKENDS)
def test_int32_ids_and_strided_hidden(poisoned, backend):
    hidden_states, ids, padding = make_batch([(6, 9), (3, 6)], 3, 6, 48, torch.bfloat16)
    strided = hidden_states.transpose(0, 1).contiguous().transpose(0, 1)
    pooled, mask = fused_vision.pool_by_positions(strided, ids.int(), padding, 6, backend=backend)
    expected, expected_mask = reference.onehot_pool_by_positions(hidden_states, ids, padding, 6)
    assert_bit_identical(mask, expected_mask, "mask")
    assert_close(pooled, expected, atol=2**-7 * 48**0.5, rtol=2**-7)


@pytest.mark.parametrize("items", [1, 2], ids=["one_item", "two_items_interleaved"])
def test_rows_past_2_to_the_31_elements(monkeypatch, items):
    """Rows more than 2**31 elements into the hidden states, whose rows lie 2**20 elements apart (in two
    items, interleaved row by row): a view the launcher must not copy, whose rows the kernel offsets in
    int64 (in int32 it read out of bounds, a segfault under the interpreter). The 4.8 GB buffer is mapped
    lazily: only the last slot's patches are written and read, the rest is padding, which the kernel
    skips. Small integers make every sum exact, so that slot must match the reference pooler run on its
    patches alone, bit for bit. Rows 16 wide keep the interpreter's work to the patches'."""
    k, width, height, hidden = 16, 16, 144, 16  # one slot per 16 rows of 16 patches: 9 slots, 2,304 patches
    seq_len, output_length, row_span = width * height, height // k, 2**20 // items
    buffer = torch.empty((seq_len, items, row_span), dtype=torch.float16, device=DEVICE)
    poison_empty(monkeypatch)
    hidden_states = buffer[..., :hidden].transpose(0, 1)
    assert int32_inner_offsets(hidden_states) is hidden_states  # not copied: its rows are offset in int64
    first_read = seq_len - k * k
    assert first_read * hidden_states.stride(1) >= 2**31
    values = torch.randint(-8, 9, (items, k * k, hidden), dtype=torch.float16, device=DEVICE)
    hidden_states[:, first_read:] = values
    ids = grid_ids(width, height, seq_len).expand(items, -1, -1).to(DEVICE)
    padding = torch.ones(items, seq_len, dtype=torch.bool, device=DEVICE)
    padding[:, first_read:] = False

    pooled, mask = fused_vision.pool_by_positions(hidden_states, ids, padding, output_length, backend="triton")
    last_slot, _ = reference.pool_by_positions(
        values, grid_ids(k, k, k * k).expand(items, -1, -1).to(DEVICE), padding[:, first_read:], 1
    )
    expected = torch.zeros(items, output_length, hidden, device=DEVICE)
    expected[:, -1:] = last_slot
    assert mask.all()
    assert_bit_identical(pooled, expected, "pooled")


@pytest.mark.parametrize("backend", BACKENDS)
def test_padding_rows_at_real_positions(poisoned, backend):
    """A padding flag zeroes its row (NaN there must not leak) yet its slot still counts as filled, as
    in stock's one-hot: here one slot holds only padding and another a mix."""
    hidden_states, ids, padding = make_batch([(6, 9), (9, 3)], 3, 6, 48, torch.float16)
    x, y = ids[0, :, 0], ids[0, :, 1]
    padding[0] |= (x >= 0) & (x < 3) & (y < 3)  # all of slot 0
    padding[0] |= (x == 4) & (y == 7)  # one patch of slot 5
    hidden_states[padding] = float("nan")
    pooled, mask = fused_vision.pool_by_positions(hidden_states, ids, padding, 6, backend=backend)
    expected, expected_mask = reference.onehot_pool_by_positions(hidden_states, ids, padding, 6)
    assert expected_mask[0, 0] and (expected[0, 0] == 0).all()
    assert_bit_identical(mask, expected_mask, "mask")
    assert_close(pooled, expected, atol=2**-10 * 48**0.5, rtol=2**-10)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=dtype_id)
def test_repeated_positions_sum_every_patch(poisoned, backend, dtype):
    """Ids that repeat a position (no processor's grid does) put two patches in one place: the kernel's
    per-place members cannot hold both, so such an item must take the walk over all its patches and
    still sum every one, as stock's one-hot does; the other items keep the place-by-place sum. Small
    integers and k = 2 make every term and sum exact in any order: bit for bit."""
    hidden_states, grid, padding = make_batch([(4, 6), (6, 4), (4, 2)], 2, 6, 40, dtype)
    ids = grid.clone()
    ids[0, 5] = ids[0, 7]  # item 0: a repeat within one slot and a hole in another
    ids[2, 0] = ids[2, 1] = ids[2, 2]  # item 2: three patches in one place, next to the padding
    hidden_states = torch.randint(-8, 9, hidden_states.shape, device=DEVICE).to(dtype)
    pooled, mask = fused_vision.pool_by_positions(hidden_states, ids, padding, 6, backend=backend)
    expected, expected_mask = reference.onehot_pool_by_positions(hidden_states, ids, padding, 6)
    assert_bit_identical(mask, expected_mask, "mask")
    assert_bit_identical(pooled, expected, "pooled")
    # The repeats moved patches: the result is not the grid's.
    on_the_grid, _ = reference.onehot_pool_by_positions(hidden_states, grid, padding, 6)
    assert not torch.equal(pooled[0], on_the_grid[0]) and not torch.equal(pooled[2], on_the_grid[2])
    assert torch.equal(pooled[1], on_the_grid[1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_width_hidden_states_still_give_the_mask(backend):
    hidden_states, ids, padding = make_batch([(6, 9), (3, 3)], 3, 6, 0, torch.bfloat16)
    pooled, mask = fused_vision.pool_by_positions(hidden_states, ids, padding, 6, backend=backend)
    expected, expected_mask = reference.onehot_pool_by_positions(hidden_states, ids, padding, 6)
    assert pooled.shape == expected.shape == (2, 6, 0)
    assert_bit_identical(mask, expected_mask, "mask")


@pytest.mark.skipif(DEVICE.type == "cpu", reason="the interpreter runs programs one by one: only a GPU can vary")
def test_repeated_runs_are_bit_identical():
    hidden_states, ids, padding = make_batch([(12, 9), (9, 6)], 3, 12, 64, torch.bfloat16)
    first = fused_vision.pool_by_positions(hidden_states, ids, padding, 12, backend="triton")
    for _ in range(2):
        again = fused_vision.pool_by_positions(hidden_states, ids, padding, 12, backend="triton")
        assert_bit_identical(again[0], first[0], "pooled")


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_pooling_mirrors_stock(backend):
    """N == L: stock skips the pooling and hands back padding_positions itself as the mask."""
    hidden_states, ids, padding = make_batch([(4, 3), (2, 2)], 1, 12, 16, torch.float32)
    pooled, mask = fused_vision.pool_by_positions(hidden_states, ids, padding, 12, backend=backend)
    expected, expected_mask = reference.onehot_pool_by_positions(hidden_states, ids, padding, 12)
    assert_bit_identical(pooled, expected)
    assert_bit_identical(mask, expected_mask, "mask")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "output_length,pattern",
    [(5, r"Cannot pool 36 patches to 5"), (40, r"Cannot output more soft tokens \(requested 40\)")],
    ids=["not_divisible", "longer_than_input"],
)
def test_lengths_that_do_not_divide(backend, output_length, pattern):
    hidden_states, ids, padding = make_batch([(6, 6)], 3, 4, 16, torch.float32)
    with pytest.raises(ValueError, match=pattern):
        fused_vision.pool_by_positions(hidden_states, ids, padding, output_length, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_positions_beyond_the_slots(checked_ids, backend):
    hidden_states, ids, padding = make_batch([(6, 6)], 3, 4, 16, torch.float32)
    ids[0, 0] = torch.tensor([2, 40])  # a y far below the grid: slot 13 of 4
    with pytest.raises(ValueError, match=r"position_ids: the 3x3 blocks of positions need more than output_length=4"):
        fused_vision.pool_by_positions(hidden_states, ids, padding, 4, backend=backend)


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "unchecked"])
@pytest.mark.parametrize(
    "id_dtype,far_patches",
    [
        # int32: slot 46,341**2 >= 2**31 (slots are numbered in int64)
        (torch.int32, [(2 * 46_341, 2 * 46_341)]),
        # int64: x // k + (max_x + 1) // k * (y // k) = 10**9 + 2**39 * 2**24 wraps negative
        (torch.int64, [(2**40 - 1, 0), (2 * 10**9, 2**25)]),
    ],
    ids=["int32_past_2_to_the_31", "int64_past_2_to_the_63"],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_positions_whose_slot_arithmetic_would_wrap(monkeypatch, backend, id_dtype, far_patches, checked):
    """Far ids must not wrap the slot number into one that looks valid or negative (a negative slot once
    sent the kernel's atomics out of bounds): the check raises, or unchecked the item is NaN and the
    other item untouched."""
    monkeypatch.setenv("FUSED_VISION_CHECK_IDS", "1" if checked else "0")
    hidden_states, ids, padding = make_batch([(4, 4), (4, 4)], 2, 4, 8, torch.float32)
    expected, _ = reference.onehot_pool_by_positions(hidden_states, ids, padding, 4)
    ids = ids.to(id_dtype)
    for patch, position in enumerate(far_patches):
        ids[0, patch] = torch.tensor(position, dtype=id_dtype)
    if checked:
        with pytest.raises(
            ValueError, match=r"position_ids: the 2x2 blocks of positions need more than output_length=4"
        ):
            fused_vision.pool_by_positions(hidden_states, ids, padding, 4, backend=backend)
        return
    pooled, _ = fused_vision.pool_by_positions(hidden_states, ids, padding, 4, backend=backend)
    assert pooled[0].isnan().all()
    assert_close(pooled[1], expected[1], atol=1e-6 * 8**0.5, rtol=1e-6, what="the other item")


@pytest.mark.parametrize(
    "kwargs,error,pattern",
    [
        (dict(padding_positions=None), TypeError, r"padding_positions: expected a \(B, N\) bool tensor"),
        (dict(output_length=0), ValueError, r"output_length: expected a positive int"),
        (dict(hidden_states=torch.zeros(1, 35, 16)), ValueError, r"hidden_states: expected shape \(B, N, D\)"),
        (dict(round_average=1), TypeError, r"round_average: expected a bool, got int"),
    ],
    ids=["no_padding", "zero_length", "hidden_shape", "round_average_int"],
)
def test_bad_input(kwargs, error, pattern):
    hidden_states, ids, padding = make_batch([(6, 6)], 3, 4, 16, torch.float32)
    args = dict(hidden_states=hidden_states, position_ids=ids, padding_positions=padding, output_length=4)
    args.update({k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})
    with pytest.raises(error, match=pattern):
        fused_vision.pool_by_positions(**args)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_unchecked_positions_beyond_the_slots_turn_the_item_nan(monkeypatch, backend):
    """With the synchronising checks off (as during CUDA graph capture), an item whose patches overflow
    the slots is NaN, not short a patch nor an out-of-range scatter; the other items are untouched."""
    monkeypatch.setenv("FUSED_VISION_CHECK_IDS", "0")
    hidden_states, ids, padding = make_batch([(6, 6), (6, 6)], 3, 4, 16, torch.float32)
    expected, _ = reference.onehot_pool_by_positions(hidden_states, ids, padding, 4)
    ids[0, 0] = torch.tensor([2, 40])
    pooled, _ = fused_vision.pool_by_positions(hidden_states, ids, padding, 4, backend=backend)
    assert pooled[0].isnan().all()
    assert_close(pooled[1], expected[1], atol=1e-6 * 16**0.5, rtol=1e-6, what="the other item")


@pytest.mark.parametrize("round_average", [True, False], ids=["rounded_average", "fp32_average"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize(
    "k,output_length,strided_grad",
    [(3, 12, False), (3, 12, True), (2, 30, False), (1, 108, False)],
    ids=["k3", "k3_strided_grad", "k2", "no_pooling"],
)
def test_pool_by_positions_backward(poisoned, backend, dtype, k, output_length, strided_grad, round_average):
    """Stock's one-hot matmul has one nonzero term per patch, so its gradient is a scaled, rounded copy
    of the slot's: the fused one must equal it bit for bit, padding rows (one at a real position) 0, and
    zeros (-0.0 upstream, or a tiny gradient that rounds to it) +0.0, as the matmul's sum makes them."""
    hidden_states, ids, padding = make_batch([(12, 9), (6, 6)], k, output_length, 40, dtype, shuffle=True)
    padding[0, (ids[0] >= 0).all(-1).nonzero()[0]] = True
    grad_out = torch.randn(2, output_length, 40, device=DEVICE)
    if strided_grad:
        grad_out = torch.randn(output_length, 40, 2, device=DEVICE).permute(2, 0, 1)
    grad_out[..., ::7] = -0.0
    grad_out[..., 3::7] = -1e-9  # rounds to -0.0 in fp16

    def fused(h):
        return fused_vision.pool_by_positions(
            h, ids, padding, output_length, round_average=round_average, backend=backend
        )

    def stock(h):
        return reference.onehot_pool_by_positions(h, ids, padding, output_length, round_average)

    _, (actual,) = grads(fused, [hidden_states], grad_out)
    _, (expected,) = grads(stock, [hidden_states], grad_out)
    assert_bit_identical(actual, expected, "grad of hidden_states")


def test_forward_mode_ad_tangent_is_the_pooled_tangent():
    """The pooler is linear: with the hidden states as their own tangent, the tangent is the output (J h = f(h))."""
    hidden_states, pool_ids, pool_padding = make_batch([(6, 6), (3, 6)], 3, 4, 8, torch.float32)
    with fwAD.dual_level(), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        dual = fwAD.make_dual(hidden_states, hidden_states)
        pooled, _ = fused_vision.pool_by_positions(dual, pool_ids, pool_padding, 4)
        assert_bit_identical(fwAD.unpack_dual(pooled).tangent, fwAD.unpack_dual(pooled).primal)


def test_outputs_are_contiguous_when_n_equals_l():
    """N == L with transposed padding and hidden states: the mask, too, is contiguous."""
    hidden_states = torch.randn(16, 2, 8, device=DEVICE).transpose(0, 1)
    pool_ids = torch.stack([grid_ids(4, 4, 16)] * 2).to(DEVICE)
    padding = torch.zeros(16, 2, dtype=torch.bool, device=DEVICE).t()
    for backend in ("triton", "reference"):
        pooled, mask = fused_vision.pool_by_positions(hidden_states, pool_ids, padding, 16, backend=backend)
        assert pooled.is_contiguous() and mask.is_contiguous()
        pool_op = torch.ops.fused_vision.pool_by_positions.default
        torch.library.opcheck(pool_op, (hidden_states, pool_ids, padding, 16, True, backend))
