"""The fused encoder layer (fused_vision.encoder.fused_layer, ``encoder="fused"``) against transformers' own tower.

Every item is judged against stock run on that item alone, and against a float64 twin: fp32 within 1e-5
of stock, each dtype no less accurate than stock (1.5x slack, a floor of the dtype's rounding). Towers at
both real head sizes (E2B/E4B-like: clipped linears, head_dim 64; 26B/31B-like: head_dim 72).
"""

import copy

import pytest
import torch
from torch import nn

import fused_vision.kernels.gelu_gate
import fused_vision.kernels.qkv_norm_rope
import fused_vision.kernels.residual_rms_norm
from fused_vision import _dispatch, apply_fused_vision_to_gemma4, encode_images, revert_fused_vision_gemma4
from fused_vision.encoder import packed

from gemma4_towers import (
    FP32_CLOSE,
    GRIDS,
    KINDS,
    SEQ_LEN,
    SIZES,
    adapted,
    alone,
    alone_in_float64,
    assert_gradients_match_stock,
    assert_items_match,
    compiled_fullgraph_soft_tokens,
    fused_ops,
    make_inputs,
    mixed_items,
    processor_batch,
    run_tower,
    tower_of,
)
from helpers import DEVICE, assert_bit_identical, assert_close, dtype_id, fallbacks_fail, reverting_to_stock

KERNELS = {
    "qkv_norm_rope": fused_vision.kernels.qkv_norm_rope,
    "residual_rms_norm": fused_vision.kernels.residual_rms_norm,
    "gelu_gate": fused_vision.kernels.gelu_gate,
}
FUSED_LAYER_KERNELS = ["qkv_norm_rope", "residual_rms_norm", "gelu_gate", "residual_rms_norm"]


stock_after_each_test = reverting_to_stock(revert_fused_vision_gemma4, fresh_warnings=True)


@pytest.fixture
def kernel_calls(monkeypatch):
    """The layer kernels launched, in order (none where the ops run their reference: no Triton here)."""
    if not _dispatch.triton_drives(DEVICE):
        pytest.skip("Triton does not drive this device")
    calls = []
    for name, module in KERNELS.items():
        launch = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _launch=launch, _name=name: calls.append(_name) or _launch(*a))
    return calls


def case_id(value):
    return dtype_id(value) if isinstance(value, torch.dtype) else value


def fused(tower):
    apply_fused_vision_to_gemma4(tower, encoder="fused")
    return tower


def storages(module: nn.Module) -> dict[int, int]:
    """Bytes of each distinct storage behind the module's parameters."""
    return {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in module.parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=dtype_id)
@pytest.mark.parametrize("kind", KINDS)
def test_items_of_any_size_in_one_call_match_stock_alone(poisoned, kernel_calls, kind, dtype):
    tower = tower_of(kind, dtype)
    pixels, ids = mixed_items()
    stock = alone(tower, pixels, ids)
    exact = alone_in_float64(tower, pixels, ids)
    with fallbacks_fail():  # no layer falls back
        got = encode_images(fused(tower), pixels, ids)
    assert kernel_calls == FUSED_LAYER_KERNELS * 2, "both layers fused, one call for every item"
    assert_items_match(got, stock, exact, dtype)


