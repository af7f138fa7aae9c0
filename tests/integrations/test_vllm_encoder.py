"""The packed and fused encoder inside vLLM's own Gemma 4 model (vLLM 0.33 and 0.34), built by vLLM on the CPU.

vLLM calls the tower's encoder itself on padded batches, with its own ``ReplicatedLinear``s in the layers.
Each path is judged against vLLM's stock run of the same model: fp32 within 1e-5, bf16 no worse than 1.5x
stock's error against a float64 twin; counters prove what ran. Skips without vLLM (tests/integrations/vllm_models.py).
"""

import sys

import pytest
import torch
import torch.nn.functional as F

import fused_vision.encoder.fused_layer as fl
import fused_vision.integrations.vllm as fv
from fused_vision import (
    apply_fused_vision_to_gemma4,
    apply_fused_vision_to_vllm_gemma4,
    revert_fused_vision_gemma4,
    revert_fused_vision_vllm_gemma4,
)
from fused_vision.encoder import attention, joined_weights, mlp
from fused_vision.pipeline import planner

from gemma4_towers import ACCURACY_FLOOR, FP32_CLOSE
from helpers import assert_as_accurate_as_stock, assert_bit_identical, assert_close, fallbacks_fail, reverting_to_stock
from vllm_models import (  # noqa: F401 (the fixtures)
    GiB,
    build_vllm_model,
    gemma4_mm,
    image_input,
    items,
    memory,
    model_class,
    needs_vllm,
    run,
    tiny_model,
    video_input,
    vllm_process,
)

pytestmark = needs_vllm
ENCODERS = ["packed", "fused"]
METHODS = ["_process_image_input", "_process_video_input", "encoder_eager_forward"]


stock_after_each_test = reverting_to_stock(
    revert_fused_vision_vllm_gemma4, revert_fused_vision_gemma4, fresh_warnings=True
)


@pytest.fixture
def ran(monkeypatch):
    """What ran: each packed attention's item lengths, and the fused layers (their q/k/v pass)."""
    calls = {"packed": [], "fused": 0}
    varlen, fused = attention.varlen_attention, fl.qkv_norm_rope

    def count_fused(*args, **kwargs):
        calls["fused"] += 1
        return fused(*args, **kwargs)

    monkeypatch.setattr(
        attention, "varlen_attention", lambda *a, **k: calls["packed"].append(list(a[4])) or varlen(*a, **k)
    )
    monkeypatch.setattr(fl, "qkv_norm_rope", count_fused)
    return calls


def mm_inputs(model, method, seed):
    """What ``method`` takes, and the real patches of its items: images of two buckets, or two videos of 2 and
    3 frames; the CUDA-graph path's eager fallback takes the raw keywords of images."""
    if method == "_process_video_input":
        inputs = video_input(model, [2, 3], 64, seed)
        ids = list(inputs["pixel_position_ids_videos"])
    elif method == "_process_image_input":
        inputs = image_input(model, seed)
        ids = list(inputs["pixel_position_ids"])
    else:
        pixels, ids = items([(8, 6), (4, 10), (6, 2)], 64, seed)
        inputs = dict(pixel_values=pixels, pixel_position_ids=ids)
    return inputs, sorted(int((~(i == -1).all(-1)).sum()) for i in ids)


def embeddings(model, method, inputs):
    *_, out = run(model, method, inputs)
    return [out] if isinstance(out, torch.Tensor) else out


def float64_twin(model, directory):
    """The same model in float64 (vLLM's parameters do not deep-copy): built again by vLLM, loaded, cast."""
    twin = build_vllm_model(directory, model.vision_tower.config, torch.float32)
    twin.load_state_dict(model.state_dict())
    twin.double().model_dtype = torch.float64  # vLLM casts the embedder's output to it
    return twin


def exact_embeddings(model, method, inputs, directory):
    """The float64 twin's embeddings, which low-precision runs are judged against; None in fp32."""
    if model.model_dtype == torch.float32:
        return None
    return embeddings(float64_twin(model, directory), method, inputs)


