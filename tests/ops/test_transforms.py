"""Every registered op under PyTorch's function transforms: vmap, forward-mode AD, torch.func's grad and
jacobians, per-sample gradients, parametrized over one table of the ops (op_cases.py)."""

import contextlib
import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import fused_vision
from fused_vision import _dispatch

from helpers import DEVICE, assert_bit_identical, assert_close
from op_cases import (
    CASES,
    FORWARD_OPS,
    FP32_TOLERANCE,
    grads,
    make_batch,
    make_ids,
    make_inputs,
    outputs,
)

# The inputs vmap batches, together: ids with their padding mask.
VMAPPED = [
    ("position_embeddings", ("table",)),
    ("position_embeddings", ("position_ids", "padding_positions")),
    ("patch_embed", ("pixel_values",)),
    ("patch_embed", ("position_ids", "padding_positions")),
    ("pool_by_positions", ("hidden_states",)),
    ("pool_by_positions", ("position_ids", "padding_positions")),
    ("qkv_norm_rope", ("qkv",)),
    ("qkv_norm_rope", ("position_ids",)),
    ("residual_rms_norm", ("x", "residual")),
    ("gelu_gate", ("gate_up",)),
]


@pytest.mark.filterwarnings("ignore:There is a performance drop")
@pytest.mark.parametrize("op,batched", VMAPPED, ids=[f"{op}-over_{names[0]}" for op, names in VMAPPED])
def test_vmap_takes_the_op_and_leaves_the_kernels_enabled(op, batched):
    """vmap's batched tensors, float or index, cannot reach a kernel: the call takes the registered op
    (PyTorch's per-item fallback), gives each item's eager result, and no kernel failure is recorded."""
    case = CASES[op]
    inputs, items = case.inputs(), [case.inputs() for _ in range(3)]

    def call(*values):
        return case.call({**inputs, **dict(zip(batched, values))}, "auto")

    stacked = [torch.stack([item[name] for item in items]) for name in batched]
    with torch.no_grad():
        actual = torch.func.vmap(call)(*stacked)
        expected = [torch.stack(outs) for outs in zip(*(call(*(item[name] for name in batched)) for item in items))]
    for a, e in zip(actual, expected, strict=True):
        assert_bit_identical(a, e)
    assert not _dispatch._failed


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("case", FORWARD_OPS, ids=str)
def test_forward_mode_ad_carries_tangents(case, backend):
    """The kernels and the registered ops carry no tangent: forward-mode AD runs the reference (warned
    once under "auto"), whose tangents these are bit for bit, and backend="triton" refuses rather than
    drop the tangent."""
    inputs = case.inputs()
    tangents = {name: torch.randn_like(inputs[name]) for name in case.differentiable}
    _dispatch._WARNED.clear()
    warned = pytest.warns(RuntimeWarning, match="forward-mode AD runs the PyTorch reference")
    with fwAD.dual_level():
        duals = {**inputs, **{name: fwAD.make_dual(inputs[name], t) for name, t in tangents.items()}}
        with warned if backend == "auto" else contextlib.nullcontext():
            actual = case.call(duals, backend)
        expected = outputs(case.reference(**duals))
        for a, e in zip(actual, expected, strict=True):
            assert_bit_identical(fwAD.unpack_dual(a).tangent, fwAD.unpack_dual(e).tangent, "tangent")
        with pytest.raises(RuntimeError, match=rf"backend='triton': fused_vision.{case.op} has no forward-mode AD"):
            case.call(duals, "triton")


def _flat(outs):
    return torch.cat([out.flatten() for out in outs])


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("case", FORWARD_OPS, ids=str)
def test_torch_func_transforms_run_the_reference(case, backend):
    """The registered ops' autograd has no torch.func support (pytorch/pytorch#168393): under grad,
    jacrev and jvp the ops run the reference (warned once under "auto"): torch.func.grad in the first
    differentiable input equals the gradient autograd takes through the op's registered backward, and
    the Jacobian agrees with both grad and jvp; backend="triton" refuses."""
    inputs = case.inputs()
    name = case.differentiable[0]
    x = inputs[name]

    def op(a, backend):
        return _flat(case.call({**inputs, name: a}, backend))

    cotangent = torch.randn_like(op(x, backend))
    _dispatch._WARNED.clear()
    warned = pytest.warns(RuntimeWarning, match=f"{case.op}: torch.func transforms run the PyTorch reference")
    with warned if backend == "auto" else contextlib.nullcontext():
        grad = torch.func.grad(lambda a: (op(a, backend) * cotangent).sum())(x)
    leaf = x.detach().clone().requires_grad_(True)
    (expected,) = torch.autograd.grad(op(leaf, backend), leaf, cotangent)
    assert_close(grad, expected, rtol=1e-6, atol=1e-6, what=f"{case.op}: torch.func.grad")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        jacobian = torch.func.jacrev(lambda a: op(a, backend))(x)
        _, tangent_out = torch.func.jvp(lambda a: op(a, backend), (x,), (x.new_ones(()).expand_as(x),))
    jacobian = jacobian.reshape(cotangent.numel(), x.numel())
    assert_close(jacobian.T @ cotangent, grad.flatten(), rtol=1e-5, atol=1e-5, what=f"{case.op}: jacrev")
    assert_close(jacobian.sum(1), tangent_out, rtol=1e-5, atol=1e-5, what=f"{case.op}: jvp")
    with pytest.raises(RuntimeError, match=f"backend='triton': fused_vision.{case.op} has no torch.func support"):
        torch.func.grad(lambda a: op(a, "triton").sum())(x)


