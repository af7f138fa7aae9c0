"""The ops against their references at real Gemma 4 shapes, and at sizes past 2**31 elements (int64 offsets)."""

from functools import partial
from types import SimpleNamespace

import pytest
import torch

import fused_vision
from fused_vision import reference

from .conftest import SIZES, P, image_ids
from helpers import (
    DEVICE,
    FLOAT_DTYPES,
    assert_as_accurate_as_stock,
    assert_bit_identical,
    assert_close,
    dtype_id,
    relative_error,
)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_position_embeddings_bit_identical_to_onehot(dtype):
    ids = image_ids(SIZES.batch, SIZES.soft_tokens)
    table = torch.randn(2, P, SIZES.hidden, device=DEVICE).to(dtype)
    residual = torch.randn(*ids.shape[:2], SIZES.hidden, device=DEVICE).to(dtype)
    expected = reference.onehot_position_embeddings(table, ids, reference.default_padding_positions(ids))
    assert_bit_identical(fused_vision.position_embeddings(table, ids, backend="triton"), expected)
    with_residual = fused_vision.position_embeddings(table, ids, residual=residual, backend="triton")
    assert_bit_identical(with_residual, residual + expected, "with a residual")


def test_position_embeddings_output_over_2_31_elements():
    batch, seq_len, hidden = SIZES.big
    ids = torch.randint(0, 3360, (batch, seq_len, 2), device=DEVICE)
    ids[:, -500:] = -1
    table = torch.randn(2, P, hidden, device=DEVICE, dtype=torch.bfloat16)
    actual = fused_vision.position_embeddings(table, ids, backend="triton")
    assert actual.numel() > 2**31 or not SIZES.past_2_31
    for chunk in range(0, batch, 38):  # the reference in pieces, to keep its temporaries small
        expected = reference.position_embeddings(table, ids[chunk : chunk + 38])
        assert_bit_identical(actual[chunk : chunk + 38], expected, f"items {chunk} to {chunk + 37}")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_patch_embed_as_accurate_as_stock_against_float64(record_property, dtype):
    ids = image_ids(SIZES.batch, SIZES.soft_tokens)
    pixels = torch.rand(*ids.shape[:2], SIZES.features, device=DEVICE)
    pixels[(ids == -1).all(-1)] = 0.0
    weight = (torch.randn(SIZES.hidden, SIZES.features, device=DEVICE) / SIZES.features**0.5).to(dtype)
    table = torch.randn(2, P, SIZES.hidden, device=DEVICE).to(dtype)
    exact = reference.patch_embed(pixels.double(), weight.double(), table.double(), ids)
    fused = fused_vision.patch_embed(pixels, weight, table, ids, backend="triton")
    stock = reference.patch_embed(pixels, weight, table, ids)
    record_property("fused_error", relative_error(fused, exact))
    record_property("stock_error", relative_error(stock, exact))
    assert_as_accurate_as_stock(fused, stock, exact, slack=1.5)


# transformers' averages, rounded to the hidden dtype, and SGLang EmbeddingGemma2's in fp32
@pytest.mark.parametrize("round_average", [True, False], ids=["rounded_average", "fp32_average"])
def test_pool_by_positions_matches_onehot_and_repeats_bit_for_bit(record_property, round_average):
    ids = image_ids(SIZES.batch, SIZES.soft_tokens)
    padding = reference.default_padding_positions(ids)
    hidden_states = torch.randn(*ids.shape[:2], SIZES.hidden, device=DEVICE, dtype=torch.bfloat16)
    pool = partial(fused_vision.pool_by_positions, round_average=round_average, backend="triton")
    pooled, mask = pool(hidden_states, ids, padding, SIZES.soft_tokens)
    again, _ = pool(hidden_states, ids, padding, SIZES.soft_tokens)
    expected, expected_mask = reference.onehot_pool_by_positions(
        hidden_states, ids, padding, SIZES.soft_tokens, round_average
    )
    record_property("max_abs_diff", float((pooled - expected).abs().max()))
    assert_close(pooled, expected, atol=2**-7 * SIZES.hidden**0.5, rtol=2**-7)
    assert_bit_identical(mask, expected_mask, "mask")
    assert_bit_identical(again, pooled, "a second call")


