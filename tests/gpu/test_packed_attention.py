"""The packed encoder's varlen attention paths against sdpa per item, on a CUDA GPU: ``pytest -m gpu``.

Each path (flash-attn's ``flash_attn_varlen_func``, torch's ``varlen_attn``) runs where this machine has it
and is skipped, saying why, where not; both real head sizes (64: E2B/E4B, 72: 26B/31B), scale 1.0.
"""

import pytest
import torch

from fused_vision import attention

pytestmark = pytest.mark.gpu

LENGTHS = [630, 2520, 1, 2268, 0, 577]  # frames, images, a lone patch, an empty item


def packed_states(head_dim, dtype, heads=4, seed=0):
    generator = torch.Generator().manual_seed(seed)
    total = sum(LENGTHS)
    states = [torch.randn(total, heads, head_dim, generator=generator).to("cuda", dtype) for _ in range(3)]
    offsets = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    return states, offsets


def available(path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if path == "flash_attn" and attention._flash_attn_varlen() is None:
        pytest.skip("flash-attn is not importable here")
    if path == "torch_varlen" and attention._torch_varlen() is None:
        pytest.skip("this torch has no varlen_attn with flash kernels")
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("the varlen kernels need sm80+")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("head_dim", [64, 72])
@pytest.mark.parametrize("path", ["flash_attn", "torch_varlen"])
def test_varlen_path_matches_sdpa_per_item(path, head_dim, dtype):
    available(path)
    (query, key, value), offsets = packed_states(head_dim, dtype)
    got = attention.varlen_attention(query, key, value, offsets, LENGTHS, max(LENGTHS), scale=1.0, path=path)
    expected = attention.varlen_attention(query, key, value, offsets, LENGTHS, max(LENGTHS), scale=1.0, path="sdpa")
    exact = attention.varlen_attention(
        *(t.double().cpu() for t in (query, key, value)), offsets.cpu(), LENGTHS, max(LENGTHS), scale=1.0, path="sdpa"
    )
    assert got.shape == expected.shape == query.shape
    for result, name in ((got, path), (expected, "sdpa")):
        error = (result.double().cpu() - exact).norm() / exact.norm()
        assert error < 2 * 2 ** -(7 if dtype == torch.bfloat16 else 10), f"{name}: relative error {error:.3g}"
    sdpa_error = (expected.double().cpu() - exact).norm()
    assert (got.double().cpu() - exact).norm() <= 1.5 * sdpa_error, "no less accurate than sdpa per item"


@pytest.mark.parametrize("head_dim", [64, 72])
def test_the_automatic_path_on_this_gpu(head_dim):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    (query, _, _), _ = packed_states(head_dim, torch.bfloat16)
    varlen = attention._flash_attn_varlen() or attention._torch_varlen()
    wanted = "sdpa" if varlen is None or torch.cuda.get_device_capability() < (8, 0) else None
    path = attention.attention_path(query)
    assert path == wanted if wanted else path in ("flash_attn", "torch_varlen")


def test_flash_attn_gradients_match_sdpa_per_item():
    available("flash_attn")
    (query, key, value), offsets = packed_states(72, torch.bfloat16)
    grads = []
    for path in ("flash_attn", "sdpa"):
        inputs = [t.clone().requires_grad_() for t in (query, key, value)]
        out = attention.varlen_attention(*inputs, offsets, LENGTHS, max(LENGTHS), scale=1.0, path=path)
        out.float().square().mean().backward()
        grads.append([t.grad.float() for t in inputs])
    for got, expected in zip(*grads):
        assert (got - expected).norm() <= 2**-6 * expected.norm()