@pytest.mark.parametrize("kind", KINDS)
def test_the_gate_up_epilogue_runs_where_asked_and_matches_stock(poisoned, kernel_calls, monkeypatch, kind):
    """With FUSED_VISION_GATE_UP_EPILOGUE=1 each layer's gate/up GEMM carries the GELU gate (one launch of
    the GEMM kernel a layer, none of the separate gate kernel), and the items stay as accurate as stock's."""
    import fused_vision.kernels.gate_up_gelu as gemm_kernels

    dtype = torch.bfloat16  # the GEMM kernel's dtypes: float32 keeps cuBLAS and the gate kernel
    tower = tower_of(kind, dtype)
    pixels, ids = mixed_items()
    stock = alone(tower, pixels, ids)
    exact = alone_in_float64(tower, pixels, ids)
    launches, launch = [], gemm_kernels.gate_up_gelu
    monkeypatch.setattr(gemm_kernels, "gate_up_gelu", lambda *a: launches.append(a[0].shape) or launch(*a))
    monkeypatch.setenv("FUSED_VISION_GATE_UP_EPILOGUE", "1")
    with fallbacks_fail():
        got = encode_images(fused(tower), pixels, ids)
    assert len(launches) == 2, "one epilogue GEMM per layer"
    assert "gelu_gate" not in kernel_calls and kernel_calls.count("qkv_norm_rope") == 2
    assert_items_match(got, stock, exact, dtype)
    monkeypatch.setenv("FUSED_VISION_GATE_UP_EPILOGUE", "2")
    with pytest.raises(ValueError, match="FUSED_VISION_GATE_UP_EPILOGUE='2': expected one of 1, true, yes, on, 0"):
        encode_images(tower, pixels, ids)


# Each head size in one dtype (the interpreter is slow); every dtype of both is the mixed items' test above.
@pytest.mark.parametrize(("kind", "dtype"), [("31b_like", torch.float32), ("e2b_like", torch.bfloat16)], ids=case_id)
def test_processor_images_of_two_budgets_and_video_frames(kind, dtype):
    # Two images of 70 soft tokens, one of 140, two frames: the interpreter takes time by the rows.
    pixels70, ids70, _ = processor_batch(SIZES[1:], 70, seed=12)
    pixels140, ids140, _ = processor_batch([(30, 90)], 140, seed=13)
    frames, frame_ids, _ = processor_batch([(36, 64)] * 2, 70, seed=14)
    pixels, ids = [*pixels70, *pixels140, *frames], [*ids70, *ids140, *frame_ids]
    positions = max(int(i.max()) for i in ids) + 1
    tower = tower_of(kind, dtype, patch_size=4, positions=positions)
    stock = alone(tower, pixels, ids)
    exact = alone_in_float64(tower, pixels, ids)
    assert_items_match(encode_images(fused(tower), pixels, ids), stock, exact, dtype)


@pytest.mark.parametrize("kind", KINDS)
def test_the_patched_tower_forward_returns_stock_outputs_and_reverts(kind):
    tower = tower_of(kind)
    pixels, ids = make_inputs(GRIDS + [(2, 2)], SEQ_LEN, seed=9)
    stock = tower(pixel_values=pixels, pixel_position_ids=ids)
    before = storages(tower)
    assert apply_fused_vision_to_gemma4(tower, encoder="fused") == 4, "the tower, its encoder, embedder, pooler"
    assert "fused_encoder(backend=auto)" in fused_ops(tower)
    got = tower(pixel_values=pixels, pixel_position_ids=ids)
    assert type(got) is type(stock) and list(got.keys()) == list(stock.keys())
    assert_close(got.last_hidden_state, stock.last_hidden_state, **FP32_CLOSE, what="soft tokens")
    assert sum(storages(tower).values()) == sum(before.values()), "the concatenated weights replace the originals"

    assert revert_fused_vision_gemma4(tower) == 4
    assert len(storages(tower)) == len(before), "each parameter owns its storage again"
    assert_bit_identical(run_tower(tower, pixels, ids), stock.last_hidden_state, "reverted")


