"""The fused patch embedder against stock's `input_proj(2 * (p - 0.5)) + pe` and a float64 reference."""

import warnings

import pytest
import torch

import fused_vision
from fused_vision import reference

from helpers import DEVICE, FLOAT_DTYPES, assert_as_accurate_as_stock, assert_bit_identical, assert_close, dtype_id
from op_cases import GRAD_DTYPES, assert_matches_stock, check_gradients, make_ids, make_inputs

BACKENDS = ["triton", "reference"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pixel_dtype", [torch.float32, torch.bfloat16], ids=lambda d: "pixels_" + dtype_id(d))
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize(
    "batch,seq_len,features,hidden", [(2, 45, 768, 72), (3, 37, 48, 33)], ids=["K768_D72", "K48_D33"]
)
def test_matches_stock_and_is_as_accurate(poisoned, backend, pixel_dtype, dtype, batch, seq_len, features, hidden):
    pixels, weight, table, ids = make_inputs(batch, seq_len, features, hidden, 50, dtype, pixel_dtype, seq_len // 6)
    actual = fused_vision.patch_embed(pixels, weight, table, ids, backend=backend)
    stock = reference.patch_embed(pixels, weight, table, ids)
    assert actual.dtype == dtype
    assert_matches_stock(actual, pixels, weight, table, ids)

    exact = reference.patch_embed(pixels.double(), weight.double(), table.double(), ids)
    assert_as_accurate_as_stock(actual, stock, exact, floor=1e-12)


@pytest.mark.parametrize("pixel_dtype", FLOAT_DTYPES, ids=lambda d: "pixels_" + dtype_id(d))
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_bit_identical_to_stock_where_the_gemm_is_exact(poisoned, dtype, pixel_dtype):
    """Pixels on a 2**-6 grid and weights of 4 significant bits: every product and partial sum of the
    K = 48 terms is exact in fp32, so any summation order gives stock's accumulator, and the roundings
    after it (to the weight dtype, then of the sum with the position rows) must match stock's bit for bit."""
    generator = torch.Generator().manual_seed(7)
    pixels = (torch.randint(0, 64, (3, 37, 48), generator=generator) / 64).to(DEVICE, pixel_dtype)
    weight = (torch.randint(-16, 16, (33, 48), generator=generator) / 16).to(DEVICE, dtype)
    table = torch.randn(2, 50, 33, generator=generator).to(DEVICE, dtype)
    ids = make_ids(3, 37, 50, padded_tail=6, half_padded=2, generator=generator).to(DEVICE)
    actual = fused_vision.patch_embed(pixels, weight, table, ids, backend="triton")
    assert_bit_identical(actual, reference.patch_embed(pixels, weight, table, ids))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_fp16_pixels_whose_prescale_overflows(poisoned, dtype):
    """fp16 pixels are prescaled in fp16, as stock does: 2 * (32767 - 0.5) rounds to 65536 and 40000 goes
    past fp16's range, so those rows are +-inf whatever the weight dtype, not their fp32 values. Positive
    weights of 4 bits keep every sum exact and inf - inf out, so the whole output compares bit for bit.
    K = 130 puts the infinities in the first K block of several, whose sums must stay infinite."""
    generator = torch.Generator().manual_seed(3)
    pixels = torch.randint(0, 64, (2, 9, 130), generator=generator) / 64
    pixels[0, 1, 5], pixels[0, 4, 0], pixels[1, 2, 31] = 32767.0, 40000.0, -40000.0
    pixels = pixels.to(DEVICE, torch.float16)
    weight = (torch.randint(1, 17, (33, 130), generator=generator) / 16).to(DEVICE, dtype)
    table = torch.randn(2, 50, 33, generator=generator).to(DEVICE, dtype)
    ids = make_ids(2, 9, 50, padded_tail=2, generator=generator).to(DEVICE)
    expected = reference.patch_embed(pixels, weight, table, ids)
    assert expected[0, 1].isposinf().all() and expected[1, 2].isneginf().all()
    assert_bit_identical(fused_vision.patch_embed(pixels, weight, table, ids, backend="triton"), expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_explicit_padding_overrides_ids(poisoned, backend):
    """A padding mask that is not the ids' (-1, -1): its rows get no position embedding, the others do."""
    pixels, weight, table, ids = make_inputs(2, 30, 48, 40, 30, torch.float32, torch.float32, 0)
    padding = torch.rand(2, 30, device=DEVICE) < 0.3
    actual = fused_vision.patch_embed(pixels, weight, table, ids, padding, backend=backend)
    projection = torch.nn.functional.linear(2 * (pixels - 0.5), weight)
    expected = projection + reference.onehot_position_embeddings(table, ids, padding)
    assert_close(actual, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_padding_rows_hold_the_projection_of_their_pixels(poisoned, backend):
    pixels, weight, table, ids = make_inputs(2, 20, 48, 40, 30, torch.float32, torch.float32, 6)
    actual = fused_vision.patch_embed(pixels, weight, table, ids, backend=backend)
    expected = torch.nn.functional.linear(2 * (pixels[:, -6:] - 0.5), weight)
    assert_close(actual[:, -6:], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_pixels_and_int32_ids(poisoned, backend):
    pixels, weight, table, ids = make_inputs(3, 21, 48, 40, 30, torch.float16, torch.float32, 4)
    pixels_t = pixels.transpose(0, 1).contiguous().transpose(0, 1)
    weight_t = weight.t().contiguous().t()
    assert not (pixels_t.is_contiguous() or weight_t.is_contiguous())
    actual = fused_vision.patch_embed(pixels_t, weight_t, table, ids.int(), backend=backend)
    assert_matches_stock(actual, pixels, weight, table, ids)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch(backend):
    pixels, weight, table, ids = make_inputs(1, 8, 48, 16, 10, torch.float32, torch.float32, 0)
    out = fused_vision.patch_embed(pixels[:0], weight, table, ids[:0], backend=backend)
    assert out.shape == (0, 8, 16)


@pytest.mark.parametrize(
    "change,error,pattern",
    [
        (
            dict(weight=lambda w: w[:, :40]),
            ValueError,
            r"weight: expected shape \(D, K\) with K = pixel_values.shape\[2\] = 48, got \(16, 40\)",
        ),
        (dict(pixel_values=lambda p: p[:1]), ValueError, r"pixel_values: expected shape \(B, N, K\) like position_ids"),
        (dict(table=lambda t: t[..., :8]), ValueError, r"table: expected shape \(2, P, D\) with D = weight.shape\[0\]"),
        (dict(table=lambda t: t.half()), TypeError, r"table: expected dtype in \(float32\)"),
        (dict(pixel_values=lambda p: p.long()), TypeError, r"pixel_values: expected dtype"),
        (dict(position_ids=lambda i: i + 30), ValueError, r"position_ids: expected values below 30"),
    ],
    ids=["features", "pixel_items", "hidden", "table_dtype", "integer_pixels", "ids_range"],
)
@pytest.mark.parametrize("backend", ["auto", *BACKENDS])
def test_bad_input(checked_ids, change, error, pattern, backend):
    """Every backend raises; under "auto" the id check, made after the kernel's launch, is an input error
    and not a kernel failure: no fallback warning, and the op keeps its kernel."""
    pixels, weight, table, ids = make_inputs(2, 8, 48, 16, 30, torch.float32, torch.float32, 0)
    args = dict(pixel_values=pixels, weight=weight, table=table, position_ids=ids)
    for name, fn in change.items():
        args[name] = fn(args[name])
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the fallback's warning, not a dependency's
        with pytest.raises(error, match=pattern):
            fused_vision.patch_embed(**args, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=dtype_id)
def test_patch_embed_backward(backend, dtype):
    pixels, weight, table, ids = make_inputs(2, 29, 48, 40, 30, dtype, torch.float32, 5)
    grad_out = torch.randn(2, 29, 40, device=DEVICE).to(dtype)

    def fused(p, w, t):
        return fused_vision.patch_embed(p, w, t, ids, backend=backend)

    def stock(p, w, t):
        return reference.patch_embed(p, w, t, ids)

    check_gradients(fused, stock, [pixels, weight, table], grad_out, dtype, ["pixel_values", "weight", "table"])


def test_patch_embed_skips_the_pixel_gradient_unless_asked():
    pixels, weight, table, ids = make_inputs(2, 9, 48, 16, 30, torch.float32, torch.float32, 2)
    weight.requires_grad_(True)
    fused_vision.patch_embed(pixels, weight, table, ids).sum().backward()
    assert pixels.grad is None and table.grad is None and weight.grad is not None


@pytest.mark.parametrize("trainable", ["table", "weight", "pixel_values"])
def test_patch_embed_keeps_only_what_the_requested_gradients_read(trainable):
    """The pixels, as large as the output, are kept only for the weight's gradient; the weight only for
    the pixels'."""
    pixels, weight, table, ids = make_inputs(2, 9, 48, 16, 30, torch.bfloat16, torch.float32, 2)
    inputs = {"pixel_values": pixels, "weight": weight, "table": table}
    inputs[trainable].requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fused_vision.patch_embed(pixels, weight, table, ids)
    kept = {name for name, t in inputs.items() if any(s.data_ptr() == t.data_ptr() for s in saved)}
    assert kept == {"weight": {"pixel_values"}, "pixel_values": {"weight"}, "table": set()}[trainable]
    out.backward(torch.randn_like(out))
    assert inputs[trainable].grad is not None


def test_patch_embed_ignores_autocast_on_every_backend():
    """The op projects in the weight's dtype: under autocast the reference must not recast its linear, or
    the result would depend on the backend."""
    pixels, weight, table, ids = make_inputs(2, 9, 48, 16, 20, torch.float32, torch.float32, 2)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        outs = [fused_vision.patch_embed(pixels, weight, table, ids, backend=b) for b in ("triton", "reference")]
    assert outs[0].dtype == outs[1].dtype == torch.float32
    for backend, out in zip(("triton", "reference"), outs):
        expected = fused_vision.patch_embed(pixels, weight, table, ids, backend=backend)
        assert_bit_identical(out, expected, f"{backend} under autocast")


def test_reference_passes_gradcheck():
    """float64 gradcheck of the embedder formulation the fused backward formulas are compared with. (The
    stock pooler computes in fp32 whatever its input, so it has no float64 form to check.)"""
    ids = make_ids(2, 7, 5, padded_tail=2, half_padded=1)
    table = torch.randn(2, 5, 3, dtype=torch.float64, requires_grad=True)
    pixels = torch.rand(2, 7, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda p, w, t: reference.patch_embed(p, w, t, ids), (pixels, weight, table))
