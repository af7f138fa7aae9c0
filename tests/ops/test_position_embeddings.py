"""The lookup against the one-hot definition: bit-identical for every backend, dtype and layout (and to
transformers 5.10+'s F.embedding code where the two differ, at -0.0 sums)."""

import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F

import fused_vision
from fused_vision import reference
from fused_vision.kernels import position_embeddings as position_embeddings_kernels
from fused_vision.reference import default_padding_positions, onehot_position_embeddings, position_embeddings_backward

from helpers import DEVICE, FLOAT_DTYPES, assert_bit_identical, assert_close, dtype_id
from op_cases import GRAD_DTYPES, check_gradients, make_ids

BACKENDS = ["triton", "reference"]


def onehot(table, ids, padding=None):
    padding = default_padding_positions(ids) if padding is None else padding
    return onehot_position_embeddings(table, ids.long(), padding)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64], ids=dtype_id)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize(
    "batch,seq_len,num_positions,hidden",
    [(2, 70, 64, 96), (3, 45, 211, 77), (1, 130, 40, 1)],
    ids=lambda v: str(v),
)
def test_matches_onehot(poisoned, backend, id_dtype, dtype, batch, seq_len, num_positions, hidden):
    table = torch.randn(2, num_positions, hidden, device=DEVICE).to(dtype)
    ids = make_ids(batch, seq_len, num_positions, id_dtype=id_dtype, padded_tail=seq_len // 5, half_padded=3)
    ids = ids.to(DEVICE)
    expected = onehot(table, ids)
    actual = fused_vision.position_embeddings(table, ids, backend=backend)
    assert_bit_identical(actual, expected)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_negative_zero_rows_sum_as_the_embedding_code(poisoned, backend, dtype):
    """Where both rows hold -0.0 the lookup gives -0.0 as transformers 5.10+'s two F.embedding do,
    bit for bit, while the one-hot's sum adds the other rows' +0.0 products and gives +0.0 (README)."""
    table = torch.randn(2, 30, 24, device=DEVICE).to(dtype)
    table[0, 3, ::2] = -0.0
    table[1, 5, ::3] = -0.0
    ids = make_ids(2, 40, 30, padded_tail=4).to(DEVICE)
    ids[:, :6] = torch.tensor([3, 5], device=DEVICE)
    padding = default_padding_positions(ids)
    clamped = ids.clamp(min=0)
    embedding_code = F.embedding(clamped[..., 0], table[0]) + F.embedding(clamped[..., 1], table[1])
    embedding_code = torch.where(padding.unsqueeze(-1), 0.0, embedding_code)
    actual = fused_vision.position_embeddings(table, ids, backend=backend)
    assert_bit_identical(actual, embedding_code)
    both_negative_zero = actual[:, :6, ::6]
    assert (both_negative_zero == 0).all() and both_negative_zero.signbit().all()
    assert not onehot(table, ids)[:, :6, ::6].signbit().any()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_residual_rounds_like_stock_add(poisoned, backend, dtype):
    table = torch.randn(2, 50, 72, device=DEVICE).to(dtype)
    ids = make_ids(3, 41, 50, padded_tail=7).to(DEVICE)
    residual = (4 * torch.randn(3, 41, 72, device=DEVICE)).to(dtype)
    expected = residual + onehot(table, ids)
    actual = fused_vision.position_embeddings(table, ids, residual=residual, backend=backend)
    assert_bit_identical(actual, expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_padding_only_and_no_padding_items(poisoned, backend):
    table = torch.randn(2, 30, 40, device=DEVICE, dtype=torch.bfloat16)
    ids = make_ids(3, 25, 30).to(DEVICE)
    ids[1] = -1  # an item that is all padding
    actual = fused_vision.position_embeddings(table, ids, backend=backend)
    assert_bit_identical(actual, onehot(table, ids))
    assert not actual[1].any(), "an all-padding item must be exactly zero"


@pytest.mark.parametrize("backend", BACKENDS)
def test_explicit_padding_overrides_ids(poisoned, backend):
    """padding_positions is the caller's word: rows it marks are zero even with valid ids."""
    table = torch.randn(2, 30, 40, device=DEVICE)
    ids = make_ids(2, 25, 30).to(DEVICE)
    padding = torch.rand(2, 25, device=DEVICE) < 0.3
    actual = fused_vision.position_embeddings(table, ids, padding, backend=backend)
    assert_bit_identical(actual, onehot(table, ids, padding))


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_inputs(poisoned, backend):
    """Non-contiguous ids, padding, residual and table are read through their strides."""
    table = torch.randn(60, 2, 2, 48, device=DEVICE, dtype=torch.float16)[:, :, 1].transpose(0, 1)  # (2, 60, 48)
    ids = make_ids(5, 33, 60, padded_tail=4).to(DEVICE)
    ids_strided = torch.stack([ids[..., 1], ids[..., 0]], dim=-1).flip(-1).transpose(0, 1).contiguous().transpose(0, 1)
    residual = torch.randn(33, 5, 48, device=DEVICE, dtype=torch.float16).transpose(0, 1)
    padding = default_padding_positions(ids).t().contiguous().t()
    assert not (table.is_contiguous() or ids_strided.is_contiguous() or residual.is_contiguous())
    assert not padding.is_contiguous()
    actual = fused_vision.position_embeddings(table, ids_strided, padding, residual=residual, backend=backend)
    assert_bit_identical(actual, residual + onehot(table.contiguous(), ids, padding))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(0, 7), (3, 0)], ids=["no_items", "no_patches"])
