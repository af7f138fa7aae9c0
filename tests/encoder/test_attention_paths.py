"""Which attention path a packed call takes, with each kernel present and absent, and what each path computes.

The GPU kernels are stood in for by functions that record their arguments and compute with sdpa; the real
kernels run against float64 in tests/gpu/test_packed_attention.py. sdpa and FlexAttention run here for real.
"""

import dataclasses
import warnings

import pytest
import torch

from fused_vision import _dispatch
from fused_vision.encoder import varlen
from fused_vision.encoder.attention import Packing

from helpers import assert_bit_identical

LENGTHS = [4, 4, 4, 0, 2, 2, 5, 1]  # runs of equal lengths, an empty item, a lone patch
FLASH = ("flash_attn_3", "flash_attn_4", "vllm_flash_attn", "flash_attn")


def exact_per_item(query, key, value, lengths, scale):
    """Attention of each item's rows on its own, in float64, one item at a time."""
    outputs, start = [], 0
    for length in lengths:
        rows = [t[start : start + length].double().transpose(0, 1) for t in (query, key, value)]  # (H, L, d)
        weights = torch.softmax(rows[0] @ rows[1].transpose(1, 2) * scale, dim=-1)
        outputs.append((weights @ rows[2]).transpose(0, 1))
        start += length
    return torch.cat(outputs)


def states(lengths=LENGTHS, heads=3, head_dim=72, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(sum(lengths), heads, head_dim, generator=generator, dtype=dtype) for _ in range(3)]


class FakeFlash:
    """A flash-attention varlen function by its keywords: records them, computes with sdpa."""

    def __init__(self, name, returns_tuple=False):
        self.name, self.returns_tuple, self.calls = name, returns_tuple, []

    def __call__(self, query, key, value, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **options):
        self.calls.append({"cu_seqlens": cu_seqlens_q.tolist(), "longest": max_seqlen_q, **options})
        assert cu_seqlens_k is cu_seqlens_q and max_seqlen_k == max_seqlen_q
        lengths = torch.diff(cu_seqlens_q).tolist()
        scale = options["softmax_scale"]
        output = varlen.varlen_attention(
            query, key, value, cu_seqlens_q, lengths, max_seqlen_q, scale=scale, path="sdpa"
        )
        return (output, None) if self.returns_tuple else output


@pytest.fixture
def gpu(monkeypatch):
    """A GPU of a given capability, as the paths see it: every CPU half-precision query looks like a CUDA one,
    and every flash kernel is installed (a fake); returns (set_capability, fakes)."""
    capability = [(9, 0)]
    monkeypatch.setattr(varlen, "_flash_inputs", lambda q, most: q.dtype in varlen._HALF_DTYPES and q.shape[-1] <= most)
    monkeypatch.setattr(varlen, "_capability", lambda query: capability[0])
    monkeypatch.setattr(varlen, "_vllm_fa3_supported", lambda device: True)
    monkeypatch.setattr(_dispatch, "_WARNED", set())
    monkeypatch.delenv(varlen.ENV_ATTENTION, raising=False)
    fakes = {name: FakeFlash(name, returns_tuple=name == "flash_attn_4") for name in FLASH}
    for name, fake in fakes.items():
        install(monkeypatch, name, fake)

    def set_capability(value):
        capability[0] = value

    return set_capability, fakes


def install(monkeypatch, name, function):
    """``name``'s kernel as ``function`` (None: not installed)."""
    monkeypatch.setitem(varlen.PATHS, name, dataclasses.replace(varlen.PATHS[name], load=lambda: function))


def test_hopper_takes_flash_attention_3_then_4_then_vllms_then_2(gpu, monkeypatch):
    set_capability, fakes = gpu
    query = states(dtype=torch.bfloat16)[0]
    for name in FLASH:
        assert varlen.attention_path(query) == name
        install(monkeypatch, name, None)
    install(monkeypatch, "torch_varlen", object())
    assert varlen.attention_path(query) == "torch_varlen"
    install(monkeypatch, "torch_varlen", None)
    assert varlen.attention_path(query) == "sdpa", "cuDNN and flex only by request"


@pytest.mark.parametrize(
    ("capability", "expected"),
    [((8, 0), "vllm_flash_attn"), ((8, 9), "vllm_flash_attn"), ((10, 0), "flash_attn_4"), ((12, 0), "vllm_flash_attn")],
)
def test_flash_attention_3_and_4_only_where_they_are_built(gpu, capability, expected):
    set_capability, _ = gpu
    set_capability(capability)
    assert varlen.attention_path(states(dtype=torch.bfloat16)[0]) == expected


def test_dropout_goes_to_the_kernels_that_take_it(gpu):
    """FlashAttention-3 and 4 take no dropout: vLLM's build then runs its FlashAttention-2 with it."""
    _, fakes = gpu
    query, key, value = states(dtype=torch.bfloat16)
    assert varlen.attention_path(query, dropout=0.1) == "vllm_flash_attn"
    Packing.of(LENGTHS, "cpu").attend(query, key, value, scale=0.5, dropout=0.1)
    assert fakes["vllm_flash_attn"].calls[-1] == {
        "cu_seqlens": [0, 4, 8, 12, 12, 14, 16, 21, 22],
        "longest": 5,
        "softmax_scale": 0.5,
        "dropout_p": 0.1,
        "fa_version": 2,
    }
    with pytest.raises(ValueError, match="dropout: the flash_attn_3 path takes none"):
        varlen.varlen_attention(query, key, value, None, LENGTHS, 5, scale=0.5, dropout=0.1, path="flash_attn_3")