def test_weights_are_shared_and_follow_changes():
    tower = tower_of("31b_like")
    attn = tower.encoder.layers[0].self_attn
    parameters = [attn.q_proj.linear.weight, attn.k_proj.linear.weight, attn.v_proj.linear.weight]
    fused(tower)
    shared = tower.encoder.layers[0]._fused_vision_weights["qkv"]
    assert [p.data_ptr() for p in parameters] == [shared[r].data_ptr() for r in (0, 144, 288)]
    assert parameters[0] is attn.q_proj.linear.weight, "the same Parameter objects"

    pixels, ids = mixed_items()
    reference = tower_of("31b_like")
    with torch.no_grad():  # an in-place update reaches the GEMM through the views
        attn.q_proj.linear.weight.mul_(1.5)
        reference.encoder.layers[0].self_attn.q_proj.linear.weight.mul_(1.5)
    assert_items_match(encode_images(tower, pixels, ids), *[alone(reference, pixels, ids)] * 2, torch.float32)
    replaced = torch.randn_like(attn.k_proj.linear.weight)  # a replaced weight is concatenated again
    attn.k_proj.linear.weight = nn.Parameter(replaced.clone())
    reference.encoder.layers[0].self_attn.k_proj.linear.weight = nn.Parameter(replaced.clone())
    assert_items_match(encode_images(tower, pixels, ids), *[alone(reference, pixels, ids)] * 2, torch.float32)
    shared = tower.encoder.layers[0]._fused_vision_weights["qkv"]
    assert attn.k_proj.linear.weight.data_ptr() == shared[144].data_ptr()


def test_a_fused_tower_saves_and_loads(tmp_path):
    tower = fused(tower_of("e2b_like"))
    expected = {name: t.clone() for name, t in tower.state_dict().items()}
    tower.save_pretrained(tmp_path)
    loaded = type(tower).from_pretrained(tmp_path).state_dict()
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert_bit_identical(loaded[name].to(tensor.device), tensor, name)


def test_unlike_input_clamps_project_one_by_one(monkeypatch):
    """Also where a clamp changes in place after a call, which cached its layer's clamps as alike."""
    tower = tower_of("e2b_like")
    unlike = copy.deepcopy(tower)
    with torch.no_grad():
        unlike.encoder.layers[0].self_attn.k_proj.input_min.fill_(-0.3)
    pixels, ids = mixed_items()
    stock = alone(unlike, pixels, ids)
    encode_images(fused(tower), pixels, ids)
    with torch.no_grad():
        tower.encoder.layers[0].self_attn.k_proj.input_min.fill_(-0.3)
    rows, linear = [], torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda x, w, *a: rows.append(w.shape[0]) or linear(x, w, *a))
    got = encode_images(tower, pixels, ids)
    qkv, hidden, gate_up = 3 * 2 * 64, 32, 2 * 64
    per_layer = lambda projections: [*projections, hidden, gate_up, hidden]  # then o_proj, gate/up, down_proj
    assert rows == per_layer([128, 128, 128]) + per_layer([qkv]), "layer 0 one GEMM per projection"
    assert_items_match(got, stock, stock, torch.float32)


def test_the_packed_encoder_takes_its_backend_with_the_call(monkeypatch):
    """``packed.encode`` runs the fused layers where it is handed a backend, on a tower never patched, and
    the tower's own layers without one, on a tower patched to fuse: nothing is read from the patch."""
    from fused_vision.encoder import fused_layer

    tower = tower_of("31b_like")
    pixels, ids = mixed_items()
    stock = alone(tower, pixels, ids)
    layers, real_layer = [], fused_layer._fused_layer
    monkeypatch.setattr(fused_layer, "_fused_layer", lambda *a, **k: layers.append(k["backend"]) or real_layer(*a, **k))
    with torch.no_grad():
        got = packed.encode(tower, pixels, ids, True, backend="reference")
        assert layers == ["reference"] * tower.config.num_hidden_layers, "every layer fused, on the given backend"
        layers.clear()
        unfused = packed.encode(fused(tower), pixels, ids, True, backend=None)
    assert layers == [], "no layer fused"
    assert_items_match(got, stock, stock, torch.float32)
    assert_items_match(unfused, stock, stock, torch.float32)