def test_empty_batches(backend, shape):
    table = torch.randn(2, 10, 16, device=DEVICE)
    ids = torch.empty(*shape, 2, dtype=torch.int64, device=DEVICE)
    assert fused_vision.position_embeddings(table, ids, backend=backend).shape == (*shape, 16)


@pytest.mark.skipif(DEVICE.type == "cpu", reason="the interpreter runs programs one by one: only a GPU can vary")
def test_repeated_runs_are_identical():
    table = torch.randn(2, 90, 64, device=DEVICE, dtype=torch.bfloat16)
    ids = make_ids(2, 50, 90, padded_tail=5).to(DEVICE)
    first = fused_vision.position_embeddings(table, ids, backend="triton")
    assert_bit_identical(fused_vision.position_embeddings(table, ids, backend="triton"), first)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=dtype_id)
def test_position_embeddings_backward(backend, dtype):
    table = torch.randn(2, 23, 40, device=DEVICE).to(dtype)
    residual = torch.randn(3, 31, 40, device=DEVICE).to(dtype)
    ids = make_ids(3, 31, 23, padded_tail=5, half_padded=2).to(DEVICE)  # few ids: many rows share a table row
    padding = reference.default_padding_positions(ids)
    grad_out = torch.randn(3, 31, 40, device=DEVICE).to(dtype)

    def fused(t, r):
        return fused_vision.position_embeddings(t, ids, residual=r, backend=backend)

    def stock(t, r):
        return r + reference.onehot_position_embeddings(t, ids, padding)

    out, expected_out = check_gradients(fused, stock, [table, residual], grad_out, dtype, ["table", "residual"])
    assert_bit_identical(out, expected_out)


def test_deterministic_algorithms_keep_the_table_gradient_off_the_atomics(monkeypatch):
    """Under torch.use_deterministic_algorithms(True) the table gradient is the reference's deterministic
    scatter, bit for bit, and the atomic kernel is never launched (two runs of the interpreter would
    agree whatever ran, so the launch itself is what is checked)."""
    table = torch.randn(2, 7, 64, device=DEVICE, requires_grad=True)  # 7 ids: heavy collisions
    ids = make_ids(4, 50, 7).to(DEVICE)
    grad_out = torch.randn(4, 50, 64, device=DEVICE)

    def no_atomics(*args):
        raise AssertionError("the atomic table-gradient kernel ran under deterministic algorithms")

    monkeypatch.setattr(position_embeddings_kernels, "position_embeddings_backward", no_atomics)
    torch.use_deterministic_algorithms(True)
    try:
        fused_vision.position_embeddings(table, ids, backend="triton").backward(grad_out)
    finally:
        torch.use_deterministic_algorithms(False)
    expected = reference.position_embeddings_backward(grad_out, ids, reference.default_padding_positions(ids), 7)
    assert_bit_identical(table.grad, expected, "table gradient")


def test_reference_passes_gradcheck():
    """float64 gradcheck of the lookup formulation the fused backward formulas are compared with."""
    ids = make_ids(2, 7, 5, padded_tail=2, half_padded=1)
    table = torch.randn(2, 5, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: reference.position_embeddings(t, ids), (table,))


def test_forward_mode_ad_tangent_is_the_lookup_of_the_tangent():
    """The lookup is linear: its tangent is the lookup of the table's tangent."""
    table = torch.randn(2, 20, 8, device=DEVICE)
    tangent = torch.randn_like(table)
    ids = make_ids(2, 11, 20, padded_tail=3).to(DEVICE)
    with fwAD.dual_level(), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        out = fused_vision.position_embeddings(fwAD.make_dual(table, tangent), ids)
        assert_bit_identical(fwAD.unpack_dual(out).tangent, reference.position_embeddings(tangent, ids))


# ---- bad input: a clear error naming the argument, on every backend ----------------------------------


