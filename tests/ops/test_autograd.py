"""Gradients of every fused op against autograd through the stock formulation, torch.library checks,
and torch.compile(fullgraph=True)."""

import contextlib
import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import fused_vision
from fused_vision import _dispatch, reference
from fused_vision.kernels import position_embeddings as position_embeddings_kernels

from conftest import DEVICE, assert_as_accurate_as_stock, assert_bit_identical, assert_close, dtype_id
from op_cases import grid_ids, make_batch, make_ids, make_inputs

BACKENDS = ["triton", "reference"]
GRAD_DTYPES = [torch.float32, torch.bfloat16]
# fp32 gradients agree with stock's to rounding. bf16 ones are sums of many rounded terms, which stock
# and fused order (and, for the table, accumulate: stock's F.embedding backward adds in bf16, fused in
# fp32) differently, so they are judged against float64 instead: no worse than 1.5x stock's relative
# error, or than the bf16 rounding of the result itself.
FP32_TOLERANCE = 1e-5
BF16_ERROR_FLOOR = 2**-8


def grads(fn, inputs, grad_out):
    inputs = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*inputs)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(grad_out.to(out.dtype))
    return out.detach(), [t.grad for t in inputs]


def check_gradients(fused, stock, inputs, grad_out, dtype, names):
    """Every gradient of ``fused`` against ``stock``'s; returns the two outputs."""
    out, actual = grads(fused, inputs, grad_out)
    expected_out, expected = grads(stock, inputs, grad_out)
    if dtype == torch.float32:
        for name, a, e in zip(names, actual, expected):
            assert_close(a, e, atol=FP32_TOLERANCE, rtol=FP32_TOLERANCE, what=f"grad of {name}")
        return out, expected_out
    _, exact = grads(stock, [t.double() for t in inputs], grad_out.double())
    for name, a, e, x in zip(names, actual, expected, exact):
        assert_as_accurate_as_stock(a, e, x, floor=BF16_ERROR_FLOOR, what=f"grad of {name}")
    return out, expected_out


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


def test_reference_formulations_pass_gradcheck():
    """float64 gradcheck of the lookup and embedder formulations the fused backward formulas are compared
    with. (The stock pooler computes in fp32 whatever its input, so it has no float64 form to check.)"""
    ids = make_ids(2, 7, 5, padded_tail=2, half_padded=1)
    table = torch.randn(2, 5, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: reference.position_embeddings(t, ids), (table,))
    pixels = torch.rand(2, 7, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda p, w, t: reference.patch_embed(p, w, t, ids), (pixels, weight, table))


def op_samples():
    table = torch.randn(2, 20, 24, device=DEVICE, requires_grad=True)
    ids = make_ids(2, 11, 20, padded_tail=3).to(DEVICE)
    padding = reference.default_padding_positions(ids)
    residual = torch.randn(2, 11, 24, device=DEVICE, requires_grad=True)
    pixels, weight, ptable, pids = make_inputs(2, 11, 48, 24, 20, torch.float32, torch.float32, 3)
    hidden_states, pool_ids, pool_padding = make_batch([(6, 6), (3, 6)], 3, 4, 24, torch.float32)
    return [
        ("position_embeddings", (table, ids, padding, residual, "auto")),
        ("position_embeddings", (table, ids, padding, None, "reference")),
        (
            "patch_embed",
            (
                pixels.requires_grad_(True),
                weight.requires_grad_(True),
                ptable.requires_grad_(True),
                pids,
                reference.default_padding_positions(pids),
                "auto",
            ),
        ),
        ("pool_by_positions", (hidden_states.requires_grad_(True), pool_ids, pool_padding, 4, True, "auto")),
        ("pool_by_positions", (hidden_states.to(torch.bfloat16), pool_ids, pool_padding, 4, False, "auto")),
        ("position_embeddings_backward", (torch.randn(2, 11, 24), ids, padding, 20, torch.bfloat16, "auto")),
        (
            "pool_by_positions_backward",
            (torch.randn(2, 4, 24), pool_ids, pool_padding, 4, torch.bfloat16, True, "auto"),
        ),
        # gradients that require grad: double backward through the backward ops
        (
            "position_embeddings_backward",
            (torch.randn(2, 11, 24, requires_grad=True), ids, padding, 20, torch.float32, "auto"),
        ),
        (
            "pool_by_positions_backward",
            (torch.randn(2, 4, 24, requires_grad=True), pool_ids, pool_padding, 4, torch.float32, False, "auto"),
        ),
    ]