def assert_embeddings_match(got, stock, exact):
    """fp32 within 1e-5 of stock; other dtypes no worse than 1.5x stock's error against ``exact``, the float64
    twin's."""
    assert len(got) == len(stock)
    for index, (g, s) in enumerate(zip(got, stock, strict=True)):
        assert g.shape == s.shape and g.dtype == s.dtype, f"item {index}"
        if s.dtype == torch.float32:
            assert_close(g, s, **FP32_CLOSE, what=f"item {index}")
        else:
            floor = ACCURACY_FLOOR[s.dtype]
            assert_as_accurate_as_stock(g, s, exact[index], floor=floor, ords=(2, float("inf")), what=f"item {index}")


def encoder_linears(model):
    return [m.linear for layer in model.vision_tower.encoder.layers for m in layer.modules() if hasattr(m, "linear")]


@pytest.mark.parametrize("encoder", ENCODERS)
@pytest.mark.parametrize("method", METHODS, ids=["images", "video", "eager_fallback"])
def test_vllms_paths_run_the_packed_encoder_and_match_stock(tiny_model, memory, ran, tmp_path, method, encoder):
    linears = encoder_linears(tiny_model)
    assert {type(m).__name__ for m in linears} == {"ReplicatedLinear"}, "vLLM's own linears"
    assert {type(m.weight).__name__ for m in linears} == {"ModelWeightParameter"}
    inputs, real = mm_inputs(tiny_model, method, seed=21)
    stock, exact = embeddings(tiny_model, method, inputs), exact_embeddings(tiny_model, method, inputs, tmp_path)
    assert ran == {"packed": [], "fused": 0}
    apply_fused_vision_to_gemma4()
    assert apply_fused_vision_to_vllm_gemma4(encoder=encoder) == 5, "the tower's four classes and vLLM's"
    with fallbacks_fail():  # no layer falls back
        got = embeddings(tiny_model, method, inputs)
    assert sorted(length for call in ran["packed"] for length in call) == real, "every item packed, padding dropped"
    assert ran["fused"] == (len(ran["packed"]) if encoder == "fused" else 0), "one fused layer per encoder call"
    assert_embeddings_match(got, stock, exact)


class ReplicatedLinearWithLoRAStandIn:
    """vLLM's ``ReplicatedLinearWithLoRA`` around the linear, its adapters (mapped per padded token) left out."""

    @staticmethod
    def wrap(linear):
        from vllm.lora.layers.replicated_linear import ReplicatedLinearWithLoRA

        class StandIn(ReplicatedLinearWithLoRA):
            def forward(self, input_):
                return self.base_layer(input_)

        return StandIn(linear)


@pytest.mark.parametrize("encoder", ENCODERS)
def test_under_mm_lora_and_capture_it_stays_padded(tiny_model, memory, ran, monkeypatch, tmp_path, encoder):
    inputs, _ = mm_inputs(tiny_model, "_process_image_input", seed=22)
    stock = embeddings(tiny_model, "_process_image_input", inputs)
    exact = exact_embeddings(tiny_model, "_process_image_input", inputs, tmp_path)
    apply_fused_vision_to_gemma4()
    apply_fused_vision_to_vllm_gemma4(encoder=encoder)
    with pytest.MonkeyPatch.context() as capture:
        capture.setattr(fl, "may_read_on_host", lambda tensor: False)  # as under CUDA-graph capture
        captured = embeddings(tiny_model, "_process_image_input", inputs)
    up_proj = tiny_model.vision_tower.encoder.layers[0].mlp.up_proj
    monkeypatch.setattr(tiny_model, "_enable_mm_lora", True)
    monkeypatch.setattr(tiny_model.config.vision_config, "default_output_length", 16, raising=False)
    linear, up_proj.linear = up_proj.linear, ReplicatedLinearWithLoRAStandIn.wrap(up_proj.linear)
    try:
        lora = embeddings(tiny_model, "_process_image_input", inputs)
    finally:
        up_proj.linear = linear
    assert ran["packed"] == [], "neither packed"
    assert ran["fused"] == (3 if encoder == "fused" else 0), "the padded fused layers: two buckets, then one call"
    for got in (captured, lora):
        assert_embeddings_match(got, stock, exact)


