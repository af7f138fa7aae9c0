"""The encoder's own forward (fused_vision.encoder) called as engines call it: a padded (B, N) batch, packed
where the host may read it, padded elsewhere; and the fused layers around linears they cannot read."""

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fused_vision.encoder.fused_layer as fl
from fused_vision import apply_fused_vision_to_gemma4, revert_fused_vision_gemma4
from fused_vision.encoder import attention, padded, varlen
from fused_vision.encoder.attention import Packing

from gemma4_towers import ACCURACY_FLOOR, FP32_CLOSE, GRIDS, KINDS, SEQ_LEN, make_inputs, tower_of
from helpers import (
    assert_as_accurate_as_stock,
    assert_bit_identical,
    assert_close,
    dtype_id,
    fallbacks_fail,
    reverting_to_stock,
)

ENCODERS = ["packed", "fused"]
REAL = [48, 40, 12, 4]  # the real patches of GRIDS + [(2, 2)]


stock_after_each_test = reverting_to_stock(revert_fused_vision_gemma4, fresh_warnings=True)


@pytest.fixture
def varlen_calls(monkeypatch):
    """The item lengths of each varlen attention call."""
    calls, varlen = [], attention.varlen_attention
    monkeypatch.setattr(attention, "varlen_attention", lambda *a, **k: calls.append(list(a[4])) or varlen(*a, **k))
    return calls


def padded_batch(tower, seed=9):
    """What vLLM hands the encoder: the embedder's (B, N, D) rows, the real-row mask and the ids."""
    pixels, ids = make_inputs(GRIDS + [(2, 2)], SEQ_LEN, seed=seed)
    padding = (ids == -1).all(-1)
    with torch.no_grad():
        embedded = tower.patch_embedder(pixels.to(tower.dtype), ids, padding)
    return embedded, ~padding, ids


def encode(tower, embedded, valid, ids):
    with torch.no_grad():
        return tower.encoder(inputs_embeds=embedded, attention_mask=valid, pixel_position_ids=ids).last_hidden_state


def assert_real_rows_match(got, stock, exact, valid, dtype):
    assert got.shape == stock.shape and got.dtype == stock.dtype
    assert not got[~valid].any(), "zeros at the padding rows, as stock's pooler makes them"
    if dtype == torch.float32:
        assert_close(got[valid], stock[valid], **FP32_CLOSE, what="real rows")
    floor = ACCURACY_FLOOR[dtype]
    assert_as_accurate_as_stock(got[valid], stock[valid], exact[valid], floor=floor, ords=(2, float("inf")))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("encoder", ENCODERS)
@pytest.mark.parametrize("kind", KINDS)
def test_the_padded_batch_runs_packed_and_matches_stock(varlen_calls, kind, encoder, dtype):
    tower = tower_of(kind, dtype)
    embedded, valid, ids = padded_batch(tower)
    stock = encode(tower, embedded, valid, ids)
    twin = copy.deepcopy(tower).double()
    exact = encode(twin, embedded.double(), valid, ids)
    apply_fused_vision_to_gemma4(tower, encoder=encoder)
    with fallbacks_fail():  # no layer falls back
        got = encode(tower, embedded, valid, ids)
    assert varlen_calls == [REAL] * 2, "each layer attends within the items' real rows"
    assert_real_rows_match(got, stock, exact, valid, dtype)


@pytest.mark.parametrize("encoder", ENCODERS)
def test_where_the_host_may_not_read_it_stays_padded(monkeypatch, varlen_calls, encoder):
    """CUDA-graph capture, torch.compile, torch's sync debug mode: no item lengths, so no packing."""
    tower = tower_of("31b_like")
    embedded, valid, ids = padded_batch(tower)
    stock = encode(tower, embedded, valid, ids)
    apply_fused_vision_to_gemma4(tower, encoder=encoder)
    monkeypatch.setattr(fl, "may_read_on_host", lambda tensor: False)
    kernels = []
    attend = padded.attend_valid_keys
    monkeypatch.setattr(padded, "attend_valid_keys", lambda valid: kernels.append(1) or attend(valid))
    got = encode(tower, embedded, valid, ids)
    assert varlen_calls == []
    if encoder == "packed":
        assert_bit_identical(got, stock, "stock's own forward")
    else:
        assert kernels == [1], "the fused layers on the padded batch"
        assert_close(got[valid], stock[valid], **FP32_CLOSE, what="real rows")


class BaseLayerWithLoRA(nn.Module):
    """Stands in for vLLM's LoRA layers (whose adapters follow each token's place in the padded batch)."""

    def __init__(self, base):
        super().__init__()
        self.base_layer = base

    def forward(self, x):
        return self.base_layer(x)


BaseLayerWithLoRA.__module__ = "vllm.lora.layers.base"


@pytest.mark.parametrize("encoder", ENCODERS)
def test_layers_that_map_rows_by_their_place_stay_padded(varlen_calls, encoder):
    tower = tower_of("e2b_like")
    embedded, valid, ids = padded_batch(tower)
    stock = encode(tower, embedded, valid, ids)
    projection = tower.encoder.layers[1].self_attn.q_proj
    projection.linear = BaseLayerWithLoRA(projection.linear)
    apply_fused_vision_to_gemma4(tower, encoder=encoder)
    got = encode(tower, embedded, valid, ids)
    assert varlen_calls == []
    assert_close(got[valid], stock[valid], **FP32_CLOSE, what="real rows")