@pytest.mark.parametrize("name,args", op_samples(), ids=lambda v: v if isinstance(v, str) else "")
def test_opcheck(name, args):
    torch.library.opcheck(getattr(torch.ops.fused_vision, name).default, args)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_forward_and_backward(backend):
    pixels, weight, table, ids = make_inputs(2, 36, 48, 24, 20, torch.float32, torch.float32, 9)
    weight.requires_grad_(True)
    table.requires_grad_(True)
    pool_ids = torch.stack(
        [torch.stack(torch.meshgrid(torch.arange(6), torch.arange(6), indexing="xy"), -1).flatten(0, 1)] * 2
    )
    pool_ids[:, 27:] = -1

    def stem(pixel_values, weight, table):
        padding = reference.default_padding_positions(pool_ids)
        embedded = fused_vision.patch_embed(pixel_values, weight, table, pool_ids, padding)
        embedded = fused_vision.position_embeddings(table, pool_ids, padding, residual=embedded)
        pooled, mask = fused_vision.pool_by_positions(embedded, pool_ids, padding, 4)
        return pooled.sum()

    compiled = torch.compile(stem, fullgraph=True, backend=backend)
    loss = compiled(pixels, weight, table)
    loss.backward()
    compiled_grads = [weight.grad.clone(), table.grad.clone()]
    weight.grad = table.grad = None
    eager_loss = stem(pixels, weight, table)
    eager_loss.backward()
    assert_close(loss, eager_loss, atol=1e-4, rtol=1e-5)
    for name, c, e in zip(["weight", "table"], compiled_grads, [weight.grad, table.grad]):
        assert_close(c, e, atol=1e-4, rtol=1e-5, what=f"compiled grad of {name}")


def full_grids(batch, side):
    """(B, side * side, 2) row-major positions: every patch is a pooled one."""
    return torch.stack([grid_ids(side, side, side * side)] * batch).to(DEVICE)