def test_pool_by_positions_backward_bit_identical_to_onehot():
    ids = image_ids(SIZES.batch, SIZES.soft_tokens)
    padding = reference.default_padding_positions(ids)
    hidden_states = torch.randn(*ids.shape[:2], SIZES.hidden, device=DEVICE, dtype=torch.bfloat16)
    grad_pooled = torch.randn(SIZES.batch, SIZES.soft_tokens, SIZES.hidden, device=DEVICE)
    grad_pooled[..., ::7] = -0.0  # stock's matmul turns a zero +0.0, and so must the kernel
    grads = []
    for pool in (partial(fused_vision.pool_by_positions, backend="triton"), reference.onehot_pool_by_positions):
        leaf = hidden_states.detach().requires_grad_(True)
        pool(leaf, ids, padding, SIZES.soft_tokens)[0].backward(grad_pooled)
        grads.append(leaf.grad)
    assert_bit_identical(*grads, "hidden states' gradient")


def test_position_embeddings_backward_matches_the_deterministic_reference(record_property):
    ids = image_ids(SIZES.batch, SIZES.soft_tokens)
    table = torch.randn(2, P, SIZES.hidden, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    grad_out = torch.randn(*ids.shape[:2], SIZES.hidden, device=DEVICE, dtype=torch.bfloat16)
    fused_vision.position_embeddings(table, ids, backend="triton").backward(grad_out)
    expected = reference.position_embeddings_backward(grad_out, ids, reference.default_padding_positions(ids), P)
    error = float((table.grad.float() - expected.bfloat16().float()).abs().max() / expected.abs().max())
    record_property("max_rel_diff", error)
    assert error < 2**-7, f"table gradient: max difference {error:.3g} of the largest element"


@pytest.fixture
def item_past_2_31():
    """One item whose rows lie past 2**31 elements (int64 row offsets): the hidden states' N * D = 8.6e9 and
    the pooled gradient's L * D = 2.15e9. The image is two patches wide (k = 2: one slot per row of slots)
    and only its last slots' patches are real; neither kernel reads padding, so the expected values come
    from the reference on those patches alone, and integer values keep every sum exact."""
    output_length, hidden = SIZES.pool_big
    k, real_slots = 2, min(64, output_length // 2)
    seq_len, first_real = k * k * output_length, k * k * (output_length - real_slots)
    assert seq_len * hidden >= 2**31 and output_length * hidden >= 2**31 or not SIZES.past_2_31
    ys, xs = torch.meshgrid(torch.arange(k * output_length), torch.arange(k), indexing="ij")
    ids = torch.stack([xs.flatten(), ys.flatten()], dim=-1)[None].to(DEVICE)
    padding = torch.ones(1, seq_len, dtype=torch.bool, device=DEVICE)
    padding[:, first_real:] = False
    hidden_states = torch.empty(1, seq_len, hidden, device=DEVICE, dtype=torch.bfloat16)  # 17 GB; the tail is read
    hidden_states[:, first_real:] = torch.randint(-8, 9, (1, seq_len - first_real, hidden), device=DEVICE).bfloat16()
    return SimpleNamespace(
        hidden_states=hidden_states,
        ids=ids,
        padding=padding,
        output_length=output_length,
        real=slice(first_real, None),
        real_slots=real_slots,
        real_ids=ids[:, first_real:] - torch.tensor([0, k * (output_length - real_slots)], device=DEVICE),
    )


def test_pool_by_positions_rows_past_2_31_elements(item_past_2_31):
    item = item_past_2_31
    pooled, mask = fused_vision.pool_by_positions(
        item.hidden_states, item.ids, item.padding, item.output_length, backend="triton"
    )
    real_states, real_padding = item.hidden_states[:, item.real], item.padding[:, item.real]
    expected, _ = reference.pool_by_positions(real_states, item.real_ids, real_padding, item.real_slots)
    assert mask.all()
    assert (pooled[:, : -item.real_slots] == 0).all(), "the slots of padding alone"
    assert_bit_identical(pooled[:, -item.real_slots :], expected, "the slots of real patches")


def test_pool_by_positions_backward_slots_past_2_31_elements(item_past_2_31):
    item = item_past_2_31
    hidden_states = item.hidden_states.requires_grad_(True)
    pooled, _ = fused_vision.pool_by_positions(
        hidden_states, item.ids, item.padding, item.output_length, backend="triton"
    )
    grad_pooled = torch.randn(*pooled.shape, device=DEVICE)
    pooled.backward(grad_pooled)
    del pooled
    real_grad_pooled, real_padding = grad_pooled[:, -item.real_slots :], item.padding[:, item.real]
    expected = reference.pool_by_positions_backward(
        real_grad_pooled, item.real_ids, real_padding, item.real_slots, torch.bfloat16
    )
    assert (hidden_states.grad[:, : item.real.start] == 0).all(), "the padding's gradient"
    assert_bit_identical(hidden_states.grad[:, item.real], expected, "the real patches' gradient")
