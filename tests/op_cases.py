"""Inputs and stock comparisons shared by the ops' tests, and the table of registered ops."""

from collections.abc import Callable
from dataclasses import dataclass

import torch

import fused_vision
from fused_vision import reference
from fused_vision.ops.pool_by_positions import pool_by_positions_backward
from fused_vision.ops.position_embeddings import position_embeddings_backward

from helpers import DEVICE, assert_as_accurate_as_stock, assert_close

# One unit in the last place, relative: 2**-(stored mantissa bits).
ULP = {torch.float32: 2**-23, torch.float16: 2**-10, torch.bfloat16: 2**-7}
GRAD_DTYPES = [torch.float32, torch.bfloat16]
# fp32 gradients agree with stock's to rounding. bf16 ones are sums of many rounded terms, which stock
# and fused order (and, for the table, accumulate: stock's F.embedding backward adds in bf16, fused in
# fp32) differently, so they are judged against float64 instead: no worse than 1.5x stock's relative
# error, or than the bf16 rounding of the result itself.
FP32_TOLERANCE = 1e-5
BF16_ERROR_FLOOR = 2**-8
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


EPS = 1e-6
CLAMPS = [[-3.0, 2.5], [-1.5, 1.75], [-1.0, 0.9]]


def inv_freq(head_dim, theta=100.0):
    spatial = head_dim // 2
    return (1.0 / theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial)).to(DEVICE)


@dataclass(frozen=True)
class OpCase:
    """A registered op: fresh random inputs by argument name (``scale`` lengthens the sequence), the function
    users call with them as keywords (for a backward op, the op itself), its PyTorch reference (forward
    ops), and the inputs it is differentiable in."""

    op: str
    inputs: Callable[..., dict]
    public: Callable
    reference: Callable | None
    differentiable: tuple[str, ...]

    def __str__(self):
        return self.op

    def call(self, inputs, backend):
        return outputs(self.public(**inputs, backend=backend))

    def op_args(self, inputs, backend):
        """The registered op's positional arguments, in its schema's order."""
        schema = getattr(torch.ops.fused_vision, self.op).default._schema
        return tuple(backend if a.name == "backend" else inputs[a.name] for a in schema.arguments)


def outputs(result):
    """An op's floating-point outputs as a tuple (without the pooler's mask or a missing y)."""
    result = result if isinstance(result, tuple) else (result,)
    return tuple(t for t in result if t is not None and t.is_floating_point())


def _lookup_inputs(scale=1, dtype=torch.float32):
    ids = make_ids(2, 11 * scale, 20, padded_tail=3, half_padded=1).to(DEVICE)
    return dict(
        table=torch.randn(2, 20, 8, device=DEVICE).to(dtype),
        position_ids=ids,
        padding_positions=reference.default_padding_positions(ids),
        residual=torch.randn(2, 11 * scale, 8, device=DEVICE).to(dtype),
    )


def _embed_inputs(scale=1, dtype=torch.float32):
    pixels, weight, table, ids = make_inputs(2, 11 * scale, 12, 8, 20, dtype, torch.float32, 3)
    padding = reference.default_padding_positions(ids)
    return dict(pixel_values=pixels, weight=weight, table=table, position_ids=ids, padding_positions=padding)


def _pool_inputs(scale=1, dtype=torch.float32):
    """Grids shuffled (fresh ids each call) into 4 * scale slots of 3 x 3 patches."""
    hidden_states, ids, padding = make_batch([(6, 6 * scale), (3, 6 * scale)], 3, 4 * scale, 8, dtype, shuffle=True)
    return dict(
        hidden_states=hidden_states,
        position_ids=ids,
        padding_positions=padding,
        output_length=4 * scale,
        round_average=True,
    )


