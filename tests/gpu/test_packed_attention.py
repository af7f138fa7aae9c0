"""The packed encoder's varlen attention paths against float64 and sdpa per item, on a CUDA GPU:
``pytest -m gpu``.

Each path of ``fused_vision.encoder.varlen`` runs where this machine has it and takes the inputs, and is
skipped, saying why, where not; both real head sizes (64: E2B/E4B, 72: 26B/31B), scale 1.0.
"""

import pytest
import torch

from fused_vision.encoder import attention, varlen

pytestmark = pytest.mark.gpu

LENGTHS = [630, 2520, 1, 2268, 0, 577]  # frames, images, a lone patch, an empty item


def packed_states(head_dim, dtype, heads=4, seed=0):
    generator = torch.Generator().manual_seed(seed)
    total = sum(LENGTHS)
    states = [torch.randn(total, heads, head_dim, generator=generator).to("cuda", dtype) for _ in range(3)]
    offsets = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    return states, offsets


KERNEL_PATHS = [name for name in varlen.PATHS if name != "sdpa"]
TRAINABLE_PATHS = [name for name in KERNEL_PATHS if name != "vllm_flash_attn"]  # vLLM builds no backward


def states_for(path, head_dim, dtype):
    """The packed states on the GPU, or a skip saying why ``path`` cannot run them here."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    (query, key, value), offsets = packed_states(head_dim, dtype)
    if varlen.PATHS[path].load() is None:
        pytest.skip(f"{path} is not installed here")
    if not varlen.PATHS[path].takes(query):
        pytest.skip(f"{path} takes no {dtype} queries of head_dim {head_dim} on this GPU")
    return (query, key, value), offsets


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("head_dim", [64, 72])
@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_varlen_path_matches_sdpa_per_item(path, head_dim, dtype):
    (query, key, value), offsets = states_for(path, head_dim, dtype)
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
    """Without FUSED_VISION_ATTENTION, the first installed kernel of the order that takes the queries."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    (query, _, _), _ = packed_states(head_dim, torch.bfloat16)
    kernels = [name for name in varlen.AUTO_ORDER[:-1] if varlen.usable(name, query)]
    assert attention.attention_path(query) == (kernels[0] if kernels else "sdpa")


@pytest.mark.parametrize("path", TRAINABLE_PATHS)
def test_gradients_match_sdpa_per_item(path):
    (query, key, value), offsets = states_for(path, 72, torch.bfloat16)
    grads = []
    for name in (path, "sdpa"):
        inputs = [t.clone().requires_grad_() for t in (query, key, value)]
        out = attention.varlen_attention(*inputs, offsets, LENGTHS, max(LENGTHS), scale=1.0, path=name)
        out.float().square().mean().backward()
        grads.append([t.grad.float() for t in inputs])
    for got, expected in zip(*grads):
        assert (got - expected).norm() <= 2**-6 * expected.norm()