def good():
    table = torch.randn(2, 20, 8, device=DEVICE)
    ids = torch.randint(0, 20, (2, 5, 2), device=DEVICE)
    return table, ids


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "change,error,pattern",
    [
        (lambda t, i: (t, i.clone().fill_(20)), ValueError, r"position_ids: expected values below 20 .*maximum of 20"),
        (lambda t, i: (t, i.float()), TypeError, r"position_ids: expected dtype in \(int32, int64\)"),
        (lambda t, i: (t, i[..., :1]), ValueError, r"position_ids: expected shape \(B, N, 2\)"),
        (lambda t, i: (t, i[0]), ValueError, r"position_ids: expected 3 dimensions"),
        (lambda t, i: (t[:1], i), ValueError, r"table: expected shape \(2, P, D\)"),
        (lambda t, i: (t[0], i), ValueError, r"table: expected 3 dimensions"),
        (lambda t, i: (t.long(), i), TypeError, r"table: expected dtype in \(float32, float16, bfloat16\)"),
        (lambda t, i: (t.double(), i), TypeError, r"table: expected dtype"),
        (lambda t, i: (t, i.tolist()), TypeError, r"position_ids: expected a torch.Tensor"),
        (lambda t, i: (t[:, :0], i), ValueError, r"table: expected shape \(2, P, D\) with P >= 1, got \(2, 0, 8\)"),
        (
            lambda t, i: (t.to_sparse(), i),
            TypeError,
            r"table: expected a dense \(strided\) tensor, got layout torch.sparse_coo",
        ),
        (lambda t, i: (t, i.to_sparse()), TypeError, r"position_ids: expected a dense \(strided\) tensor"),
    ],
    ids=[
        "id_too_large",
        "float_ids",
        "last_dim_not_2",
        "ids_rank",
        "table_axes",
        "table_rank",
        "integer_table",
        "float64_table",
        "ids_not_tensor",
        "empty_table",
        "sparse_table",
        "sparse_ids",
    ],
)
def test_bad_table_or_ids(checked_ids, backend, change, error, pattern):
    table, ids = change(*good())
    with pytest.raises(error, match=pattern):
        fused_vision.position_embeddings(table, ids, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_negative_ids_read_row_zero_as_stock(poisoned, backend):
    """Stock clamps every negative id to 0 and pads only (-1, -1) rows: ids below -1 are no error, and
    their rows' gradient goes to row 0."""
    table, ids = good()
    ids[0, 1] = torch.tensor([-2, 3])
    ids[1, 4] = torch.tensor([-7, -1])  # not padding: only (-1, -1) is
    ids[1, 0] = -1
    padding = default_padding_positions(ids)
    table.requires_grad_()
    out = fused_vision.position_embeddings(table, ids, backend=backend)
    assert_bit_identical(out, onehot_position_embeddings(table, ids, padding))
    assert (out[0, 1] != 0).all() and (out[1, 4] != 0).all() and (out[1, 0] == 0).all()
    grad = torch.randn_like(out)
    out.backward(grad)
    expected = position_embeddings_backward(grad, ids, padding, table.shape[1])
    assert_close(table.grad, expected, atol=1e-6, rtol=1e-6, what="table gradient")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "kwargs,error,pattern",
    [
        (
            dict(padding_positions=torch.zeros(2, 4, dtype=torch.bool)),
            ValueError,
            r"padding_positions: expected shape \(B, N\)",
        ),
        (dict(padding_positions=torch.zeros(2, 5)), TypeError, r"padding_positions: expected dtype in \(bool\)"),
        (dict(residual=torch.zeros(2, 5, 9)), ValueError, r"residual: expected shape \(B, N, D\)"),
        (
            dict(residual=torch.zeros(2, 5, 8, dtype=torch.float16)),
            TypeError,
            r"residual: expected dtype in \(float32\)",
        ),
    ],
    ids=["padding_shape", "padding_dtype", "residual_shape", "residual_dtype"],
)
def test_bad_padding_or_residual(backend, kwargs, error, pattern):
    table, ids = good()
    kwargs = {k: v.to(DEVICE) for k, v in kwargs.items()}
    with pytest.raises(error, match=pattern):
        fused_vision.position_embeddings(table, ids, backend=backend, **kwargs)


def test_tensors_on_different_devices():
    table, ids = good()
    with pytest.raises(ValueError, match=r"position_ids: expected a tensor on cpu like table, got one on meta"):
        fused_vision.position_embeddings(table.cpu(), ids.to("meta"))


def test_unknown_backend():
    with pytest.raises(ValueError, match=r"backend: expected one of \('auto', 'triton', 'reference'\), got 'cuda'"):
        fused_vision.position_embeddings(*good(), backend="cuda")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("bad_id", [20, 2**40], ids=["P", "huge"])
def test_unchecked_bad_ids_turn_rows_nan_not_faults(poisoned, monkeypatch, bad_id, dtype):
    """With the synchronising range check switched off, the kernels never read outside the table:
    rows with an out-of-range id come out NaN (in bf16 too, whose rounding must keep a NaN), every other
    row is still exact."""
    monkeypatch.setenv("FUSED_VISION_CHECK_IDS", "0")
    table, ids = good()
    table = table.to(dtype)
    ids[1, 2, 1] = bad_id
    residual = torch.randn(2, 5, 8, device=DEVICE, dtype=dtype)
    out = fused_vision.position_embeddings(table, ids, residual=residual, backend="triton")
    assert out[1, 2].isnan().all()
    ids[1, 2] = 0
    expected = residual + onehot_position_embeddings(table, ids, default_padding_positions(ids))
    rows = torch.ones(2, 5, dtype=torch.bool)
    rows[1, 2] = False
    assert_bit_identical(out[rows], expected[rows], "the rows with good ids")