def _qkv_inputs(scale=1, dtype=torch.float32):
    tokens, head_dim = 7 * scale, 16
    ids = torch.randint(0, 40, (tokens, 2), device=DEVICE)
    ids[-2:] = -1
    return dict(
        qkv=torch.randn(tokens, 4 * head_dim, device=DEVICE).to(dtype),
        position_ids=ids,
        q_weight=(1 + 0.3 * torch.randn(head_dim, device=DEVICE)).to(dtype),
        k_weight=(1 + 0.3 * torch.randn(head_dim, device=DEVICE)).to(dtype),
        inv_freq=inv_freq(head_dim),
        num_heads=2,
        num_kv_heads=1,
        eps=EPS,
        clamps=torch.tensor(CLAMPS, device=DEVICE),
    )


def _norm_inputs(scale=1, dtype=torch.float32):
    x, residual = (torch.randn(2, 5 * scale, 16, device=DEVICE).to(dtype) for _ in range(2))
    post_weight, next_weight = ((1 + 0.3 * torch.randn(16, device=DEVICE)).to(dtype) for _ in range(2))
    return dict(x=x, residual=residual, post_weight=post_weight, next_weight=next_weight, eps=EPS)


def _gelu_inputs(scale=1, dtype=torch.float32):
    gate_up = (2 * torch.randn(2, 6 * scale, 2 * 16, device=DEVICE)).to(dtype)
    return dict(gate_up=gate_up, clamps=torch.tensor(CLAMPS, device=DEVICE))


def _gate_up_inputs(scale=1, dtype=torch.float32):
    y = torch.randn(2, 6 * scale, 24, device=DEVICE).to(dtype)
    weight = (torch.randn(2 * 20, 24, device=DEVICE) / 24**0.5).to(dtype)
    return dict(y=y, weight=weight, clamps=torch.tensor(CLAMPS, device=DEVICE))


def _lookup_grad_inputs(scale=1, dtype=torch.float32):
    lookup = _lookup_inputs(scale)
    grad = torch.randn(2, 11 * scale, 8, device=DEVICE)
    return dict(grad=grad, position_ids=lookup["position_ids"], padding_positions=lookup["padding_positions"],
                num_positions=20, dtype=dtype)  # fmt: skip


def _pool_grad_inputs(scale=1, dtype=torch.float32):
    pool = _pool_inputs(scale)
    grad_pooled = torch.randn(2, 4 * scale, 8, device=DEVICE)
    return dict(grad_pooled=grad_pooled, position_ids=pool["position_ids"], padding_positions=pool["padding_positions"],
                output_length=4 * scale, hidden_dtype=dtype, round_average=True)  # fmt: skip


FORWARD_OPS = [
    OpCase("position_embeddings", _lookup_inputs, fused_vision.position_embeddings, reference.position_embeddings,
           ("table", "residual")),
    OpCase("patch_embed", _embed_inputs, fused_vision.patch_embed, reference.patch_embed,
           ("pixel_values", "weight", "table")),
    OpCase("pool_by_positions", _pool_inputs, fused_vision.pool_by_positions, reference.pool_by_positions,
           ("hidden_states",)),
    OpCase("qkv_norm_rope", _qkv_inputs, fused_vision.qkv_norm_rope, reference.qkv_norm_rope,
           ("qkv", "q_weight", "k_weight", "inv_freq")),
    OpCase("residual_rms_norm", _norm_inputs, fused_vision.residual_rms_norm, reference.residual_rms_norm,
           ("x", "residual", "post_weight", "next_weight")),
    OpCase("gelu_gate", _gelu_inputs, fused_vision.gelu_gate, reference.gelu_gate, ("gate_up",)),
    OpCase("gate_up_gelu", _gate_up_inputs, fused_vision.gate_up_gelu, reference.gate_up_gelu, ("y", "weight")),
]  # fmt: skip
BACKWARD_OPS = [
    OpCase("position_embeddings_backward", _lookup_grad_inputs, position_embeddings_backward, None, ("grad",)),
    OpCase("pool_by_positions_backward", _pool_grad_inputs, pool_by_positions_backward, None, ("grad_pooled",)),
]
OPS = FORWARD_OPS + BACKWARD_OPS
CASES = {case.op: case for case in OPS}


def differentiable_inputs(case, **kwargs):
    inputs = case.inputs(**kwargs)
    for name in case.differentiable:
        inputs[name].requires_grad_(True)
    return inputs
