"""fused_vision.gemma4 against transformers' own Gemma 4 vision tower, on tiny random configs.

Runs against whichever transformers is importable: the newest (F.embedding era, 5.10+) in the test
environment, and transformers 5.5-5.9 (one-hot era) through ``test_onehot_era_transformers``, which
reruns this file in a subprocess with FUSED_VISION_TRANSFORMERS_ONEHOT on PYTHONPATH.
"""

import copy
import importlib.metadata
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from conftest import DEVICE, assert_as_accurate_as_stock, assert_bit_identical, assert_close, dtype_id

transformers = pytest.importorskip("transformers")
modeling = pytest.importorskip("transformers.models.gemma4.modeling_gemma4")

import fused_vision.gemma4 as fg  # noqa: E402
import fused_vision.planner as planner  # noqa: E402
from fused_vision.gemma4 import apply_fused_vision_to_gemma4, encode_images, revert_fused_vision_gemma4  # noqa: E402
from fused_vision.ops.position_embeddings import position_embeddings as fused_position_embeddings  # noqa: E402

ONEHOT_ENV = "FUSED_VISION_TRANSFORMERS_ONEHOT"
EXPECT_ONEHOT_ENV = "FUSED_VISION_EXPECT_ONEHOT_ERA"  # set by the subprocess run
# 5.9.0 wants huggingface_hub<2 (which needs httpx) and tokenizers<=0.23.0: they go in DIR beside it.
ONEHOT_INSTALL = (
    "pip install --no-deps --target DIR transformers==5.9.0 huggingface_hub==1.33.0 tokenizers==0.22.2 "
    "httpx==0.28.1 httpcore==1.0.9 certifi"
)
VERSION = tuple(int(part) for part in transformers.__version__.split(".")[:2])

# Soft tokens after the tower (the pooled, scaled, maybe standardized output). Every fused op rounds like
# stock, but a GEMM tile order or a pooling sum order may move a rounding by an ulp, which the encoder
# layer then carries on: so besides fp32's elementwise match with stock, both dtypes are judged against
# a float64 twin of the tower, no less accurate than stock in RMS and in the worst element, or than a
# floor of the dtype's unit roundoff (16 of them for fp32).
FP32_CLOSE = dict(rtol=1e-5, atol=1e-5)
ACCURACY_FLOOR = {torch.float32: 16 * 2**-24, torch.bfloat16: 2**-8}


@pytest.fixture(autouse=True)
def stock_after_each_test():
    yield
    revert_fused_vision_gemma4()


def vision_config(*, patch_size=2, pooling=2, positions=64, standardize=False, hidden=32):
    config = modeling.Gemma4VisionConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=hidden // 2,
        patch_size=patch_size,
        position_embedding_size=positions,
        pooling_kernel_size=pooling,
        standardize=standardize,
    )
    config._attn_implementation = "sdpa"
    return config


def randomize(module: nn.Module, seed: int) -> nn.Module:
    """Fresh random parameters and buffers (never the init's ones and zeros, nor torch.empty garbage)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
            if not tensor.is_floating_point() or "inv_freq" in name:
                continue
            scale = 1.0 if "position_embedding_table" in name or "std_" in name else 0.2
            tensor.copy_(torch.randn(tensor.shape, generator=generator) * scale + (1.0 if "std_scale" in name else 0.0))
    return module


def make_tower(dtype=torch.float32, seed=0, **config):
    tower = modeling.Gemma4VisionModel(vision_config(**config))
    return randomize(tower, seed).to(DEVICE, dtype).eval()


def grid_ids(width, height, seq_len):
    """Row-major (x fastest) ids of a width x height grid padded with (-1, -1), as the processor lays them."""
    ys, xs = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    ids = torch.stack([xs.flatten(), ys.flatten()], dim=-1)
    return torch.cat([ids, torch.full((seq_len - len(ids), 2), -1)])


def make_inputs(grids, seq_len, patch_size=2, seed=1):
    """Random pixels in [0, 1) on real patches, 0 on padding (as the processor pads), and their ids."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.stack([grid_ids(w, h, seq_len) for w, h in grids])
    pixels = torch.rand(len(grids), seq_len, 3 * patch_size**2, generator=generator)
    pixels = pixels.masked_fill((ids == -1).all(-1, keepdim=True), 0.0)
    return pixels.to(DEVICE), ids.to(DEVICE)


GRIDS = [(8, 6), (4, 10), (6, 2)]  # k = 2: 12, 10 and 3 soft tokens of L = 16
SEQ_LEN = 64


def run_tower(tower, pixels, ids):
    with torch.no_grad():
        return tower(pixel_values=pixels, pixel_position_ids=ids).last_hidden_state


def float64_twin(tower):
    """The same tower in float64, unpatched: the exact result that stock and fused are judged against."""
    return copy.deepcopy(tower).double()


def assert_soft_tokens_match(got, stock, exact, what):
    if stock.dtype == torch.float32:
        assert_close(got, stock, **FP32_CLOSE, what=what)
    floor = ACCURACY_FLOOR[stock.dtype]
    assert_as_accurate_as_stock(got, stock, exact, floor=floor, ords=(2, float("inf")), what=what)


# ---- which release family, told from the code -----------------------------------------------------


def test_release_family_is_detected_from_the_code():
    if VERSION < (5, 10):
        assert fg._onehot_lookup() and not fg._pooler_returns_float32()
    else:
        assert not fg._onehot_lookup()
    if VERSION >= (5, 24):
        assert fg._pooler_returns_float32()
    if os.environ.get(EXPECT_ONEHOT_ENV) == "1":  # the subprocess run must really be on 5.5-5.9
        assert VERSION < (5, 10), f"expected transformers 5.5-5.9, got {transformers.__version__}"
        assert fg._onehot_lookup() and not fg._pooler_returns_float32()


