"""Every registered op under torch.library's checks: opcheck, torch.compile (fullgraph, dynamic shapes),
tracers, meta tensors, strides, lazily negated inputs and double backward, parametrized over one table of
the ops. PyTorch's function transforms: test_transforms.py."""

import pytest
import torch

import fused_vision
from fused_vision import _dispatch, reference

from helpers import assert_bit_identical, assert_close, dtype_id
from op_cases import (
    CASES,
    FORWARD_OPS,
    OPS,
    differentiable_inputs,
    make_inputs,
    outputs,
)

# Beyond each op's defaults: (op, what differs, the change, backend, whether the differentiable inputs require grad).
OPCHECK_VARIANTS = [
    ("position_embeddings", "no_residual", dict(residual=None), "reference", True),
    ("pool_by_positions", "bf16_fp32_average", dict(dtype=torch.bfloat16, round_average=False), "auto", True),
    ("qkv_norm_rope", "unclipped", dict(clamps=None), "triton", True),
    ("residual_rms_norm", "last_layer", dict(next_weight=None), "triton", True),
    ("gelu_gate", "unclipped", dict(clamps=None), "triton", True),
    ("position_embeddings_backward", "bf16", dict(dtype=torch.bfloat16), "auto", False),
    ("pool_by_positions_backward", "bf16", dict(dtype=torch.bfloat16), "auto", False),
    ("pool_by_positions_backward", "fp32_average", dict(round_average=False), "auto", True),
]
OPCHECK_SAMPLES = [
    pytest.param(case.op, {}, backend, True, id=f"{case.op}-{backend}")
    for case in OPS
    for backend in ("auto", "triton")
] + [
    pytest.param(op, change, backend, grad, id=f"{op}-{what}-{backend}")
    for op, what, change, backend, grad in OPCHECK_VARIANTS
]
# Each forward op with its defaults and its variants.
FORWARD_SAMPLES = [pytest.param(case.op, {}, id=case.op) for case in FORWARD_OPS] + [
    pytest.param(op, change, id=f"{op}-{what}")
    for op, what, change, _, _ in OPCHECK_VARIANTS
    if CASES[op].reference is not None
]


@pytest.mark.parametrize("op,change,backend,requires_grad", OPCHECK_SAMPLES)
def test_opcheck(op, change, backend, requires_grad):
    """torch.library's schema, fake, autograd registration and AOT dispatch checks; with gradients that
    require grad, the backward ops' own backward (double backward) too."""
    case = CASES[op]
    change = dict(change)
    dtype = change.pop("dtype", torch.float32)
    inputs = differentiable_inputs(case, dtype=dtype) if requires_grad else case.inputs(dtype=dtype)
    inputs.update(change)
    torch.library.opcheck(getattr(torch.ops.fused_vision, op).default, case.op_args(inputs, backend))


@pytest.mark.parametrize("op,change", FORWARD_SAMPLES)
def test_compile_fullgraph_forward_and_backward(op, change):
    """torch.compile(fullgraph=True) traces the op and its backward without a graph break: the loss and its
    gradients are eager's, bit for bit."""
    case, change = CASES[op], dict(change)
    inputs = {**differentiable_inputs(case, dtype=change.pop("dtype", torch.float32)), **change}
    leaves = [inputs[name] for name in case.differentiable if inputs[name] is not None]
    names = [name for name in case.differentiable if inputs[name] is not None]
    cotangents = [torch.randn_like(t) for t in case.call(inputs, "triton")]

    def loss(*leaves):
        outs = case.call({**inputs, **dict(zip(names, leaves))}, "triton")
        return sum((out * c).sum() for out, c in zip(outs, cotangents))

    torch.compiler.reset()  # each sample is its own graph, not a recompilation of the last test's
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    actual_loss, expected_loss = compiled(*leaves), loss(*leaves)
    assert_bit_identical(actual_loss, expected_loss, "loss")
    actual, expected = torch.autograd.grad(actual_loss, leaves), torch.autograd.grad(expected_loss, leaves)
    for name, a, e in zip(names, actual, expected, strict=True):
        assert_bit_identical(a, e, f"compiled grad of {name}")


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_stem(backend):
    """The stem as a model chains it (embedder, lookup on its output, pooler), under both compilers."""
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


@pytest.mark.parametrize("case", FORWARD_OPS, ids=str)
def test_compile_dynamic_shapes(case):
    """With dynamic shapes the sequence length is symbolic: the op traces without a graph break, and a
    second length runs through the same graph."""
    torch.compiler.reset()  # the two lengths in one graph, not the last test's
    compiled = torch.compile(lambda inputs: case.call(inputs, "auto"), fullgraph=True, dynamic=True)
    for scale, stance in ((1, "default"), (2, "fail_on_recompile")):
        inputs = case.inputs(scale)
        with torch.compiler.set_stance(stance):
            actual = compiled(inputs)
        for a, e in zip(actual, outputs(case.reference(**inputs)), strict=True):
            assert_close(a, e, atol=1e-5, rtol=1e-5, what=f"scale {scale}")


