"""qkv_norm_rope against the reference and the reference against transformers' own attention module.

The reference is stock's ops in stock's order: bit-identical to Gemma4VisionAttention's q, k and v. The
kernel rounds where stock rounds, but sums each head's squares in another order and takes cos and sin from
another libm: within one rounding of the hidden dtype of the norm's output and of cos and sin, which the
RoPE's products and sum carry on, plus a few fp32 ulps of the inverse RMS (seen in fp32 alone). Where
those cannot differ (sums exact in any order, cos 1 and sin 0), it is bit-identical.
"""

import pytest
import torch

import fused_vision
from fused_vision import reference

from helpers import DEVICE, FLOAT_DTYPES, assert_bit_identical, dtype_id
from op_cases import EPS, ULP, assert_within, exactly_summable, inv_freq

BACKENDS = ["triton", "reference"]


def make_case(tokens, heads, kv_heads, head_dim, dtype, values=None):
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(DEVICE, dtype) if values is None else values
    ids = torch.randint(0, 40, (tokens, 2), device=DEVICE)
    ids[-3:] = -1  # padding positions rotate by -1, as stock's
    weights = [(1 + 0.3 * torch.randn(head_dim)).to(DEVICE, dtype) for _ in range(2)]
    return qkv, ids, *weights, inv_freq(head_dim)


def pair_magnitude(n):
    """|n| plus the magnitude of each channel's RoPE partner (the other quarter of its half)."""
    quarters = n.abs().unflatten(-1, (2, 2, -1))
    return n.abs() + quarters.flip(-2).flatten(-3)


def assert_within_one_rounding(actual, expected, case, heads, kv_heads, clamps=None):
    qkv, ids, q_weight, k_weight, freqs = case
    ulp = ULP[qkv.dtype]
    norms = reference.qkv_norm_rope(qkv, torch.zeros_like(ids), q_weight, k_weight, freqs, heads, kv_heads, EPS, clamps)
    for name, a, e, n in zip("qkv", actual, expected, norms):
        # One rounding of the output, and one of each RoPE input (the norm's output, cos, sin) carried on;
        # and the inverse RMS, an fp32 value in every dtype, within 4 of fp32's ulps (the sum's order, and
        # on a GPU the hardware's rsqrt): it shows only in fp32.
        magnitude = e.double().abs() + pair_magnitude(n.double())
        bound = ulp * (e.double().abs() + 2 * pair_magnitude(n.double())) + 4 * ULP[torch.float32] * magnitude
        assert_within(a, e, bound, what=name)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", [(37, 3, 1, 64), (29, 2, 2, 72)], ids=str)