def test_grouped_kv_heads_match_stock():
    """No Gemma 4 tower groups its heads (encode_images' planner refuses them); the layer computes them right."""
    tower = tower_of("31b_like", num_attention_heads=4, num_key_value_heads=2)
    pixels, ids = mixed_items()
    stock = alone(tower, pixels, ids)
    with torch.no_grad():
        assert_items_match(packed.encode(fused(tower), pixels, ids, True, backend="auto"), stock, stock, torch.float32)


@pytest.mark.parametrize("kind", ["e2b_like"])  # the clipped linears: the blocks' clamps too
def test_the_mlp_in_blocks_of_rows_computes_what_it_computes_whole(kind, monkeypatch):
    """Where no graph is kept the MLP runs on blocks of rows (its transients a block's): blocks of 128 rows
    here over 20 items of 64 and 16 patches (512 real), then blocks of 200, uneven, over the same items."""
    from fused_vision.encoder import fused_layer, mlp

    tower = fused(tower_of(kind))
    pixels, ids = mixed_items()
    pixels, ids = pixels * 4, ids * 4
    blocks = []
    real_mlp = fused_layer._mlp

    def counted(layer, y, backend):
        block = mlp.mlp_block_rows(layer.self_attn.config.intermediate_size, y.element_size())
        blocks.append(-(-y.shape[0] // block) if y.shape[0] > block else 1)
        return real_mlp(layer, y, backend)

    monkeypatch.setattr(fused_layer, "_mlp", counted)
    with torch.no_grad():
        whole = packed.encode(tower, pixels, ids, True, backend="auto")  # the default block: the whole call
        monkeypatch.setattr(mlp, "MLP_BLOCK_BYTES", 1)
        monkeypatch.setattr(mlp, "MLP_MIN_BLOCK_ROWS", 128)
        got = packed.encode(tower, pixels, ids, True, backend="auto")
        monkeypatch.setattr(mlp, "MLP_MIN_BLOCK_ROWS", 200)  # 200 // 128 * 128 is not it: at least 200
        uneven = packed.encode(tower, pixels, ids, True, backend="auto")
    assert blocks == [1, 1, 4, 4, 3, 3], "two layers each: whole, 4 blocks of 128, then 200, 200, 112"
    for index, (g, u, w) in enumerate(zip(got, uneven, whole, strict=True)):
        assert_close(g, w, **FP32_CLOSE, what=f"item {index}")
        assert_close(u, w, **FP32_CLOSE, what=f"item {index}, uneven blocks")


def test_a_lora_adapted_layer_fuses_around_its_linear_and_trains():
    stock_tower = adapted(tower_of("31b_like"))
    tower = copy.deepcopy(stock_tower)
    fused(tower)
    pixels, ids = make_inputs(GRIDS, SEQ_LEN, seed=11)
    grads, outputs = [], []
    for model in (stock_tower, tower):
        with fallbacks_fail():  # the adapted layer runs fused too
            out = model(pixel_values=pixels, pixel_position_ids=ids).last_hidden_state
        out.square().mean().backward()
        outputs.append(out.detach())
        adapter = model.encoder.layers[1].self_attn.q_proj.linear
        grads.append((adapter.down.grad, adapter.up.grad))
    assert_close(outputs[1], outputs[0], **FP32_CLOSE, what="soft tokens")
    for got, expected in zip(grads[1], grads[0]):
        assert_close(got, expected, rtol=1e-4, atol=1e-6, what="adapter gradient")


@pytest.mark.parametrize("condition", ["forward hook", "float64", "autocast"])
def test_layers_that_cannot_run_fused_run_stock_code_with_one_warning(condition):
    tower = tower_of("31b_like")
    pixels, ids = mixed_items()
    calls, context = [], torch.no_grad()
    if condition == "forward hook":
        tower.encoder.layers[1].mlp.up_proj.register_forward_hook(lambda *args: calls.append(1))
        expected = r"layer\(s\) 1 run stock code: mlp.up_proj has forward hooks"
    elif condition == "float64":
        tower, pixels = tower.double(), [p.double() for p in pixels]
        expected = r"layer\(s\) 0, 1 run stock code: hidden states of dtype torch.float64"
    else:
        context = torch.autocast(DEVICE.type, dtype=torch.bfloat16)
        expected = r"layer\(s\) 0, 1 run stock code: autocast"
    with context:
        stock = packed.encode(tower, pixels, ids, True)  # the packed encoder, stock layers
    calls.clear()
    fused(tower)
    with context, pytest.warns(RuntimeWarning, match=expected):
        got = packed.encode(tower, pixels, ids, True, backend="auto")
    with context, fallbacks_fail():  # once
        packed.encode(tower, pixels, ids, True, backend="auto")
    for index, (g, s) in enumerate(zip(got, stock, strict=True)):
        assert_close(g.detach(), s.detach(), **FP32_CLOSE, what=f"item {index}")
    assert calls == [1] * 2 if condition == "forward hook" else not calls


@pytest.mark.parametrize("kind", KINDS)
def test_gradients_through_the_fused_tower_match_stock(kind):
    stock_tower = tower_of(kind)
    tower = fused(copy.deepcopy(stock_tower))
    pixels, ids = make_inputs(GRIDS, SEQ_LEN, seed=11)
    assert_gradients_match_stock(stock_tower, tower, pixels, ids)


@pytest.mark.parametrize("kind", KINDS)
def test_the_encoder_called_itself_runs_fused_layers_on_its_padded_batch(fused_layers, kind):
    """As torch.compile's trace of the tower and engines that call the submodules reach it."""
    tower = tower_of(kind)
    pixels, ids = make_inputs(GRIDS, SEQ_LEN, seed=3)
    valid = ~(ids == -1).all(-1)
    with torch.no_grad():
        embeds = tower.patch_embedder(pixels, ids, ~valid)
        stock = tower.encoder(inputs_embeds=embeds, attention_mask=valid, pixel_position_ids=ids).last_hidden_state
        fused(tower)
        got = tower.encoder(inputs_embeds=embeds, attention_mask=valid, pixel_position_ids=ids).last_hidden_state
    assert len(fused_layers) == 2
    assert_close(got[valid], stock[valid], **FP32_CLOSE, what="real rows")


@pytest.mark.parametrize("kind", KINDS)
def test_the_fused_tower_compiles_fullgraph_forward_and_backward(fused_layers, kind):
    """Under torch.compile the tower's forward runs padded (packing reads lengths on the host), its layers
    fused: with stock's one break captured as a dynamic-shape op, one graph."""
    tower = tower_of(kind)
    pixels, ids = make_inputs(GRIDS, SEQ_LEN)
    with torch.no_grad():
        stock = run_tower(tower, pixels, ids)
    fused(tower)
    compiled = compiled_fullgraph_soft_tokens(tower, pixels, ids)
    assert fused_layers == [1, 1], "traced through the fused layers"
    assert_close(compiled, stock, **FP32_CLOSE, what="fullgraph tower")
    assert tower.encoder.layers[0].self_attn.q_proj.linear.weight.grad is not None


def test_recording_hidden_states_once_leaves_the_layers_fused(fused_layers):
    """transformers 5.10+ keeps its output-capturing hooks on the layers after a recording forward; idle,
    they do not stop the fused layers."""
    tower = fused(tower_of("31b_like"))
    pixels, ids = make_inputs(GRIDS, SEQ_LEN)
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="records hidden states or attentions"):
        recorded = tower(pixel_values=pixels, pixel_position_ids=ids, output_hidden_states=True)
    assert recorded.hidden_states is not None and not fused_layers, "recording runs stock"
    with fallbacks_fail():
        got = run_tower(tower, pixels, ids)
    assert fused_layers == [1, 1]
    assert_close(got, recorded.last_hidden_state, **FP32_CLOSE, what="soft tokens")