def test_compile_dynamic_shapes_pooler():
    """With dynamic shapes N and L are symbolic: the pooler traces without a graph break, and a second
    image size runs through the same graph."""

    def pool(hidden_states, ids):
        return fused_vision.pool_by_positions(hidden_states, ids, (ids == -1).all(-1), ids.shape[1] // 9)[0]

    compiled = torch.compile(pool, fullgraph=True, dynamic=True)
    for side in (6, 9):
        ids = full_grids(2, side)
        hidden_states = torch.randn(2, side * side, 16, device=DEVICE)
        expected = reference.pool_by_positions(hidden_states, ids, (ids == -1).all(-1), side * side // 9)[0]
        assert_close(compiled(hidden_states, ids), expected, atol=1e-5, rtol=1e-5, what=f"{side}x{side}")


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_forward_mode_ad_carries_tangents(backend):
    """The kernels and the registered ops carry no tangent: forward-mode AD runs the reference (warned
    once under "auto"), and backend="triton" refuses rather than drop the tangent."""
    table = torch.randn(2, 20, 8, device=DEVICE)
    tangent = torch.randn_like(table)
    ids = make_ids(2, 11, 20, padded_tail=3).to(DEVICE)
    hidden_states, pool_ids, pool_padding = make_batch([(6, 6), (3, 6)], 3, 4, 8, torch.float32)
    _dispatch._WARNED.clear()
    warned = pytest.warns(RuntimeWarning, match="forward-mode AD runs the PyTorch reference")
    with fwAD.dual_level(), warned if backend == "auto" else contextlib.nullcontext():
        out = fused_vision.position_embeddings(fwAD.make_dual(table, tangent), ids, backend=backend)
        assert_bit_identical(fwAD.unpack_dual(out).tangent, reference.position_embeddings(tangent, ids))
        dual = fwAD.make_dual(hidden_states, hidden_states)
        pooled, _ = fused_vision.pool_by_positions(dual, pool_ids, pool_padding, 4, backend=backend)
        assert_bit_identical(fwAD.unpack_dual(pooled).tangent, fwAD.unpack_dual(pooled).primal)  # linear: J h = f(h)
        with pytest.raises(RuntimeError, match=r"backend='triton': fused_vision.position_embeddings has no forward"):
            fused_vision.position_embeddings(fwAD.make_dual(table, tangent), ids, backend="triton")


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_torch_func_transforms_run_the_reference(backend):
    """The registered ops' autograd has no torch.func support (pytorch/pytorch#168393): under grad,
    jacrev and jvp the ops run the reference (warned once under "auto"): torch.func.grad equals the
    gradient that autograd takes through the fused backward, and the Jacobian agrees with both grad and
    jvp; backend="triton" refuses."""
    table = torch.randn(2, 20, 8, device=DEVICE)
    ids = make_ids(2, 11, 20, padded_tail=3).to(DEVICE)
    pixels, weight, ptable, pids = make_inputs(2, 11, 48, 24, 20, torch.float32, torch.float32, 3)
    hidden_states, pool_ids, pool_padding = make_batch([(6, 6), (3, 6)], 3, 4, 8, torch.float32)
    ops = {
        "position_embeddings": (lambda t, b: fused_vision.position_embeddings(t, ids, backend=b), table),
        "patch_embed": (lambda x, b: fused_vision.patch_embed(x, weight, ptable, pids, backend=b), pixels),
        "pool_by_positions": (
            lambda h, b: fused_vision.pool_by_positions(h, pool_ids, pool_padding, 4, backend=b)[0],
            hidden_states,
        ),
    }
    for name, (op, x) in ops.items():
        cotangent = torch.randn_like(op(x, backend))
        _dispatch._WARNED.clear()
        warned = pytest.warns(RuntimeWarning, match=f"{name}: torch.func transforms run the PyTorch reference")
        with warned if backend == "auto" else contextlib.nullcontext():
            grad = torch.func.grad(lambda a: (op(a, backend) * cotangent).sum())(x)
        _, (expected,) = grads(lambda a: op(a, backend), [x], cotangent)
        assert_close(grad, expected, rtol=1e-6, atol=1e-6, what=f"{name}: torch.func.grad")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            jacobian = torch.func.jacrev(lambda a: op(a, backend))(x)
            _, tangent_out = torch.func.jvp(lambda a: op(a, backend), (x,), (cotangent.new_ones(()).expand_as(x),))
        jacobian = jacobian.reshape(cotangent.numel(), x.numel())
        assert_close(jacobian.T @ cotangent.flatten(), grad.flatten(), rtol=1e-5, atol=1e-5, what=f"{name}: jacrev")
        assert_close(jacobian.sum(1), tangent_out.flatten(), rtol=1e-5, atol=1e-5, what=f"{name}: jvp")
        with pytest.raises(RuntimeError, match=f"backend='triton': fused_vision.{name} has no torch.func support"):
            torch.func.grad(lambda a: op(a, "triton").sum())(x)


def _per_sample_cases():
    """Each op as a model calls it on one item (a batch of 1), times a cotangent and summed: the loss, its
    batched arguments, vmap's in_dims (None: shared) and the arguments it is differentiated in (shared
    parameters; the pooler has none, so its item's hidden states). Items are padded differently, and an
    id that is bad in one item."""
    ids = torch.cat([make_ids(1, 11, 20, padded_tail=tail, half_padded=1) for tail in (0, 2, 5)]).to(DEVICE)
    pixels, weight, table, _ = make_inputs(3, 11, 12, 8, 20, torch.float32, torch.float32, 0)
    hidden_states, pool_ids, pool_padding = make_batch([(6, 6), (3, 6), (6, 3)], 3, 4, 8, torch.float32)
    bad_ids, bad_pool_ids = ids.clone(), pool_ids.clone()
    bad_ids[1, 0, 0] = 20  # = P
    bad_pool_ids[1, 0, 1] = 30  # a 3x3 block row past the 4 slots

    def lookup(table, ids, cotangent, backend):
        return (fused_vision.position_embeddings(table, ids[None], backend=backend) * cotangent).sum()

    def embed(weight, table, pixels, ids, cotangent, backend):
        return (fused_vision.patch_embed(pixels[None], weight, table, ids[None], backend=backend) * cotangent).sum()

    def pool(hidden_states, ids, padding, cotangent, backend):
        pooled, _ = fused_vision.pool_by_positions(hidden_states[None], ids[None], padding[None], 4, backend=backend)
        return (pooled * cotangent).sum()

    cotangent, pool_cotangent = torch.randn(3, 11, 8, device=DEVICE), torch.randn(3, 4, 8, device=DEVICE)
    return {
        "position_embeddings": (lookup, (table, ids, cotangent), (None, 0, 0), (0,), (1, bad_ids)),
        "patch_embed": (embed, (weight, table, pixels, ids, cotangent), (None, None, 0, 0, 0), (0, 1), (3, bad_ids)),
        "pool_by_positions": (
            pool,
            (hidden_states, pool_ids, pool_padding, pool_cotangent),
            (0, 0, 0, 0),
            (0,),
            (1, bad_pool_ids),
        ),
    }


def _item_grads(loss, args, in_dims, argnums, item, backend):
    """Autograd through the op (its fused backward) on item ``item`` alone."""
    args = [a[item] if dim == 0 else a for a, dim in zip(args, in_dims)]

    def with_leaves(*leaves):
        return loss(*[leaves[argnums.index(i)] if i in argnums else a for i, a in enumerate(args)], backend)

    return grads(with_leaves, [args[i] for i in argnums], torch.ones(()))[1]


@pytest.mark.filterwarnings("ignore:fused_vision.*torch.func transforms run the PyTorch reference")
@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("op", ["position_embeddings", "patch_embed", "pool_by_positions"])
def test_per_sample_gradients(op, backend):
    """vmap(grad(...)), the per-sample gradients of DP-SGD training, equals autograd through the fused
    backward item by item, and grad(vmap(...)) their sum; the id checks still read every mapped item."""
    loss, args, in_dims, argnums, (bad_arg, bad_ids) = _per_sample_cases()[op]
    per_sample_grads = torch.func.vmap(torch.func.grad(loss, argnums), in_dims=(*in_dims, None))
    per_sample = per_sample_grads(*args, backend)
    for item in range(3):
        expected = _item_grads(loss, args, in_dims, argnums, item, backend)
        for i, actual, wanted in zip(argnums, per_sample, expected):
            assert_close(actual[item], wanted, rtol=FP32_TOLERANCE, atol=FP32_TOLERANCE, what=f"item {item}, arg {i}")

    def batch_loss(*batched):
        return torch.func.vmap(loss, in_dims=(*in_dims, None))(*batched, backend).sum()

    summed = torch.func.grad(batch_loss, argnums)(*args)
    for i, actual, items in zip(argnums, summed, per_sample):
        wanted = items.sum(0) if in_dims[i] is None else items
        assert_close(actual, wanted, rtol=FP32_TOLERANCE, atol=FP32_TOLERANCE, what=f"grad(vmap), arg {i}")
    bad_args = [bad_ids if i == bad_arg else a for i, a in enumerate(args)]
    with pytest.raises(ValueError, match="position_ids: "):
        per_sample_grads(*bad_args, backend)


@pytest.mark.parametrize("tracing_mode", ["real", "fake"])
def test_tracers_see_the_ops(tracing_mode):
    """Under a tracer (a dispatch mode; FakeTensors in fake mode) eager inference calls take the registered
    op, not the shortcut past the dispatcher, so the trace records them; the Triton path stays enabled."""
    from torch.fx.experimental.proxy_tensor import make_fx

    table = torch.randn(2, 20, 8, device=DEVICE)
    ids = make_ids(2, 11, 20, padded_tail=3).to(DEVICE)
    with torch.no_grad():
        graph = make_fx(lambda t, i: fused_vision.position_embeddings(t, i), tracing_mode=tracing_mode)(table, ids)
    assert "fused_vision.position_embeddings" in str(graph.code)
    assert not _dispatch._failed


def _vmap_cases():
    """Each op with one argument batched by vmap, and that argument's stack of 3."""
    table = torch.randn(2, 20, 8, device=DEVICE)
    ids = make_ids(2, 11, 20, padded_tail=3).to(DEVICE)
    stacked_ids = torch.stack([make_ids(2, 11, 20, padded_tail=i) for i in range(3)]).to(DEVICE)
    pixels, weight = torch.rand(2, 11, 12, device=DEVICE), torch.randn(8, 12, device=DEVICE)
    hidden_states = torch.randn(2, 16, 8, device=DEVICE)
    pool_ids = torch.stack([torch.stack([grid_ids(4, 4, 16), grid_ids(w, 4, 16)]) for w in (2, 3, 4)]).to(DEVICE)
    return {
        "lookup_over_table": (
            lambda t: fused_vision.position_embeddings(t, ids),
            torch.randn(3, 2, 20, 8, device=DEVICE),
        ),
        "lookup_over_ids": (lambda i: fused_vision.position_embeddings(table, i), stacked_ids),
        "patch_embed_over_ids": (lambda i: fused_vision.patch_embed(pixels, weight, table, i), stacked_ids),
        "pooler_over_ids": (
            lambda i: fused_vision.pool_by_positions(hidden_states, i, (i == -1).all(-1), 4)[0],
            pool_ids,
        ),
    }


@pytest.mark.filterwarnings("ignore:There is a performance drop")
@pytest.mark.parametrize("case", list(_vmap_cases()))
def test_vmap_takes_the_op_and_leaves_the_kernels_enabled(case):
    """vmap's batched tensors, float or index, cannot reach a kernel: the call takes the registered op
    (PyTorch's per-item fallback), gives each item's eager result, and no kernel failure is recorded."""
    op, stacked = _vmap_cases()[case]
    with torch.no_grad():
        batched = torch.func.vmap(op)(stacked)
        expected = torch.stack([op(item) for item in stacked])
    assert_bit_identical(batched, expected)
    assert not _dispatch._failed


@pytest.mark.parametrize("op", ["position_embeddings", "patch_embed", "pool_by_positions"])
def test_meta_tensors_get_the_shapes_and_dtypes_of_real_ones(op):
    """Meta tensors (shape inference, e.g. a model built on the meta device) take the registered op,
    whose fake gives what the real call returns; no id check or kernel reads their missing data."""
    table, ids = torch.randn(2, 20, 8, dtype=torch.bfloat16), make_ids(2, 16, 20, padded_tail=3)
    args = {
        "position_embeddings": (table, ids),
        "patch_embed": (torch.rand(2, 16, 12), torch.randn(8, 12, dtype=torch.bfloat16), table, ids),
        "pool_by_positions": (
            torch.randn(2, 16, 8, dtype=torch.bfloat16),
            grid_ids(4, 4, 16).expand(2, -1, -1),
            torch.zeros(2, 16, dtype=torch.bool),
            4,
        ),
    }[op]

    def run(device):
        out = getattr(fused_vision, op)(*(a.to(device) if isinstance(a, torch.Tensor) else a for a in args))
        return out if isinstance(out, tuple) else (out,)

    for real, meta in zip(run(DEVICE), run("meta")):
        assert meta.is_meta and (meta.shape, meta.dtype) == (real.shape, real.dtype)
    assert not _dispatch._failed


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_outputs_are_contiguous_whatever_the_inputs_strides(backend):
    """As the ops' fakes say: a transposed residual, or N == L with transposed padding and hidden states."""
    table = torch.randn(2, 20, 8, device=DEVICE)
    ids = make_ids(2, 11, 20, padded_tail=3).to(DEVICE)
    residual = torch.randn(11, 2, 8, device=DEVICE).transpose(0, 1)
    assert fused_vision.position_embeddings(table, ids, residual=residual, backend=backend).is_contiguous()
    hidden_states = torch.randn(16, 2, 8, device=DEVICE).transpose(0, 1)
    pool_ids = full_grids(2, 4)
    padding = torch.zeros(16, 2, dtype=torch.bool, device=DEVICE).t()
    pooled, mask = fused_vision.pool_by_positions(hidden_states, pool_ids, padding, 16, backend=backend)
    assert pooled.is_contiguous() and mask.is_contiguous()
    pool_op = torch.ops.fused_vision.pool_by_positions.default
    torch.library.opcheck(pool_op, (hidden_states, pool_ids, padding, 16, True, backend))


def negated_view(t: torch.Tensor) -> torch.Tensor:
    """A tensor equal to ``t`` whose memory holds ``-t``: the imaginary part of a conjugate (is_neg())."""
    return torch.complex(torch.zeros_like(t), -t).conj().imag


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize(
    "op,argument",
    [
        ("position_embeddings", "table"),
        ("position_embeddings", "residual"),
        ("patch_embed", "pixel_values"),
        ("patch_embed", "weight"),
        ("patch_embed", "table"),
        ("pool_by_positions", "hidden_states"),
    ],
)
def test_lazily_negated_inputs(op, argument, backend):
    """x.conj().imag is a view whose memory holds -x: a kernel reading it raw would flip the sign. Such
    inputs take the registered op, whose dispatcher resolves the negation first."""
    table = torch.randn(2, 20, 8, device=DEVICE)
    ids = make_ids(2, 11, 20, padded_tail=3).to(DEVICE)
    pixels, weight, ptable, pids = make_inputs(2, 11, 12, 8, 20, torch.float32, torch.float32, 3)
    hidden_states, pool_ids, pool_padding = make_batch([(6, 6), (3, 6)], 3, 4, 8, torch.float32)
    calls = {
        "position_embeddings": (
            fused_vision.position_embeddings,
            dict(table=table, position_ids=ids, residual=torch.randn(2, 11, 8, device=DEVICE)),
        ),
        "patch_embed": (
            fused_vision.patch_embed,
            dict(pixel_values=pixels, weight=weight, table=ptable, position_ids=pids),
        ),
        "pool_by_positions": (
            fused_vision.pool_by_positions,
            dict(hidden_states=hidden_states, position_ids=pool_ids, padding_positions=pool_padding, output_length=4),
        ),
    }
    fn, kwargs = calls[op]
    negated = negated_view(kwargs[argument])
    assert negated.is_neg() and torch.equal(negated, kwargs[argument])
    with torch.no_grad():
        expected = fn(**kwargs, backend=backend)
        actual = fn(**{**kwargs, argument: negated}, backend=backend)
    for a, e in zip(*(out if isinstance(out, tuple) else (out,) for out in (actual, expected))):
        assert_bit_identical(a, e, what=f"{op} with a negated {argument}")


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


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_double_backward_matches_autograd_through_the_reference(backend):
    """create_graph=True, then differentiate the gradient in the output gradient: the backward ops'
    own backward (the lookup, the pooler) against autograd through the plain PyTorch reference."""
    table = torch.randn(2, 20, 8, device=DEVICE, requires_grad=True)
    ids = make_ids(2, 11, 20, padded_tail=3).to(DEVICE)
    hidden_states, pool_ids, pool_padding = make_batch([(6, 6), (3, 6)], 3, 4, 8, torch.float32)
    hidden_states.requires_grad_(True)
    cases = [
        ("lookup", table, lambda t: fused_vision.position_embeddings(t, ids, backend=backend),
         lambda t: reference.position_embeddings(t, ids)),
        ("pooler", hidden_states,
         lambda h: fused_vision.pool_by_positions(h, pool_ids, pool_padding, 4, backend=backend)[0],
         lambda h: reference.pool_by_positions(h, pool_ids, pool_padding, 4)[0]),
    ]  # fmt: skip
    for name, leaf, fused, stock in cases:
        upstream = torch.randn_like(stock(leaf)).requires_grad_(True)
        probe = torch.randn_like(leaf)

        def grad_of_grad(forward):
            (grad,) = torch.autograd.grad(forward(leaf), leaf, upstream, create_graph=True)
            return torch.autograd.grad((grad * probe).sum(), upstream)[0]

        assert_close(grad_of_grad(fused), grad_of_grad(stock), atol=1e-5, rtol=1e-5, what=f"{name}: grad of grad")