@pytest.mark.parametrize("clipped", [False, True], ids=["plain", "clipped"])
def test_matches_reference(poisoned, backend, dtype, tokens, heads, kv_heads, head_dim, clipped):
    case = make_case(tokens, heads, kv_heads, head_dim, dtype)
    clamps = torch.tensor([[-1.5, 1.75], [-2.0, 1.0], [-0.5, 0.8]], device=DEVICE) if clipped else None
    actual = fused_vision.qkv_norm_rope(*case, heads, kv_heads, eps=EPS, clamps=clamps, backend=backend)
    expected = reference.qkv_norm_rope(*case, heads, kv_heads, EPS, clamps)
    for a, e in zip(actual, expected):
        assert a.is_contiguous() and a.shape == e.shape
    if backend == "reference":
        for a, e in zip(actual, expected):
            assert_bit_identical(a, e)
    else:
        assert_within_one_rounding(actual, expected, case, heads, kv_heads, clamps)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_only_the_inverse_rms_differs_where_the_sums_are_exact(poisoned, dtype):
    """Squares that sum exactly in any order and positions (0, 0) (cos 1, sin 0): what is left to differ is
    the inverse RMS (the hardware's rsqrt, not torch's correctly rounded power), within 4 of fp32's ulps,
    which may move the output's rounding by one unit: no allowance for the sums' order."""
    heads, kv_heads, head_dim = 2, 1, 72
    case = list(make_case(21, heads, kv_heads, head_dim, dtype, exactly_summable(21, 4 * head_dim, dtype=dtype)))
    case[1] = torch.zeros_like(case[1])
    actual = fused_vision.qkv_norm_rope(*case, heads, kv_heads, eps=EPS, backend="triton")
    for name, a, e in zip("qkv", actual, reference.qkv_norm_rope(*case, heads, kv_heads, EPS)):
        assert_within(a, e, (ULP[dtype] + 4 * ULP[torch.float32]) * e.double().abs(), name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_reference_is_stock_attention(monkeypatch, dtype):
    """The reference's q, k, v are bit for bit those Gemma4VisionAttention hands its attention function."""
    modeling = pytest.importorskip("transformers.models.gemma4.modeling_gemma4")
    config = modeling.Gemma4VisionConfig(
        hidden_size=48, num_attention_heads=3, num_key_value_heads=3, head_dim=16, use_clipped_linears=True
    )
    config._attn_implementation = "eager"
    attention = modeling.Gemma4VisionAttention(config, layer_idx=0)
    rotary = modeling.Gemma4VisionRotaryEmbedding(config).to(DEVICE)
    with torch.no_grad():
        for parameter in attention.parameters():
            parameter.copy_(torch.randn_like(parameter) * 0.3 + (1.0 if parameter.dim() == 1 else 0.0))
        for projection, (low, high) in zip(
            (attention.q_proj, attention.k_proj, attention.v_proj), [(-0.6, 0.7), (-0.8, 0.5), (-0.4, 0.9)]
        ):
            projection.output_min.fill_(low)
            projection.output_max.fill_(high)
    attention = attention.to(DEVICE, dtype)
    hidden = torch.randn(2, 11, 48, device=DEVICE).to(dtype)
    ids = torch.randint(0, 30, (2, 11, 2), device=DEVICE)
    ids[1, -2:] = -1
    seen = {}

    def capture(module, query, key, value, *args, **kwargs):
        seen.update(q=query, k=key, v=value)
        return query.transpose(1, 2), None

    monkeypatch.setattr(modeling, "eager_attention_forward", capture)
    with torch.no_grad():
        attention(hidden, position_embeddings=rotary(hidden, ids), position_ids=ids)
        qkv = torch.cat([p.linear(hidden) for p in (attention.q_proj, attention.k_proj, attention.v_proj)], dim=-1)
        clamps = torch.tensor(
            [[p.output_min, p.output_max] for p in (attention.q_proj, attention.k_proj, attention.v_proj)]
        ).to(DEVICE)
        q_weight, k_weight = attention.q_norm.weight, attention.k_norm.weight
        q, k, v = reference.qkv_norm_rope(
            qkv.flatten(0, 1), ids.flatten(0, 1), q_weight, k_weight, rotary.inv_freq, 3, 3, config.rms_norm_eps, clamps
        )
    for name, ours in zip("qkv", (q, k, v)):
        assert_bit_identical(ours, seen[name].transpose(1, 2).flatten(0, 1), name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_special_values(poisoned, backend):
    """NaN spreads over its own head only; an inf zeroes its head (x / inf) but for its own channel and
    its RoPE partner (inf * 0), NaN; stock's NaN pattern either way."""
    case = list(make_case(9, 2, 1, 64, torch.bfloat16))
    case[0][1, 5] = float("nan")
    case[0][2, 64 + 3] = float("inf")
    actual = fused_vision.qkv_norm_rope(*case, 2, 1, eps=EPS, backend=backend)
    expected = reference.qkv_norm_rope(*case, 2, 1, EPS)
    for a, e in zip(actual, expected):
        assert torch.equal(a.isnan(), e.isnan())
    assert actual[0][1, 0].isnan().all() and not actual[0][1, 1].isnan().any()
    assert actual[0][2, 1].isnan().sum() == 2 and not actual[0][2, 0].isnan().any()


def test_empty(poisoned):
    case = make_case(0, 2, 1, 64, torch.float32)
    shapes = [t.shape for t in fused_vision.qkv_norm_rope(*case, 2, 1, backend="triton")]
    assert shapes == [(0, 2, 64), (0, 1, 64), (0, 1, 64)]


@pytest.mark.parametrize(
    "change,error",
    [
        (dict(qkv=torch.zeros(5, 100)), "qkv: expected shape"),
        (dict(q_weight=torch.ones(70)), "multiple of 4"),
        (dict(k_weight=torch.ones(32)), "k_weight: expected shape"),
        (dict(inv_freq=torch.ones(8)), "inv_freq: expected shape"),
        (dict(position_ids=torch.zeros(5, 3, dtype=torch.long)), "position_ids: expected shape"),
        (dict(num_kv_heads=0), "num_kv_heads: expected a positive int"),
        (dict(clamps=torch.zeros(2, 2)), "clamps: expected shape"),
    ],
)
def test_errors(change, error):
    args = (
        dict(
            qkv=torch.zeros(5, 4 * 64),
            position_ids=torch.zeros(5, 2, dtype=torch.long),
            q_weight=torch.ones(64),
            k_weight=torch.ones(64),
            inv_freq=torch.ones(16),
            num_heads=2,
            num_kv_heads=1,
            clamps=None,
        )
        | change
    )
    with pytest.raises(ValueError, match=error):
        fused_vision.qkv_norm_rope(**args)


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_is_autograd_through_the_reference(backend):
    case = [t.clone().requires_grad_(t.is_floating_point()) for t in make_case(13, 2, 1, 64, torch.float32)]
    grads_out = [torch.randn(13, h, 64, device=DEVICE) for h in (2, 1, 1)]
    inputs = [case[0], case[2], case[3], case[4]]
    actual = torch.autograd.grad(fused_vision.qkv_norm_rope(*case, 2, 1, backend=backend), inputs, grads_out)
    expected = torch.autograd.grad(reference.qkv_norm_rope(*case, 2, 1, EPS), inputs, grads_out)
    for name, a, e in zip(["qkv", "q_weight", "k_weight", "inv_freq"], actual, expected):
        assert_bit_identical(a, e, f"grad of {name}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_in_the_norm_weights_alone_is_stock_autograds(backend):
    """qkv needs no gradient: v then depends on no input that does, and adds none (stock's autograd too)."""
    qkv, ids, q_weight, k_weight, freqs = make_case(13, 2, 1, 64, torch.float32)
    weights = [w.clone().requires_grad_(True) for w in (q_weight, k_weight)]
    grads_out = [torch.randn(13, h, 64, device=DEVICE) for h in (2, 1, 1)]
    outputs = fused_vision.qkv_norm_rope(qkv, ids, *weights, freqs, 2, 1, backend=backend)
    assert outputs[2].grad_fn is not None, "v is an output of the op, if not differentiable in these inputs"
    actual = torch.autograd.grad(outputs, weights, grads_out)
    stock = reference.qkv_norm_rope(qkv, ids, *weights, freqs, 2, 1, EPS)
    expected = torch.autograd.grad(stock[:2], weights, grads_out[:2])
    for name, a, e in zip(["q_weight", "k_weight"], actual, expected, strict=True):
        assert_bit_identical(a, e, f"grad of {name}")