class StandInQuantizedMethod:
    """A quantized linear method's part the layer sees: ``apply`` with a GEMM of its own (int8 weights)."""

    def __init__(self, weight):
        self.scale = weight.abs().amax(dim=1, keepdim=True).float() / 127
        self.qweight = (weight.float() / self.scale).round().to(torch.int8)
        self.calls = 0

    def apply(self, layer, x, bias=None):
        self.calls += 1
        return F.linear(x, (self.qweight.float() * self.scale).to(x.dtype), bias)


@pytest.mark.parametrize("mlp_blocks", [False, True], ids=["whole", "mlp_blocks"])
def test_a_quantized_linear_keeps_its_gemm_and_the_layer_fuses_around_it(
    tiny_model, memory, ran, monkeypatch, tmp_path, mlp_blocks
):
    inputs, _ = mm_inputs(tiny_model, "_process_video_input", seed=23)
    twin = float64_twin(tiny_model, tmp_path) if tiny_model.model_dtype != torch.float32 else None
    methods, names = [], ("self_attn.k_proj", "mlp.gate_proj", "mlp.down_proj")
    for name in names:
        linear = tiny_model.vision_tower.encoder.layers[0].get_submodule(name).linear
        methods.append(StandInQuantizedMethod(linear.weight))
        monkeypatch.setattr(linear, "quant_method", methods[-1])
        if twin is not None:  # the twin computes with the dequantized weights, in float64
            with torch.no_grad():
                weight = twin.vision_tower.encoder.layers[0].get_submodule(name).linear.weight
                weight.copy_(methods[-1].qweight.double() * methods[-1].scale.double())
    stock = embeddings(tiny_model, "_process_video_input", inputs)
    exact = None if twin is None else embeddings(twin, "_process_video_input", inputs)
    apply_fused_vision_to_gemma4()
    apply_fused_vision_to_vllm_gemma4(encoder="fused")
    if mlp_blocks:  # the MLP on blocks of 7 rows: vLLM's linears name their sizes otherwise than torch's
        monkeypatch.setattr(mlp, "MLP_BLOCK_BYTES", 1)
        monkeypatch.setattr(mlp, "MLP_MIN_BLOCK_ROWS", 7)
    with fallbacks_fail():
        got = embeddings(tiny_model, "_process_video_input", inputs)
    assert ran["fused"] == 1 and len(ran["packed"]) == 1, "the layer fused, packed"
    k_calls, *mlp_calls = (m.calls for m in methods)
    assert k_calls == 2, "the quantized k GEMM ran, stock and fused"
    if mlp_blocks:
        assert min(mlp_calls) > 2 and mlp_calls[0] == mlp_calls[1], "the MLP's GEMMs ran once per block"
    else:
        assert mlp_calls == [2, 2], "each quantized MLP GEMM ran, stock and fused"
    assert_embeddings_match(got, stock, exact)


def test_shared_weights_survive_vllms_weight_loading(tiny_model, memory, tmp_path):
    inputs, _ = mm_inputs(tiny_model, "_process_video_input", seed=24)
    apply_fused_vision_to_gemma4()
    apply_fused_vision_to_vllm_gemma4(encoder="fused")
    embeddings(tiny_model, "_process_video_input", inputs)
    layer = tiny_model.vision_tower.encoder.layers[0]
    shared = layer.__dict__[joined_weights._SHARED]
    assert set(shared) == {"qkv", "gate_up"}, "both GEMMs concatenated on vLLM's linears"
    generator = torch.Generator().manual_seed(25)
    fresh = {
        name: (torch.randn(p.shape, generator=generator) * 0.2).to(p.dtype)
        for name, p in tiny_model.vision_tower.named_parameters()
        if name.startswith("encoder.") and name.endswith("linear.weight")
    }
    loaded = tiny_model.load_weights((f"model.vision_tower.{name}", w) for name, w in fresh.items())
    assert {f"vision_tower.{name}" for name in fresh} <= loaded
    assert joined_weights._views_of(
        shared["qkv"], [getattr(layer.self_attn, p).linear.weight for p in ("q_proj", "k_proj", "v_proj")]
    )
    assert joined_weights._views_of(
        shared["gate_up"], [getattr(layer.mlp, p).linear.weight for p in ("gate_proj", "up_proj")]
    )
    q_weight = fresh["encoder.layers.0.self_attn.q_proj.linear.weight"]
    assert_bit_identical(shared["qkv"][: q_weight.shape[0]], q_weight, "the loaded q weight")
    got = embeddings(tiny_model, "_process_video_input", inputs)
    revert_fused_vision_vllm_gemma4()
    revert_fused_vision_gemma4()
    assert not joined_weights._SHARING, "the revert unshares"
    expected = embeddings(tiny_model, "_process_video_input", inputs)
    assert_embeddings_match(got, expected, exact_embeddings(tiny_model, "_process_video_input", inputs, tmp_path))