class StandInQuantizedLinear(nn.Module):
    """A linear with a GEMM of its own (as a quantized one has): int8 weights and a per-row scale."""

    def __init__(self, linear):
        super().__init__()
        scale = linear.weight.abs().amax(dim=1, keepdim=True) / 127
        self.qweight = nn.Buffer((linear.weight / scale).round().to(torch.int8))
        self.scale = nn.Buffer(scale)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return F.linear(x, self.qweight.to(x.dtype) * self.scale.to(x.dtype))


@pytest.mark.parametrize("kind", KINDS)
def test_layers_fuse_around_linears_with_gemms_of_their_own(monkeypatch, varlen_calls, kind):
    tower = tower_of(kind)
    for layer in tower.encoder.layers:
        for clipped in (layer.self_attn.q_proj, layer.self_attn.v_proj, layer.mlp.up_proj, layer.mlp.down_proj):
            clipped.linear = StandInQuantizedLinear(clipped.linear)
        gate = layer.mlp.gate_proj.linear
        gate.bias = nn.Parameter(torch.randn(gate.out_features, device=gate.weight.device) * 0.1)
    embedded, valid, ids = padded_batch(tower)
    stock = encode(tower, embedded, valid, ids)
    apply_fused_vision_to_gemma4(tower, encoder="fused")
    kernels, op = [], fl.qkv_norm_rope
    monkeypatch.setattr(fl, "qkv_norm_rope", lambda *a, **k: kernels.append(1) or op(*a, **k))
    with fallbacks_fail():  # no layer falls back
        got = encode(tower, embedded, valid, ids)
    assert kernels == [1, 1] and varlen_calls == [REAL] * 2, "both layers fused, packed"
    quantized = [m for m in tower.modules() if isinstance(m, StandInQuantizedLinear)]
    assert [m.calls for m in quantized] == [2] * 8, "each own GEMM ran, in the stock and the fused forward"
    assert_close(got[valid], stock[valid], **FP32_CLOSE, what="real rows")


def test_an_eager_tower_packs_too_and_a_padded_item_is_no_row(varlen_calls):
    """Eager towers attend within each item as sdpa ones do; an item with no real row packs to nothing."""
    tower = tower_of("31b_like", attention_implementation="eager")
    embedded, valid, ids = padded_batch(tower)
    valid[2] = False
    stock = encode(tower, embedded, valid, ids)
    apply_fused_vision_to_gemma4(tower, encoder="packed")
    got = encode(tower, embedded, valid, ids)
    assert varlen_calls == [[48, 40, 0, 4]] * 2
    assert not got[2].any()
    assert_close(got[valid], stock[valid], **FP32_CLOSE, what="real rows")


def test_the_revert_gives_stock_back_bit_for_bit():
    tower = tower_of("e2b_like")
    embedded, valid, ids = padded_batch(tower)
    stock = encode(tower, embedded, valid, ids)
    apply_fused_vision_to_gemma4(tower, encoder="fused")
    encode(tower, embedded, valid, ids)
    revert_fused_vision_gemma4()
    assert_bit_identical(encode(tower, embedded, valid, ids), stock)


def test_vllms_flash_attention_runs_where_flash_attn_is_missing(monkeypatch, caplog):
    """vLLM ships its own varlen kernel (its argument order: max_seqlen_q before cu_seqlens_q), not flash-attn."""
    packing, calls = Packing.of([3, 2], "cpu"), []

    def vllm_varlen(
        q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k=None, softmax_scale=None, fa_version=2
    ):
        calls.append((max_seqlen_q, cu_seqlens_q.tolist(), max_seqlen_k, cu_seqlens_k.tolist(), softmax_scale))
        return attention.varlen_attention(q, k, v, cu_seqlens_q, packing.lengths, max_seqlen_q, scale=1.0, path="sdpa")

    monkeypatch.setattr(varlen, "_flash_inputs", lambda query, max_head_dim: True)
    monkeypatch.setattr(varlen, "_capability", lambda query: (8, 0))
    for name, load in (("flash_attn", None), ("vllm_flash_attn", vllm_varlen)):
        monkeypatch.setitem(varlen.PATHS, name, dataclasses.replace(varlen.PATHS[name], load=lambda load=load: load))
    varlen._log_path.cache_clear()
    query, key, value = torch.randn(3, 5, 2, 72).unbind(0)
    assert attention.attention_path(query) == "vllm_flash_attn"
    with caplog.at_level("INFO", logger="fused_vision"):
        got = packing.attend(query, key, value, scale=1.0)
    assert calls == [(3, [0, 3, 5], 3, [0, 3, 5], 1.0)]
    assert "the packed attention runs vllm_flash_attn" in caplog.text
    expected = attention.varlen_attention(query, key, value, packing.cu_seqlens, [3, 2], 3, scale=1.0, path="sdpa")
    assert_bit_identical(got, expected)