# ---- parity with the stock tower ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_lookup_alone_is_bit_identical(dtype):
    tower = make_tower(dtype)
    pixels, ids = make_inputs(GRIDS, SEQ_LEN)
    stock = run_tower(tower, pixels, ids)
    padding = (ids == -1).all(-1)
    with torch.no_grad():
        stock_embeds = tower.patch_embedder(pixels, ids, padding)
    assert apply_fused_vision_to_gemma4(tower, patch_embedder=False, pooler=False) == 1
    with torch.no_grad():
        assert_bit_identical(tower.patch_embedder(pixels, ids, padding), stock_embeds, "patch embedder")
    assert_bit_identical(run_tower(tower, pixels, ids), stock, "tower")


def vllm_embed_patches(embedder, pixels, ids, padding):
    """vLLM 0.34's ``_embed_patches`` (read in its source): the embedder's forward inlined around the
    module's projection, the lookup asked of the module's ``_position_embeddings``."""
    hidden_states = embedder.input_proj((2 * (pixels - 0.5)).to(embedder.input_proj.weight.dtype))
    return hidden_states + embedder._position_embeddings(ids, padding)


@pytest.mark.parametrize("scope", ["class", "instance"])
@pytest.mark.parametrize("patch_embedder", [False, True], ids=["lookup_alone", "patch_embed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_the_lookup_method_vllm_calls_is_fused_and_bit_identical(monkeypatch, dtype, patch_embedder, scope):
    tower = make_tower(dtype)
    pixels, ids = make_inputs(GRIDS, SEQ_LEN)
    padding = (ids == -1).all(-1)
    with torch.no_grad():
        stock = vllm_embed_patches(tower.patch_embedder, pixels, ids, padding)
    lookups = []

    def recorded_lookup(*args, **kwargs):
        lookups.append(kwargs["backend"])
        return fused_position_embeddings(*args, **kwargs)

    monkeypatch.setattr(fg, "_fused_position_embeddings", recorded_lookup)
    apply_fused_vision_to_gemma4(tower if scope == "instance" else None, patch_embedder=patch_embedder, pooler=False)
    with torch.no_grad():
        fused = vllm_embed_patches(tower.patch_embedder, pixels, ids, padding)
    assert lookups == ["auto"], "the patched module's _position_embeddings did not run the fused lookup"
    assert_bit_identical(fused, stock, "vLLM's inlined embedder")
    revert_fused_vision_gemma4(tower if scope == "instance" else None)
    with torch.no_grad():
        assert_bit_identical(vllm_embed_patches(tower.patch_embedder, pixels, ids, padding), stock, "reverted")
    assert lookups == ["auto"]


@pytest.mark.parametrize("patch_embedder", [False, True], ids=["lookup_alone", "patch_embed"])
def test_negative_ids_that_are_not_padding_run_as_stock(patch_embedder):
    """Stock clamps any negative id to 0 and pads only (-1, -1) patches; a patched tower takes the same ids."""
    tower = make_tower()
    pixels, ids = make_inputs(GRIDS, SEQ_LEN)
    ids[0, 3] = torch.tensor([-2, 1])
    ids[2, 1] = torch.tensor([-5, -5])
    stock = run_tower(tower, pixels, ids)
    exact = run_tower(float64_twin(tower), pixels.double(), ids)
    apply_fused_vision_to_gemma4(tower, patch_embedder=patch_embedder)
    assert_soft_tokens_match(run_tower(tower, pixels, ids), stock, exact, what="soft tokens")


@pytest.mark.parametrize("standardize", [False, True], ids=["plain", "standardize"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_every_fused_op_matches_stock(dtype, standardize):
    tower = make_tower(dtype, standardize=standardize)
    pixels, ids = make_inputs(GRIDS, SEQ_LEN)
    stock = run_tower(tower, pixels, ids)
    exact = run_tower(float64_twin(tower), pixels.double(), ids)
    assert apply_fused_vision_to_gemma4(tower) == 2
    fused = run_tower(tower, pixels, ids)
    assert fused.dtype == stock.dtype and fused.shape == stock.shape == (12 + 10 + 3, 32)
    assert_soft_tokens_match(fused, stock, exact, what="soft tokens")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_pooler_returns_the_release_dtype(dtype):
    tower = make_tower(dtype)
    hidden = torch.randn(2, SEQ_LEN, 32).to(DEVICE, dtype)
    _, ids = make_inputs(GRIDS[:2], SEQ_LEN)
    padding = (ids == -1).all(-1)
    for output_length in (16, SEQ_LEN):  # pooled, and the N == L path that only scales
        stock, stock_mask = tower.pooler(hidden, ids, padding, output_length)
        apply_fused_vision_to_gemma4(tower, patch_embedder=False, position_embeddings=False)
        fused, mask = tower.pooler(hidden, ids, padding, output_length)
        revert_fused_vision_gemma4(tower)
        assert fused.dtype == stock.dtype == (torch.float32 if fg._pooler_returns_float32() else dtype)
        assert_bit_identical(mask, stock_mask, "mask")
        tol = 1e-6 if dtype == torch.float32 else 2**-7
        assert_close(fused.float(), stock.float(), rtol=tol, atol=tol * 32**0.5, what="pooled")


def test_gradients_match_stock():
    """The fused ops are differentiable: a patched tower gets stock's gradients."""
    stock_tower = make_tower()
    tower = copy.deepcopy(stock_tower)
    apply_fused_vision_to_gemma4(tower)
    pixels, ids = make_inputs(GRIDS, SEQ_LEN)
    grads, losses = [], []
    for model in (stock_tower, tower):
        model.zero_grad()
        out = model(pixel_values=pixels, pixel_position_ids=ids).last_hidden_state
        loss = out.square().mean()
        loss.backward()
        losses.append(loss.detach())
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
    assert_close(losses[1], losses[0], rtol=1e-5, atol=0, what="loss")
    for name, expected in grads[0].items():
        assert_close(grads[1][name], expected, rtol=1e-4, atol=1e-6, what=f"grad of {name}")


def test_autocast_keeps_stock_rounding():
    """Under autocast the patched tower rounds as stock does, in either release family, bit for bit."""
    tower = make_tower()
    pixels, ids = make_inputs(GRIDS, SEQ_LEN)
    padding = (ids == -1).all(-1)
    with torch.no_grad(), torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        stock_embeds = tower.patch_embedder(pixels, ids, padding)
        stock_lookup = tower.patch_embedder._position_embeddings(ids, padding)
        stock = run_tower(tower, pixels, ids)
        apply_fused_vision_to_gemma4(tower)
        embeds = tower.patch_embedder(pixels, ids, padding)
        lookup = tower.patch_embedder._position_embeddings(ids, padding)
        fused = run_tower(tower, pixels, ids)
    assert_bit_identical(embeds, stock_embeds, "patch embedder under autocast")
    assert_bit_identical(lookup, stock_lookup, "the embedder's lookup under autocast")
    assert_bit_identical(fused, stock, "tower under autocast")


# ---- patching: classes, instances, idempotence, revert, repr, errors -----------------------------------


TINY_TEXT = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,  # 5.5 cannot validate its rope parameters for a single layer
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    vocab_size=128,
    hidden_size_per_layer_input=0,
    layer_types=["sliding_attention", "full_attention"],
)


def tiny_conditional_generation():
    text = dict(TINY_TEXT, vocab_size_per_layer_input=128, num_global_key_value_heads=1, global_head_dim=16)
    vision = vision_config().to_dict()
    config = modeling.Gemma4Config(text_config=text, vision_config=vision, audio_config=None)
    return modeling.Gemma4ForConditionalGeneration(config).eval()


def fused_ops(model):
    return sorted(str(m._fused_vision) for m in model.modules() if getattr(m, "_fused_vision", None) is not None)


def test_class_patch_reaches_towers_built_before_and_after():
    pixels, ids = make_inputs(GRIDS, SEQ_LEN)
    before = make_tower()
    stock = run_tower(before, pixels, ids)
    assert apply_fused_vision_to_gemma4() == 2
    assert apply_fused_vision_to_gemma4() == 2  # idempotent
    after = make_tower()  # same seed: same weights
    for tower in (before, after):
        assert "fused_vision=patch_embed(backend=auto)" in repr(tower.patch_embedder)
        assert "fused_vision=pool_by_positions(backend=auto)" in repr(tower.pooler)
        assert_close(run_tower(tower, pixels, ids), stock, **FP32_CLOSE, what="class-patched tower")
    assert modeling.Gemma4VisionPatchEmbedder.forward is fg._embedder_forward
    assert modeling.Gemma4VisionPatchEmbedder._position_embeddings is fg._embedder_position_embeddings

    assert revert_fused_vision_gemma4() == 2
    assert modeling.Gemma4VisionPatchEmbedder.forward is fg._stock("embedder", "forward")
    assert modeling.Gemma4VisionPatchEmbedder._position_embeddings is fg._stock("embedder", "_position_embeddings")
    assert "fused_vision" not in repr(after)
    assert_bit_identical(run_tower(after, pixels, ids), stock, "reverted tower")


def test_an_embedder_without_the_lookup_method_gets_none(monkeypatch):
    """A release whose embedder has no ``_position_embeddings`` (say, its lookup inlined into forward):
    the patch installs the forward alone, and the revert leaves the class as it found it."""
    embedder_cls = modeling.Gemma4VisionPatchEmbedder
    fg._onehot_lookup()  # cached: told from the real class before the method goes
    tower = make_tower()
    pixels, ids = make_inputs(GRIDS, SEQ_LEN)
    stock = run_tower(tower, pixels, ids)
    monkeypatch.delattr(embedder_cls, "_position_embeddings")

    assert apply_fused_vision_to_gemma4(pooler=False) == 1
    assert embedder_cls.forward is fg._embedder_forward
    assert not hasattr(embedder_cls, "_position_embeddings")
    assert not hasattr(embedder_cls, fg._STOCK_SLOTS["_position_embeddings"])
    assert_close(run_tower(tower, pixels, ids), stock, **FP32_CLOSE, what="tower whose embedder has no lookup method")
    assert revert_fused_vision_gemma4() == 1
    assert "_position_embeddings" not in embedder_cls.__dict__
    assert not any(name.startswith("_fused_vision") for name in embedder_cls.__dict__)


def test_vllm_plugin_is_registered_and_opt_in(monkeypatch):
    (entry_point,) = [e for e in importlib.metadata.entry_points(group="vllm.general_plugins") if e.value.startswith("fused_vision")]
    plugin = entry_point.load()
    monkeypatch.delenv("FUSED_VISION_VLLM", raising=False)
    plugin()
    assert modeling.Gemma4VisionPatchEmbedder.forward is fg._stock("embedder", "forward")
    monkeypatch.setenv("FUSED_VISION_VLLM", "1")
    plugin()
    assert modeling.Gemma4VisionPatchEmbedder.forward is fg._embedder_forward
    assert modeling.Gemma4VisionPooler.forward is fg._pooler_forward


def test_instance_patch_with_and_without_a_class_patch():
    model = tiny_conditional_generation()
    assert apply_fused_vision_to_gemma4(model) == 2
    assert apply_fused_vision_to_gemma4(model) == 2  # idempotent: same modules, same state
    assert fused_ops(model) == ["patch_embed(backend=auto)", "pool_by_positions(backend=auto)"]
    forward = model.model.vision_tower.patch_embedder.forward
    apply_fused_vision_to_gemma4(model)
    assert model.model.vision_tower.patch_embedder.forward.__func__ is forward.__func__

    # reconfigure one op; the unselected pooler keeps its patch
    assert apply_fused_vision_to_gemma4(model, patch_embedder=False, pooler=False, backend="reference") == 1
    assert fused_ops(model) == ["pool_by_positions(backend=auto)", "position_embeddings(backend=reference)"]

    # a class patch does not override the instance's own, and reverting the instance pins it to stock
    apply_fused_vision_to_gemma4()
    assert "position_embeddings(backend=reference)" in fused_ops(model)
    assert revert_fused_vision_gemma4(model) == 2
    assert fused_ops(model) == [] and "fused_vision" not in repr(model)
    other = make_tower()
    assert "fused_vision=patch_embed" in repr(other)  # the class patch still holds for others

    # patch again on top of the class patch, then reset everything
    assert apply_fused_vision_to_gemma4(model.model) == 2
    assert len(fused_ops(model)) == 2
    revert_fused_vision_gemma4()
    assert fused_ops(model) == [] and fused_ops(other) == []
    assert not any("_fused_vision" in vars(m) for m in model.modules())


def test_instance_patch_pickles_and_replicates_as_any_module():
    """The patch lives in the module's state and its class's forward, not in bound methods: a pickled
    tower loads and runs fused, a DataParallel replica runs on its own parameters, and an unpickled or
    deep-copied module runs stock once everything is reverted."""
    tower = make_tower(seed=4)
    pixels, ids = make_inputs(GRIDS, SEQ_LEN)
    apply_fused_vision_to_gemma4(tower)
    fused = run_tower(tower, pixels, ids)
    loaded = pickle.loads(pickle.dumps(tower))
    assert fused_ops(loaded) == fused_ops(tower)
    assert_bit_identical(run_tower(loaded, pixels, ids), fused, "unpickled tower")

    embedder = tower.patch_embedder
    replica = embedder._replicate_for_data_parallel()  # what nn.DataParallel makes for each GPU
    replica.position_embedding_table = torch.zeros_like(embedder.position_embedding_table)
    with torch.no_grad():
        projection = replica.input_proj(2 * (pixels - 0.5))
        assert_close(replica(pixels, ids), projection, **FP32_CLOSE, what="replica with its own zero table")
        assert not torch.allclose(embedder(pixels, ids), projection), "the original keeps its table"

    twin = copy.deepcopy(tower)
    revert_fused_vision_gemma4()
    stock = run_tower(tower, pixels, ids)
    for other in (loaded, twin):
        assert "fused_vision" not in repr(other)
        assert_bit_identical(run_tower(other, pixels, ids), stock, "stock after the global revert")


def test_forwards_saved_before_the_global_revert_run_stock_after_it():
    """accelerate keeps the forward it found in ``_old_forward`` (ours, after a class patch): after the
    global revert it runs stock code; and the revert counts only what the user patched."""
    tower = make_tower()
    pixels, ids = make_inputs(GRIDS, SEQ_LEN)
    padding = (ids == -1).all(-1)
    with torch.no_grad():
        stock = tower.patch_embedder(pixels, ids, padding)
    assert apply_fused_vision_to_gemma4() == 2
    saved = tower.patch_embedder.forward
    assert revert_fused_vision_gemma4() == 2
    with torch.no_grad():
        assert_bit_identical(saved(pixels, ids, padding), stock, "a saved forward after the revert")
    assert apply_fused_vision_to_gemma4(tower) == 2
    assert revert_fused_vision_gemma4() == 2, "two instance patches undone, no class patch"


def test_a_pin_to_stock_never_outlives_the_global_revert():
    tower = make_tower()
    apply_fused_vision_to_gemma4()
    revert_fused_vision_gemma4(tower)  # pinned to stock under the class patch
    apply_fused_vision_to_gemma4(tower)
    revert_fused_vision_gemma4(tower)
    revert_fused_vision_gemma4()
    apply_fused_vision_to_gemma4()
    assert fused_ops(tower) == ["patch_embed(backend=auto)", "pool_by_positions(backend=auto)"]


def test_instance_patch_of_a_loaded_model_matches_stock():
    model = tiny_conditional_generation()
    randomize(model.model.vision_tower, seed=3)
    tower = model.model.vision_tower
    pixels, ids = make_inputs(GRIDS, SEQ_LEN)
    with torch.no_grad():
        stock = model.model.get_image_features(pixel_values=pixels, image_position_ids=ids).pooler_output
        apply_fused_vision_to_gemma4(model)
        fused = model.model.get_image_features(pixel_values=pixels, image_position_ids=ids).pooler_output
    assert "fused_vision" in repr(tower)
    for got, expected in zip(fused, stock, strict=True):
        assert_close(got, expected, **FP32_CLOSE, what="image features")


# Model families that build transformers' Gemma 4 tower (AutoModel on a gemma4_vision config), each
# placing it elsewhere: (module, config class, model class, extra text config).
TOWER_FAMILIES = {
    "embedding_gemma2": (
        "transformers.models.embedding_gemma2.modeling_embedding_gemma2",
        "EmbeddingGemma2Config",
        "EmbeddingGemma2Model",
        dict(embedding_dim=16),
    ),
    "diffusion_gemma": (
        "transformers.models.diffusion_gemma.modeling_diffusion_gemma",
        "DiffusionGemmaConfig",
        "DiffusionGemmaForBlockDiffusion",
        dict(num_experts=2, top_k_experts=1, moe_intermediate_size=16),
    ),
}


@pytest.mark.parametrize("family", list(TOWER_FAMILIES))
def test_models_that_build_the_gemma4_tower(family, planner_calls):
    module_name, config_name, model_name, text = TOWER_FAMILIES[family]
    family_modeling = pytest.importorskip(module_name, reason=f"this transformers has no {family}")
    text_config, vision = dict(TINY_TEXT, **text), vision_config().to_dict()
    config = getattr(family_modeling, config_name)(text_config=text_config, vision_config=vision)
    model = getattr(family_modeling, model_name)(config).eval()
    tower = fg._resolve_tower(model)
    assert type(tower) is modeling.Gemma4VisionModel
    randomize(tower, seed=3)
    pixels, ids = make_inputs(GRIDS, SEQ_LEN)
    stock, stock_items = run_tower(tower, pixels, ids), per_item_stock(tower, pixels, ids)

    assert apply_fused_vision_to_gemma4(model) == 2
    assert fused_ops(model) == ["patch_embed(backend=auto)", "pool_by_positions(backend=auto)"]
    assert_close(run_tower(tower, pixels, ids), stock, **FP32_CLOSE, what=f"{family} tower")
    for index, (got, expected) in enumerate(zip(encode_images(model, pixels, ids), stock_items, strict=True)):
        assert_close(got, expected, **FP32_CLOSE, what=f"{family} encode_images item {index}")


def test_errors():
    with pytest.raises(ValueError, match="gemma4_unified"):
        apply_fused_vision_to_gemma4(nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(ValueError, match="nothing selected"):
        apply_fused_vision_to_gemma4(patch_embedder=False, position_embeddings=False, pooler=False)
    with pytest.raises(ValueError, match="backend"):
        apply_fused_vision_to_gemma4(backend="cuda")
    with pytest.raises(TypeError, match="Module"):
        apply_fused_vision_to_gemma4("google/gemma-4-e2b-it")
    tower = make_tower()
    with pytest.raises(ValueError, match="no Gemma4VisionPooler"):  # only the pooler asked, only an embedder
        apply_fused_vision_to_gemma4(tower.patch_embedder, patch_embedder=False, position_embeddings=False)
    assert fused_ops(tower) == []


def test_clear_import_error_without_gemma4(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "transformers.models.gemma4.modeling_gemma4", None)
    with pytest.raises(ImportError, match="has no Gemma 4"):
        apply_fused_vision_to_gemma4()
    assert revert_fused_vision_gemma4(nn.Linear(2, 2)) == 0  # nothing can have been patched: nothing to undo
    # vLLM calls its plugins unguarded in every process: there it warns instead
    monkeypatch.setenv("FUSED_VISION_VLLM", "1")
    with caplog.at_level("WARNING", logger="fused_vision"):
        fg.vllm_plugin()
    assert "FUSED_VISION_VLLM=1 but Gemma 4 cannot be patched here" in caplog.text


@pytest.mark.skipif(VERSION < (5, 10), reason="gemma4_unified is newer than the one-hot era")
def test_unified_checkpoints_have_nothing_to_patch():
    unified = pytest.importorskip("transformers.models.gemma4_unified.modeling_gemma4_unified")
    embedder = unified.Gemma4UnifiedVisionEmbedder.__new__(unified.Gemma4UnifiedVisionEmbedder)
    nn.Module.__init__(embedder)
    with pytest.raises(ValueError, match="contains no Gemma4VisionPatchEmbedder or Gemma4VisionPooler"):
        apply_fused_vision_to_gemma4(embedder)


def test_stock_path_for_inputs_the_ops_do_not_take():
    tower = make_tower(torch.float64)
    pixels, ids = make_inputs(GRIDS, SEQ_LEN)
    stock = run_tower(tower, pixels.double(), ids)
    apply_fused_vision_to_gemma4(tower)
    assert_bit_identical(run_tower(tower, pixels.double(), ids), stock, "float64 tower (stock code)")


def test_patched_modules_on_the_meta_device_give_stock_shapes():
    """Shape inference on the meta device, where there is no autocast to ask about and no data to read."""
    tower = make_tower().to("meta")
    pixels, ids = (t.to("meta") for t in make_inputs(GRIDS, SEQ_LEN))
    padding = (ids == -1).all(-1)
    hidden_states = torch.empty(len(GRIDS), SEQ_LEN, 32, device="meta")

    def outputs():
        with torch.no_grad():
            return tower.patch_embedder(pixels, ids, padding), *tower.pooler(hidden_states, ids, padding, 16)

    stock = outputs()
    assert apply_fused_vision_to_gemma4(tower) == 2
    for got, expected in zip(outputs(), stock, strict=True):
        assert got.is_meta and (got.shape, got.dtype) == (expected.shape, expected.dtype)


def test_accelerate_style_hooks_are_kept():
    """accelerate (device_map, offload) wraps ``forward`` and keeps the module's own in ``_old_forward``."""
    tower = make_tower()
    pixels, ids = make_inputs(GRIDS, SEQ_LEN)
    padding = (ids == -1).all(-1)
    embedder = tower.patch_embedder
    with torch.no_grad():
        stock = embedder(pixels, ids, padding)
    calls = []

    def hooked_forward(*args, **kwargs):
        calls.append(1)
        return embedder._old_forward(*args, **kwargs)

    embedder._hf_hook, embedder._old_forward, embedder.forward = object(), embedder.forward, hooked_forward
    apply_fused_vision_to_gemma4(tower)
    assert embedder.forward is hooked_forward and embedder._old_forward.__func__ is fg._embedder_forward
    with torch.no_grad():
        assert_close(embedder(pixels, ids, padding), stock, **FP32_CLOSE, what="hooked embedder")
    revert_fused_vision_gemma4(tower)
    assert embedder.forward is hooked_forward and embedder._old_forward.__func__ is not fg._embedder_forward
    with torch.no_grad():
        assert_bit_identical(embedder(pixels, ids, padding), stock, "reverted hooked embedder")
    assert len(calls) == 2


def graph_breaks(tower, pixels, ids):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    out = run_tower(torch.compile(tower, backend="eager"), pixels, ids)
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    torch._dynamo.reset()
    return out, breaks


def test_torch_compile_traces_the_patched_modules():
    """The patched forwards add no graph break to stock's (the fused ops are torch.library ops)."""
    tower = make_tower()
    pixels, ids = make_inputs(GRIDS, SEQ_LEN)
    stock, stock_breaks = graph_breaks(tower, pixels, ids)
    apply_fused_vision_to_gemma4(tower)
    fused, fused_breaks = graph_breaks(tower, pixels, ids)
    assert_close(fused, stock, **FP32_CLOSE, what="compiled tower")
    assert fused_breaks == stock_breaks


def test_compiled_towers_that_run_stock_beside_patched_ones():
    """Towers running stock code through the installed forward (never patched, reverted, or pinned under a
    class patch) compile and run stock's ops, bit for bit."""
    pixels, ids = make_inputs(GRIDS, SEQ_LEN)
    patched, plain = make_tower(seed=1), make_tower(seed=2)
    stock = {name: run_tower(tower, pixels, ids) for name, tower in (("patched", patched), ("plain", plain))}
    apply_fused_vision_to_gemma4(patched)
    assert_bit_identical(run_tower(torch.compile(plain, backend="eager"), pixels, ids), stock["plain"], "never patched")
    compiled = torch.compile(patched, backend="eager")
    run_tower(compiled, pixels, ids)
    revert_fused_vision_gemma4(patched)
    assert_bit_identical(run_tower(compiled, pixels, ids), stock["patched"], "reverted")
    apply_fused_vision_to_gemma4()
    revert_fused_vision_gemma4(plain)  # pinned to stock under the class patch
    assert_bit_identical(run_tower(torch.compile(plain, backend="eager"), pixels, ids), stock["plain"], "pinned")


def test_patched_tower_compiles_fullgraph():
    """With stock's one break (the boolean-mask strip of padding) captured as a dynamic-shape op, the
    whole patched tower is one graph, forward and backward."""
    tower = make_tower()
    pixels, ids = make_inputs(GRIDS, SEQ_LEN)
    with torch.no_grad():
        stock = run_tower(tower, pixels, ids)
    apply_fused_vision_to_gemma4(tower)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        compiled_tower = torch.compile(tower, fullgraph=True, backend="aot_eager")
        compiled = compiled_tower(pixel_values=pixels, pixel_position_ids=ids).last_hidden_state
        compiled.square().mean().backward()
    torch._dynamo.reset()
    assert_close(compiled.detach(), stock, **FP32_CLOSE, what="fullgraph tower")
    assert tower.patch_embedder.position_embedding_table.grad is not None


# ---- encode_images -------------------------------------------------------------------------------


@pytest.fixture
def planner_calls(monkeypatch):
    """Stand-in for fused_vision.planner.plan: 3 items per call, recording what it was asked."""
    calls = []

    def plan(num_items, patches_per_item, tower, path, device, dtype, input_bytes_per_item):
        calls.append((num_items, patches_per_item, dtype))
        return 3

    monkeypatch.setattr(fg, "_plan_chunk", plan)
    return calls


def per_item_stock(tower, pixels, ids):
    return [run_tower(tower, p[None], i[None]) for p, i in zip(pixels, ids)]


@pytest.mark.parametrize("fused", [False, True], ids=["stock_tower", "fused_tower"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_encode_images_stacked(planner_calls, dtype, fused):
    tower = make_tower(dtype, standardize=True)
    grids = GRIDS + [(2, 2), (8, 8)]
    pixels, ids = make_inputs(grids, SEQ_LEN, seed=5)
    expected = per_item_stock(tower, pixels, ids)
    exact = per_item_stock(float64_twin(tower), pixels.double(), ids)
    if fused:
        apply_fused_vision_to_gemma4(tower)
    with torch.no_grad():
        got = encode_images(tower, pixels, ids, max_batch=2)
    assert planner_calls == [(5, SEQ_LEN, dtype)]
    assert [t.shape[0] for t in got] == [12, 10, 3, 1, 16]
    for index, (g, e, x) in enumerate(zip(got, expected, exact, strict=True)):
        assert g.dtype == e.dtype
        assert_soft_tokens_match(g, e, x, what=f"item {index}")


@pytest.mark.parametrize("fused", [False, True], ids=["stock_tower", "fused_tower"])
def test_encode_images_one_at_a_time_is_the_tower_forward(planner_calls, fused):
    """Chunks of one item run the very ops of Gemma4VisionModel.forward: bit for bit, release semantics
    (dtype of the pooled tokens, float32 or not for the standardization) included."""
    tower = make_tower(torch.bfloat16, standardize=True)
    if fused:
        apply_fused_vision_to_gemma4(tower)
    pixels, ids = make_inputs(GRIDS, SEQ_LEN, seed=8)
    with torch.no_grad():
        got = encode_images(tower, pixels, ids, max_batch=1)
    for index, (g, e) in enumerate(zip(got, per_item_stock(tower, pixels, ids), strict=True)):
        assert_bit_identical(g, e, f"item {index}")


def test_encode_images_runs_without_autograd(planner_calls):
    """A loaded model's parameters require grad; the planner budgets inference, not saved activations."""
    tower = make_tower()
    assert all(p.requires_grad for p in tower.parameters())
    pixels, ids = make_inputs(GRIDS, SEQ_LEN)
    assert all(tokens.grad_fn is None for tokens in encode_images(tower, pixels, ids))


def test_encode_images_list_of_mixed_sizes(planner_calls):
    tower = make_tower(pooling=2)
    small_pixels, small_ids = make_inputs([(4, 4), (2, 6), (4, 2)], 16, seed=6)
    large_pixels, large_ids = make_inputs([(8, 6), (10, 4)], SEQ_LEN, seed=7)
    order = [("s", 0), ("l", 0), ("s", 1), ("s", 2), ("l", 1)]
    source = {"s": (small_pixels, small_ids), "l": (large_pixels, large_ids)}
    pixels = [source[k][0][i] for k, i in order]
    ids = [source[k][1][i][None] for k, i in order]  # (1, N, 2) items are accepted too
    expected = [run_tower(tower, p[None], i) for p, i in zip(pixels, ids)]
    apply_fused_vision_to_gemma4(tower)
    with torch.no_grad():
        got = encode_images(tower, pixels, ids)
    assert sorted(planner_calls) == [(2, SEQ_LEN, torch.float32), (3, 16, torch.float32)]
    for index, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert_close(g, e, **FP32_CLOSE, what=f"item {index}")


@pytest.mark.parametrize("fused", [False, True], ids=["stock_tower", "fused_tower"])
def test_encode_images_uses_the_planner(monkeypatch, fused):
    tower = make_tower()
    if fused:
        apply_fused_vision_to_gemma4(tower)
    pixels, ids = make_inputs(GRIDS, SEQ_LEN)
    seen = []
    real_plan = planner.plan

    def plan(*args, **kwargs):
        seen.append((args, kwargs))
        return real_plan(*args, **kwargs)

    monkeypatch.setattr(planner, "plan", plan)
    with torch.no_grad():
        got = encode_images(model_with(tower), pixels, ids)
    # an unpatched 5.5-5.9 tower builds the one-hot the planner must price; nothing else does
    path = "onehot" if VERSION < (5, 10) and not fused else "fused"
    assert len(seen) == 1 and seen[0][0][:2] == (3, SEQ_LEN) and seen[0][0][2] is tower.config
    device = tower.patch_embedder.position_embedding_table.device
    # slices of one stacked tensor on the tower's device: no input copy to price
    assert seen[0][1] == dict(
        path=path, device=device, dtype=torch.float32, extra_bytes_per_item=0, attn_implementation="sdpa"
    )
    for g, e in zip(got, per_item_stock(tower, pixels, ids), strict=True):
        assert_close(g, e, **FP32_CLOSE, what="soft tokens")
    with torch.no_grad():
        encode_images(model_with(tower), list(pixels), list(ids))  # stacked per chunk: a copy per item
    assert seen[1][1]["extra_bytes_per_item"] == SEQ_LEN * (pixels.shape[-1] * 4 + 2 * 8)


class PlanRecorded(Exception):
    """Raised by a recording stand-in for planner.plan: the test needs the call, not the encoding."""


@pytest.fixture
def planner_kwargs(monkeypatch):
    """The keyword arguments of each planner.plan call; the call then raises PlanRecorded."""
    calls = []

    def plan(*args, **kwargs):
        calls.append(kwargs)
        raise PlanRecorded

    monkeypatch.setattr(planner, "plan", plan)
    return calls


@pytest.mark.parametrize(
    "attention, priced_as",
    [
        ("sdpa", "sdpa"),
        ("eager", "eager"),
        ("paged|eager", "eager"),  # eager's (N, N) scores over a paged cache
        ("paged|sdpa", "sdpa"),
        ("flash_attention_2", "sdpa"),  # no (N, N) scores
        ("flex_attention", "sdpa"),
    ],
)
def test_encode_images_prices_the_attention_the_tower_runs(planner_kwargs, attention, priced_as):
    tower = make_tower()
    tower.config._attn_implementation = attention
    pixels, ids = make_inputs(GRIDS, SEQ_LEN)
    with pytest.raises(PlanRecorded):
        encode_images(tower, pixels, ids)
    assert planner_kwargs[0]["attn_implementation"] == priced_as


@pytest.mark.parametrize(
    "tower_dtype, pixel_dtypes",
    [
        (torch.float32, [torch.float32] * 3),
        (torch.float32, [torch.float64] * 3),
        (torch.float32, [torch.float32, torch.float64, torch.float32]),  # stacked, the chunk is float64
        (torch.float64, [torch.float64] * 3),
    ],
    ids=["float32", "float64_pixels", "one_float64_item", "float64_tower"],
)
def test_encode_images_prices_the_onehot_where_the_patched_embedder_runs_stock(
    planner_kwargs, tower_dtype, pixel_dtypes
):
    """The fused ops do not take float64: the patched embedder runs stock code, whose 5.5-5.9 lookup is
    the one-hot the planner must price."""
    tower = make_tower(tower_dtype)
    apply_fused_vision_to_gemma4(tower)
    pixels, ids = make_inputs(GRIDS, SEQ_LEN)
    items = [p.to(dtype) for p, dtype in zip(pixels, pixel_dtypes, strict=True)]
    with pytest.raises(PlanRecorded):
        encode_images(tower, items, list(ids))
    float64 = tower_dtype == torch.float64 or torch.float64 in pixel_dtypes
    assert planner_kwargs[0]["path"] == ("onehot" if VERSION < (5, 10) and float64 else "fused")


def model_with(tower):
    """A Gemma4Model-shaped holder: encode_images finds the tower inside."""
    holder = nn.Module()
    holder.vision_tower = tower
    return holder


def test_encode_images_errors(planner_calls):
    tower = make_tower()
    pixels, ids = make_inputs(GRIDS, SEQ_LEN)
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="max_batch"):
            encode_images(tower, pixels, ids, max_batch=bad)
    assert len(encode_images(tower, pixels, ids, max_batch=np.int64(2))) == len(GRIDS)
    with pytest.raises(TypeError, match="item 1 is ndarray and Tensor"):
        encode_images(tower, [pixels[0], pixels[1].cpu().numpy(), pixels[2]], list(ids))
    with pytest.raises(ValueError, match="item 2: .* N >= 1"):
        encode_images(tower, [*pixels[:2], pixels[2, :0]], [*ids[:2], ids[2, :0]])
    for fewer_pixels, fewer_ids in ((pixels[:2], ids), (pixels, ids[:2])):  # one item more or less
        expected = rf"pixel_position_ids: expected {len(fewer_pixels)} items like pixel_values, got {len(fewer_ids)}"
        for stacked_or_listed in ((fewer_pixels, fewer_ids), (list(fewer_pixels), list(fewer_ids))):
            with pytest.raises(ValueError, match=expected):
                encode_images(tower, *stacked_or_listed)
    with pytest.raises(ValueError, match="item 1"):
        encode_images(tower, list(pixels), [ids[0], ids[1][:10], ids[2]])
    with pytest.raises(ValueError, match="pixel_values: item 2: expected .* features like item 0"):
        encode_images(tower, [*pixels[:2], pixels[2, :, :-1]], list(ids))
    with pytest.raises(TypeError, match="Gemma4VisionModel"):
        encode_images(nn.Linear(2, 2), pixels, ids)
    for dtype in (torch.float32, torch.int16):
        with pytest.raises(TypeError, match=rf"pixel_position_ids: item 0: expected dtype int32 or int64, got {dtype}"):
            encode_images(tower, pixels, ids.to(dtype))
    if VERSION < (5, 10):  # the unpatched tower's one-hot takes int64 only; the fused ops and 5.10+ take int32
        with pytest.raises(TypeError, match=r"pixel_position_ids: item 0: .* one-hot lookup, which takes int64"):
            encode_images(tower, pixels, ids.int())
    else:
        assert len(encode_images(tower, pixels, ids.int())) == len(GRIDS)
    fused_tower = make_tower()
    apply_fused_vision_to_gemma4(fused_tower)
    assert len(encode_images(fused_tower, pixels, ids.int())) == len(GRIDS)
    assert encode_images(tower, [], []) == []


# ---- the real image processor --------------------------------------------------------------------


def processor_batch(sizes, max_soft_tokens, seed):
    from PIL import Image

    image_processing = pytest.importorskip("transformers.models.gemma4.image_processing_pil_gemma4")
    processor = image_processing.Gemma4ImageProcessorPil(
        patch_size=4, max_soft_tokens=max_soft_tokens, pooling_kernel_size=2
    )
    rng = np.random.default_rng(seed)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]
    batch = processor(images, return_tensors="pt")
    tokens = list(batch["num_soft_tokens_per_image"])
    return batch["pixel_values"].to(DEVICE), batch["image_position_ids"].to(DEVICE), tokens


SIZES = [(48, 80), (100, 36), (61, 61)]  # landscape, portrait, square-ish odd


def test_processor_ids_through_patched_tower():
    pixels, ids, tokens = processor_batch(SIZES, 70, seed=11)
    assert pixels.dtype == torch.float32 and ids.dtype == torch.int64 and pixels.shape == (3, 280, 48)
    positions = int(ids.max()) + 1
    tower = make_tower(patch_size=4, pooling=2, positions=positions)  # the largest id is the last row
    stock = run_tower(tower, pixels, ids)
    apply_fused_vision_to_gemma4(tower, patch_embedder=False, pooler=False)
    assert_bit_identical(run_tower(tower, pixels, ids), stock, "tower with the fused lookup")
    apply_fused_vision_to_gemma4(tower)
    fused = run_tower(tower, pixels, ids)
    assert fused.shape[0] == sum(tokens)
    assert_close(fused, stock, **FP32_CLOSE, what="tower with every fused op")


def test_processor_items_of_two_budgets_through_encode_images(planner_calls):
    pixels70, ids70, tokens70 = processor_batch(SIZES, 70, seed=12)
    pixels140, ids140, tokens140 = processor_batch([(30, 90), (64, 64)], 140, seed=13)
    pixels = [pixels70[0], pixels140[0], pixels70[1], pixels140[1], pixels70[2]]
    ids = [ids70[0], ids140[0], ids70[1], ids140[1], ids70[2]]
    tokens = [tokens70[0], tokens140[0], tokens70[1], tokens140[1], tokens70[2]]
    positions = max(int(i.max()) for i in ids) + 1
    tower = make_tower(patch_size=4, pooling=2, positions=positions, standardize=True)
    expected = [run_tower(tower, p[None], i[None]) for p, i in zip(pixels, ids)]
    apply_fused_vision_to_gemma4(tower)
    with torch.no_grad():
        got = encode_images(tower, pixels, ids, max_batch=2)
    assert sorted(planner_calls) == [(2, 560, torch.float32), (3, 280, torch.float32)]
    assert [g.shape[0] for g in got] == tokens
    for index, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert_close(g, e, **FP32_CLOSE, what=f"image {index}")


# ---- the one-hot era (transformers 5.5-5.9), in a subprocess -------------------------------------


@pytest.mark.skipif(os.environ.get(EXPECT_ONEHOT_ENV) == "1", reason="already the one-hot era run")
def test_onehot_era_transformers():
    target = os.environ.get(ONEHOT_ENV)
    if not target:
        pytest.skip(f"{ONEHOT_ENV} is unset: point it at a directory made with `{ONEHOT_INSTALL}`")
    if not Path(target, "transformers").is_dir():
        pytest.fail(f"{ONEHOT_ENV}={target} holds no transformers package; make it with `{ONEHOT_INSTALL}`")
    env = dict(os.environ)
    env.pop(ONEHOT_ENV)
    env[EXPECT_ONEHOT_ENV] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [target, env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__).resolve())]
    result = subprocess.run(
        command, cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True, timeout=900
    )
    tail = (result.stdout + result.stderr)[-6000:]
    assert result.returncode == 0, f"the one-hot era run failed:\n{tail}"
    assert " passed" in result.stdout and " failed" not in result.stdout, tail