@pytest.mark.parametrize("tracing_mode", ["real", "fake"])
@pytest.mark.parametrize("case", FORWARD_OPS, ids=str)
def test_tracers_see_the_ops(case, tracing_mode):
    """Under a tracer (a dispatch mode; FakeTensors in fake mode) eager inference calls take the registered
    op, not the shortcut past the dispatcher, so the trace records them; the Triton path stays enabled."""
    from torch.fx.experimental.proxy_tensor import make_fx

    inputs = case.inputs()
    tensors = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}

    def traced(*values):
        return case.call({**inputs, **dict(zip(tensors, values))}, "auto")

    with torch.no_grad():
        graph = make_fx(traced, tracing_mode=tracing_mode)(*tensors.values())
    assert f"fused_vision.{case.op}" in str(graph.code)
    assert not _dispatch._failed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("case", OPS, ids=str)
def test_meta_tensors_get_the_shapes_and_dtypes_of_real_ones(case, dtype):
    """Meta tensors (shape inference, e.g. a model built on the meta device) take the registered op,
    whose fake gives what the real call returns; no id check or kernel reads their missing data."""
    inputs = case.inputs(dtype=dtype)
    real = case.public(**inputs, backend="auto")
    real = real if isinstance(real, tuple) else (real,)
    meta_inputs = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    meta = case.public(**meta_inputs, backend="auto")
    meta = meta if isinstance(meta, tuple) else (meta,)
    for r, m in zip(real, meta, strict=True):
        assert (r is None) == (m is None)
        assert r is None or m.is_meta and (m.shape, m.dtype) == (r.shape, r.dtype)
    assert not _dispatch._failed


def strided(t):
    """``t``'s values in transposed memory (its last two dimensions swapped), or ``t`` below 2 dimensions."""
    return t.mT.contiguous().mT if isinstance(t, torch.Tensor) and t.dim() >= 2 else t


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("case", FORWARD_OPS, ids=str)
def test_outputs_are_contiguous_whatever_the_inputs_strides(case, backend):
    """As the ops' fakes say: every input of two or more dimensions but the clamps (see below) transposed in
    memory gives contiguous outputs, and the registered op passes opcheck on them. The kernels read through
    the strides: their outputs are the contiguous inputs' bit for bit (torch's own reductions, the
    reference's, sum in the order the strides give)."""
    inputs = case.inputs()
    transposed = {name: value if name == "clamps" else strided(value) for name, value in inputs.items()}
    with torch.no_grad():
        expected, actual = case.call(inputs, backend), case.call(transposed, backend)
    for a, e in zip(actual, expected, strict=True):
        assert a.is_contiguous()
        if backend == "triton":
            assert_bit_identical(a, e)
    torch.library.opcheck(getattr(torch.ops.fused_vision, case.op).default, case.op_args(transposed, backend))


@pytest.mark.parametrize("op", ["qkv_norm_rope", "gelu_gate"])
def test_clamps_in_transposed_memory(op):
    """(3, 2) clamps in transposed memory clamp as the same values stored contiguously."""
    case = CASES[op]
    inputs = case.inputs()
    with torch.no_grad():
        expected = case.call(inputs, "triton")
        actual = case.call({**inputs, "clamps": strided(inputs["clamps"])}, "triton")
    for a, e in zip(actual, expected, strict=True):
        assert_bit_identical(a, e, what=f"{op} with clamps in transposed memory")


def negated_view(t: torch.Tensor) -> torch.Tensor:
    """A tensor equal to ``t`` whose memory holds ``-t``: the imaginary part of a conjugate (is_neg())."""
    return torch.complex(torch.zeros_like(t), -t).conj().imag


NEGATED = [(case.op, name) for case in FORWARD_OPS for name in case.differentiable]
NEGATED += [("qkv_norm_rope", "clamps"), ("gelu_gate", "clamps")]


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("op,argument", NEGATED, ids=[f"{op}-{name}" for op, name in NEGATED])
def test_lazily_negated_inputs(op, argument, backend):
    """x.conj().imag is a view whose memory holds -x: a kernel reading it raw would flip the sign. Such
    inputs take the registered op, whose dispatcher resolves the negation first."""
    case = CASES[op]
    inputs = case.inputs()
    negated = negated_view(inputs[argument])
    assert negated.is_neg() and torch.equal(negated, inputs[argument])
    with torch.no_grad():
        expected = case.call(inputs, backend)
        actual = case.call({**inputs, argument: negated}, backend)
    for a, e in zip(actual, expected, strict=True):
        assert_bit_identical(a, e, what=f"{op} with a negated {argument}")


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("case", FORWARD_OPS, ids=str)
def test_double_backward_matches_autograd_through_the_reference(case, backend):
    """create_graph=True, then differentiate the gradients in the output gradients: the backward's own
    backward (for the lookup and the pooler, their backward ops') against autograd through the reference."""
    inputs = differentiable_inputs(case)
    leaves = [inputs[name] for name in case.differentiable]
    upstream = [torch.randn_like(out).requires_grad_(True) for out in outputs(case.reference(**inputs))]
    probes = [torch.randn_like(leaf) for leaf in leaves]

    def grad_of_grad(forward):
        grads = torch.autograd.grad(forward(inputs), leaves, upstream, create_graph=True, allow_unused=True)
        loss = sum((g * p).sum() for g, p in zip(grads, probes) if g is not None)
        return torch.autograd.grad(loss, upstream, allow_unused=True)

    actual = grad_of_grad(lambda i: case.call(i, backend))
    expected = grad_of_grad(lambda i: outputs(case.reference(**i)))
    for a, e in zip(actual, expected, strict=True):
        assert (a is None) == (e is None)
        if a is not None:
            assert_close(a, e, atol=1e-5, rtol=1e-5, what=f"{case.op}: grad of grad")