def _per_sample_cases():
    """Each op as a model calls it on one item (a batch of 1), times a cotangent and summed: the loss, its
    batched arguments, vmap's in_dims (None: shared) and the arguments it is differentiated in (shared
    parameters; the pooler and the MLP activation have none, so their item's input). Items are padded
    differently, and an id that is bad in one item (None: the op reads no id's value)."""
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

    layers = {op: [CASES[op].inputs() for _ in range(3)] for op in ("qkv_norm_rope", "residual_rms_norm", "gelu_gate")}
    qkv, norm, gelu = ({k: v if k not in stacked else torch.stack([i[k] for i in items]) for k, v in items[0].items()}
                       for items, stacked in [(layers["qkv_norm_rope"], ("qkv", "position_ids")),
                                              (layers["residual_rms_norm"], ("x", "residual")),
                                              (layers["gelu_gate"], ("gate_up",))])  # fmt: skip

    def attend(q_weight, k_weight, inv_freq, qkv_item, ids, cotangent, backend):
        outs = fused_vision.qkv_norm_rope(qkv_item, ids, q_weight, k_weight, inv_freq, 2, 1, clamps=qkv["clamps"],
                                          backend=backend)  # fmt: skip
        return (torch.cat([out.flatten() for out in outs]) * cotangent).sum()

    def add_and_norm(post_weight, next_weight, x, residual, cotangent, backend):
        h, y = fused_vision.residual_rms_norm(x[None], residual[None], post_weight, next_weight, backend=backend)
        return (torch.cat([h, y]) * cotangent).sum()

    def activate(gate_up, cotangent, backend):
        return (fused_vision.gelu_gate(gate_up[None], gelu["clamps"], backend=backend) * cotangent).sum()

    gemm = CASES["gate_up_gelu"].inputs()
    ys = torch.stack([CASES["gate_up_gelu"].inputs()["y"] for _ in range(3)])

    def project(weight, y, cotangent, backend):
        return (fused_vision.gate_up_gelu(y, weight, gemm["clamps"], backend=backend) * cotangent).sum()

    cotangent, pool_cotangent = torch.randn(3, 11, 8, device=DEVICE), torch.randn(3, 4, 8, device=DEVICE)
    qkv_args = (qkv["q_weight"], qkv["k_weight"], qkv["inv_freq"], qkv["qkv"], qkv["position_ids"])
    norm_args = (norm["post_weight"], norm["next_weight"], norm["x"], norm["residual"])
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
        "qkv_norm_rope": (attend, (*qkv_args, torch.randn(3, qkv["qkv"][0].numel(), device=DEVICE)),
                          (None, None, None, 0, 0, 0), (0, 1, 2, 3), None),
        "residual_rms_norm": (add_and_norm, (*norm_args, torch.randn(3, 2, 5, 16, device=DEVICE)),
                              (None, None, 0, 0, 0), (0, 1), None),
        "gelu_gate": (activate, (gelu["gate_up"], torch.randn(3, 1, 6, 16, device=DEVICE)), (0, 0), (0,), None),
        "gate_up_gelu": (project, (gemm["weight"], ys, torch.randn(3, 2, 6, 20, device=DEVICE)), (None, 0, 0), (0, 1),
                         None),
    }  # fmt: skip


def _item_grads(loss, args, in_dims, argnums, item, backend):
    """Autograd through the op (its fused backward) on item ``item`` alone."""
    args = [a[item] if dim == 0 else a for a, dim in zip(args, in_dims)]

    def with_leaves(*leaves):
        return loss(*[leaves[argnums.index(i)] if i in argnums else a for i, a in enumerate(args)], backend)

    return grads(with_leaves, [args[i] for i in argnums], torch.ones(()))[1]


@pytest.mark.filterwarnings("ignore:fused_vision.*torch.func transforms run the PyTorch reference")
@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("op", [case.op for case in FORWARD_OPS])
def test_per_sample_gradients(checked_ids, op, backend):
    """vmap(grad(...)), the per-sample gradients of DP-SGD training, equals autograd through the fused
    backward item by item, and grad(vmap(...)) their sum; the id checks still read every mapped item."""
    loss, args, in_dims, argnums, bad = _per_sample_cases()[op]
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
        # A shared argument's gradient sums the items' in another order: within fp32 of the largest of them.
        atol = FP32_TOLERANCE * max(1.0, items.abs().max().item()) if in_dims[i] is None else FP32_TOLERANCE
        assert_close(actual, wanted, rtol=FP32_TOLERANCE, atol=atol, what=f"grad(vmap), arg {i}")
    if bad is not None:
        bad_arg, bad_ids = bad
        bad_args = [bad_ids if i == bad_arg else a for i, a in enumerate(args)]
        with pytest.raises(ValueError, match="position_ids: "):
            per_sample_grads(*bad_args, backend)