@pytest.mark.parametrize("name", FLASH)
def test_each_flash_path_passes_its_kernel_the_items(gpu, name):
    """The same items, scale and no dropout to every kernel; vLLM's asked for its FlashAttention-3 on sm90.
    Outputs as sdpa's, whether the kernel returns the output or (output, logsumexp)."""
    _, fakes = gpu
    query, key, value = states(dtype=torch.bfloat16)
    packing = Packing.of(LENGTHS, "cpu")
    got = varlen.varlen_attention(query, key, value, packing.cu_seqlens, LENGTHS, 5, scale=0.25, path=name)
    expected = {"cu_seqlens": packing.cu_seqlens.tolist(), "longest": 5, "softmax_scale": 0.25}
    assert fakes[name].calls == [expected | ({"fa_version": 3} if name == "vllm_flash_attn" else {})]
    sdpa = varlen.varlen_attention(query, key, value, packing.cu_seqlens, LENGTHS, 5, scale=0.25, path="sdpa")
    assert_bit_identical(got, sdpa)


def test_a_request_takes_its_path_first(gpu, monkeypatch):
    query = states(dtype=torch.bfloat16)[0]
    monkeypatch.setenv(varlen.ENV_ATTENTION, "flash_attn")
    assert varlen.attention_path(query) == "flash_attn"
    monkeypatch.setenv(varlen.ENV_ATTENTION, "sdpa")
    assert varlen.attention_path(query) == "sdpa"
    monkeypatch.setenv(varlen.ENV_ATTENTION, "auto")
    assert varlen.attention_path(query) == "flash_attn_3"


def test_a_request_it_cannot_take_warns_once_and_takes_the_order(gpu, monkeypatch):
    """cuDNN's ragged kernel takes no CPU queries (nor those of this machine, whatever its torch build)."""
    monkeypatch.setenv(varlen.ENV_ATTENTION, "cudnn")
    monkeypatch.setattr(varlen, "_flash_inputs", lambda query, most: False)  # no GPU after all
    query = states()[0]
    with pytest.warns(RuntimeWarning, match="FUSED_VISION_ATTENTION=cudnn: not installed, or it takes no cpu"):
        assert varlen.attention_path(query) == "sdpa"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert varlen.attention_path(query) == "sdpa"


def test_a_request_for_an_unknown_path_is_refused(monkeypatch):
    monkeypatch.setenv(varlen.ENV_ATTENTION, "flash")
    with pytest.raises(ValueError, match=r"FUSED_VISION_ATTENTION='flash': expected one of auto, flash_attn_3, "):
        varlen.attention_path(states()[0])


def test_equal_runs_batch_consecutive_items_of_one_length():
    assert varlen._equal_runs(LENGTHS) == [(0, 3, 4), (12, 2, 2), (16, 1, 5), (21, 1, 1)]
    assert varlen._equal_runs([0, 0]) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_sdpa_runs_one_call_per_run_as_accurate_as_per_item(monkeypatch, dtype):
    """Batched by runs of equal length, the output is as close to float64 as one call per item (within the
    suite's slack of 1.5: a batched call may take another of the CPU's sdpa kernels, per instruction set)."""
    calls, sdpa = [], torch.nn.functional.scaled_dot_product_attention
    path = varlen.PATHS["sdpa"]
    monkeypatch.setitem(
        varlen.PATHS, "sdpa", dataclasses.replace(path, load=lambda: lambda *a, **k: calls.append(1) or sdpa(*a, **k))
    )
    query, key, value = states(dtype=dtype, seed=1)
    packing = Packing.of(LENGTHS, "cpu")
    got = varlen.varlen_attention(query, key, value, packing.cu_seqlens, LENGTHS, 5, scale=0.3, path="sdpa")
    assert len(calls) == 4, "one call per run of equal lengths"
    exact = exact_per_item(query, key, value, LENGTHS, 0.3)
    per_item = torch.cat(
        [
            sdpa(*(t[s : s + n].transpose(0, 1) for t in (query, key, value)), scale=0.3).transpose(0, 1)
            for s, n in zip(packing.cu_seqlens[:-1].tolist(), LENGTHS)
            if n
        ]
    )
    assert got.shape == query.shape and got.dtype == dtype
    assert (got.double() - exact).abs().max() <= max(1.5 * (per_item.double() - exact).abs().max(), 1e-6)


def test_flex_attention_with_its_document_mask_matches_float64():
    """FlexAttention (eager on a CPU) attends within each item only: the document mask is right."""
    query, key, value = states(seed=2)
    packing = Packing.of(LENGTHS, "cpu")
    got = varlen.varlen_attention(query, key, value, packing.cu_seqlens, LENGTHS, 5, scale=0.3, path="flex")
    exact = exact_per_item(query, key, value, LENGTHS, 0.3)
    assert got.shape == query.shape
    assert (got.double() - exact).abs().max() < 1e-5


def test_document_ids_are_each_rows_item():
    cu_seqlens = Packing.of(LENGTHS, "cpu").cu_seqlens
    expected = [item for item, length in enumerate(LENGTHS) for _ in range(length)]
    assert varlen._document_ids(cu_seqlens, sum(LENGTHS)).tolist() == expected