def test_the_revert_gives_stock_back_bit_for_bit(tiny_model, memory):
    inputs, _ = mm_inputs(tiny_model, "_process_image_input", seed=26)
    stock = embeddings(tiny_model, "_process_image_input", inputs)
    apply_fused_vision_to_gemma4()
    apply_fused_vision_to_vllm_gemma4(encoder="fused")
    embeddings(tiny_model, "_process_image_input", inputs)
    revert_fused_vision_vllm_gemma4()
    revert_fused_vision_gemma4()
    for got, expected in zip(embeddings(tiny_model, "_process_image_input", inputs), stock, strict=True):
        assert_bit_identical(got, expected)


def test_the_chunk_prices_the_packed_encoder(tiny_model):
    patches, free, total = 64, 3 * GiB, 22 * GiB
    config, dtype = tiny_model.vision_tower.config, tiny_model.model_dtype
    priced = {
        encoder: planner.plan(
            sys.maxsize, patches, config, free_bytes=free, total_bytes=total, dtype=dtype, encoder=encoder
        )
        for encoder in ("stock", "packed")
    }
    assert priced["packed"] > priced["stock"], "no (N, N) mask: more items per call"
    apply_fused_vision_to_gemma4()
    apply_fused_vision_to_vllm_gemma4()
    assert tiny_model._encoder_chunk(patches, free, total, 64) == priced["stock"]
    for encoder in ENCODERS:
        apply_fused_vision_to_vllm_gemma4(encoder=encoder)
        assert tiny_model._encoder_chunk(patches, free, total, 64) == priced["packed"], encoder


def test_the_guard_wraps_each_releases_innermost_encoding_calls():
    apply_fused_vision_to_vllm_gemma4()
    cls, local = model_class(), hasattr(model_class(), "_process_image_input_local")
    for name in ("_process_image_input", "_process_video_input"):
        guarded = f"{name}_local" if local else name
        assert isinstance(vars(cls)[guarded], fv.patching.InstanceMethod), guarded
        if local:  # 0.34: the dispatcher, which enters the collectives in data-parallel mode, stays vLLM's
            assert not isinstance(vars(cls)[name], fv.patching.InstanceMethod)


def test_in_data_parallel_mode_a_rank_re_runs_before_the_collectives(tiny_model, memory, monkeypatch):
    if not hasattr(model_class(), "_dp_execute_and_gather"):
        pytest.skip(f"vLLM {gemma4_mm.__name__} has no data-parallel encoder mode (0.34+)")
    from gemma4_towers import out_of_memory_above

    collectives = []
    for name in ("tensor_model_parallel_all_reduce", "tensor_model_parallel_all_gather"):
        monkeypatch.setattr(gemma4_mm, name, lambda tensor, *a, _n=name, **k: collectives.append(_n) or tensor)
    monkeypatch.setattr(tiny_model, "use_data_parallel", True)
    inputs, _ = mm_inputs(tiny_model, "_process_video_input", seed=27)
    apply_fused_vision_to_gemma4()
    apply_fused_vision_to_vllm_gemma4()
    *_, unconstrained = run(tiny_model, "_process_video_input", inputs)
    collectives.clear()
    called = out_of_memory_above(monkeypatch, tiny_model.vision_tower.encoder, limit=2)
    with pytest.warns(RuntimeWarning, match="_process_video_input_local ran out of memory at 5 items"):
        *_, got = run(tiny_model, "_process_video_input", inputs)
    assert called == [5, 2, 2, 1]
    assert collectives == ["tensor_model_parallel_all_reduce", "tensor_model_parallel_all_gather"], "entered once"
    for g, e in zip(got, unconstrained, strict=True):
        assert_bit_identical(g, e)
