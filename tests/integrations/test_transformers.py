"""fused_vision.integrations.transformers against transformers' own Gemma 4 vision tower, on tiny random configs.

Runs against whichever transformers is importable: the newest (F.embedding era, 5.10+) in the test
environment, and transformers 5.5-5.9 (one-hot era) in `.ci/run`'s second run of this file with
FUSED_VISION_EXPECT_ONEHOT_ERA=1, which checks that it really runs there.
"""

import copy
import pickle
import sys

import pytest
import torch
from torch import nn

import fused_vision.integrations.stem as stem
import fused_vision.integrations.transformers as fg
from fused_vision import apply_fused_vision_to_gemma4, revert_fused_vision_gemma4
from fused_vision._environment import flag
from fused_vision.ops.position_embeddings import position_embeddings as fused_position_embeddings

from gemma4_towers import (
    FP32_CLOSE,
    GRIDS,
    SEQ_LEN,
    SIZES,
    VERSION,
    assert_soft_tokens_match,
    compiled_fullgraph_soft_tokens,
    float64_twin,
    fused_ops,
    make_inputs,
    make_tower,
    modeling,
    processor_batch,
    randomize,
    run_tower,
    tiny_conditional_generation,
)
from helpers import DEVICE, assert_bit_identical, assert_close, dtype_id, reverting_to_stock

EXPECT_ONEHOT_ENV = "FUSED_VISION_EXPECT_ONEHOT_ERA"  # set by CI's run on transformers 5.9


stock_after_each_test = reverting_to_stock(revert_fused_vision_gemma4)


# ---- which release family, told from the code -----------------------------------------------------


def test_release_family_is_detected_from_the_code():
    if VERSION < (5, 10):
        assert fg.onehot_lookup() and not fg.pooler_returns_float32()
    else:
        assert not fg.onehot_lookup()
    if VERSION >= (5, 24):
        assert fg.pooler_returns_float32()
    if flag(EXPECT_ONEHOT_ENV):  # CI's one-hot era run must really be on 5.5-5.9
        assert VERSION < (5, 10), f"expected transformers 5.5-5.9, got {VERSION}"
        assert fg.onehot_lookup() and not fg.pooler_returns_float32()


# ---- parity with the stock tower ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_lookup_alone_is_bit_identical(dtype):
    tower = make_tower(dtype)
    pixels, ids = make_inputs(GRIDS, SEQ_LEN)
    stock = run_tower(tower, pixels, ids)
    padding = (ids == -1).all(-1)
    with torch.no_grad():
        stock_embeds = tower.patch_embedder(pixels, ids, padding)
    assert apply_fused_vision_to_gemma4(tower, embedder="position_embeddings", pooler=False) == 1
    with torch.no_grad():
        assert_bit_identical(tower.patch_embedder(pixels, ids, padding), stock_embeds, "patch embedder")
    assert_bit_identical(run_tower(tower, pixels, ids), stock, "tower")


def vllm_embed_patches(embedder, pixels, ids, padding):
    """vLLM 0.34's ``_embed_patches`` (read in its source): the embedder's forward inlined around the
    module's projection, the lookup asked of the module's ``_position_embeddings``."""
    hidden_states = embedder.input_proj((2 * (pixels - 0.5)).to(embedder.input_proj.weight.dtype))
    return hidden_states + embedder._position_embeddings(ids, padding)


@pytest.mark.parametrize("scope", ["class", "instance"])
@pytest.mark.parametrize("embedder", ["position_embeddings", "patch_embed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_the_lookup_method_vllm_calls_is_fused_and_bit_identical(monkeypatch, dtype, embedder, scope):
    tower = make_tower(dtype)
    pixels, ids = make_inputs(GRIDS, SEQ_LEN)
    padding = (ids == -1).all(-1)
    with torch.no_grad():
        stock = vllm_embed_patches(tower.patch_embedder, pixels, ids, padding)
    lookups = []

    def recorded_lookup(*args, **kwargs):
        lookups.append(kwargs["backend"])
        return fused_position_embeddings(*args, **kwargs)

    monkeypatch.setattr(stem, "_fused_position_embeddings", recorded_lookup)
    apply_fused_vision_to_gemma4(tower if scope == "instance" else None, embedder=embedder, pooler=False)
    with torch.no_grad():
        fused = vllm_embed_patches(tower.patch_embedder, pixels, ids, padding)
    assert lookups == ["auto"], "the patched module's _position_embeddings did not run the fused lookup"
    assert_bit_identical(fused, stock, "vLLM's inlined embedder")
    revert_fused_vision_gemma4(tower if scope == "instance" else None)
    with torch.no_grad():
        assert_bit_identical(vllm_embed_patches(tower.patch_embedder, pixels, ids, padding), stock, "reverted")
    assert lookups == ["auto"]


@pytest.mark.parametrize("embedder", ["position_embeddings", "patch_embed"])
def test_negative_ids_that_are_not_padding_run_as_stock(embedder):
    """Stock clamps any negative id to 0 and pads only (-1, -1) patches; a patched tower takes the same ids."""
    tower = make_tower()
    pixels, ids = make_inputs(GRIDS, SEQ_LEN)
    ids[0, 3] = torch.tensor([-2, 1])
    ids[2, 1] = torch.tensor([-5, -5])
    stock = run_tower(tower, pixels, ids)
    exact = run_tower(float64_twin(tower), pixels.double(), ids)
    apply_fused_vision_to_gemma4(tower, embedder=embedder)
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
        apply_fused_vision_to_gemma4(tower, embedder=None)
        fused, mask = tower.pooler(hidden, ids, padding, output_length)
        revert_fused_vision_gemma4(tower)
        assert fused.dtype == stock.dtype == (torch.float32 if fg.pooler_returns_float32() else dtype)
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
    assert modeling.Gemma4VisionPatchEmbedder.forward is stem._embedder_forward
    assert modeling.Gemma4VisionPatchEmbedder._position_embeddings is stem._embedder_position_embeddings

    assert revert_fused_vision_gemma4() == 2
    assert modeling.Gemma4VisionPatchEmbedder.forward is fg._stock("embedder", "forward")
    assert modeling.Gemma4VisionPatchEmbedder._position_embeddings is fg._stock("embedder", "_position_embeddings")
    assert "fused_vision" not in repr(after)
    assert_bit_identical(run_tower(after, pixels, ids), stock, "reverted tower")


def test_an_embedder_without_the_lookup_method_gets_the_forward_alone(monkeypatch):
    """A release whose embedder has no ``_position_embeddings`` (say, its lookup inlined into forward):
    the fused forward, which never calls it, still matches stock."""
    embedder_cls = modeling.Gemma4VisionPatchEmbedder
    fg.onehot_lookup()  # cached: told from the real class before the method goes
    tower = make_tower()
    pixels, ids = make_inputs(GRIDS, SEQ_LEN)
    stock = run_tower(tower, pixels, ids)
    monkeypatch.delattr(embedder_cls, "_position_embeddings")

    assert apply_fused_vision_to_gemma4(pooler=False) == 1
    assert embedder_cls.forward is stem._embedder_forward
    assert_close(run_tower(tower, pixels, ids), stock, **FP32_CLOSE, what="tower whose embedder has no lookup method")


def test_calling_again_reconfigures_the_selected_op_and_keeps_the_other():
    model = tiny_conditional_generation()
    assert apply_fused_vision_to_gemma4(model) == 2
    assert fused_ops(model) == ["patch_embed(backend=auto)", "pool_by_positions(backend=auto)"]
    assert apply_fused_vision_to_gemma4(model, embedder="position_embeddings", pooler=False, backend="reference") == 1
    assert fused_ops(model) == ["pool_by_positions(backend=auto)", "position_embeddings(backend=reference)"]


def test_a_patched_tower_pickles_and_replicates():
    """A pickled tower loads with its ops and runs fused; a DataParallel replica runs on its own parameters."""
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


def test_an_embedder_forward_saved_before_the_global_revert_runs_stock_after_it():
    """accelerate keeps the forward it found in ``_old_forward`` (ours, after a class patch)."""
    tower = make_tower()
    pixels, ids = make_inputs(GRIDS, SEQ_LEN)
    padding = (ids == -1).all(-1)
    with torch.no_grad():
        stock = tower.patch_embedder(pixels, ids, padding)
    apply_fused_vision_to_gemma4()
    saved = tower.patch_embedder.forward
    revert_fused_vision_gemma4()
    with torch.no_grad():
        assert_bit_identical(saved(pixels, ids, padding), stock, "a saved forward after the revert")


def test_instance_patch_of_a_loaded_model_matches_stock():
    model = tiny_conditional_generation()
    randomize(model.model.vision_tower, seed=3)
    tower = model.model.vision_tower
    pixels, ids = make_inputs(GRIDS, SEQ_LEN)
    with torch.no_grad():
        stock = model.model.get_image_features(pixel_values=pixels, image_position_ids=ids).pooler_output
        assert apply_fused_vision_to_gemma4(model) == 2
        fused = model.model.get_image_features(pixel_values=pixels, image_position_ids=ids).pooler_output
    assert "fused_vision" in repr(tower)
    for got, expected in zip(fused, stock, strict=True):
        assert_close(got, expected, **FP32_CLOSE, what="image features")


# Model families that build transformers' Gemma 4 tower (AutoModel on a gemma4_vision config), each
# placing it elsewhere: (module, config class, model class, extra text config).
def test_errors():
    with pytest.raises(ValueError, match="gemma4_unified"):
        apply_fused_vision_to_gemma4(nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(ValueError, match="nothing selected"):
        apply_fused_vision_to_gemma4(embedder=None, pooler=False)
    with pytest.raises(ValueError, match="backend"):
        apply_fused_vision_to_gemma4(backend="cuda")
    with pytest.raises(TypeError, match="Module"):
        apply_fused_vision_to_gemma4("google/gemma-4-e2b-it")
    tower = make_tower()
    with pytest.raises(ValueError, match="no Gemma4VisionPooler"):  # only the pooler asked, only an embedder
        apply_fused_vision_to_gemma4(tower.patch_embedder, embedder=None)
    assert fused_ops(tower) == []


def test_clear_import_error_without_gemma4(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers.models.gemma4.modeling_gemma4", None)
    with pytest.raises(ImportError, match="has no Gemma 4"):
        apply_fused_vision_to_gemma4()
    assert revert_fused_vision_gemma4(nn.Linear(2, 2)) == 0  # nothing can have been patched: nothing to undo


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


def test_an_accelerate_hooked_embedder_matches_stock():
    """accelerate (device_map, offload) wraps ``forward`` and keeps the module's own in ``_old_forward``."""
    tower = make_tower()
    pixels, ids = make_inputs(GRIDS, SEQ_LEN)
    padding = (ids == -1).all(-1)
    embedder = tower.patch_embedder
    with torch.no_grad():
        stock = embedder(pixels, ids, padding)
    embedder._hf_hook, embedder._old_forward = object(), embedder.forward
    embedder.forward = lambda *args, **kwargs: embedder._old_forward(*args, **kwargs)
    apply_fused_vision_to_gemma4(tower)
    assert embedder._old_forward.__func__ is stem._embedder_forward
    with torch.no_grad():
        assert_close(embedder(pixels, ids, padding), stock, **FP32_CLOSE, what="hooked embedder")
    revert_fused_vision_gemma4(tower)
    with torch.no_grad():
        assert_bit_identical(embedder(pixels, ids, padding), stock, "reverted hooked embedder")


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
    compiled = compiled_fullgraph_soft_tokens(tower, pixels, ids)
    assert_close(compiled, stock, **FP32_CLOSE, what="fullgraph tower")
    assert tower.patch_embedder.position_embedding_table.grad is not None


# ---- the real image processor --------------------------------------------------------------------


def test_processor_ids_through_patched_tower():
    pixels, ids, tokens = processor_batch(SIZES, 70, seed=11)
    assert pixels.dtype == torch.float32 and ids.dtype == torch.int64 and pixels.shape == (3, 280, 48)
    positions = int(ids.max()) + 1
    tower = make_tower(patch_size=4, pooling=2, positions=positions)  # the largest id is the last row
    stock = run_tower(tower, pixels, ids)
    apply_fused_vision_to_gemma4(tower, embedder="position_embeddings", pooler=False)
    assert_bit_identical(run_tower(tower, pixels, ids), stock, "tower with the fused lookup")
    apply_fused_vision_to_gemma4(tower)
    fused = run_tower(tower, pixels, ids)
    assert fused.shape[0] == sum(tokens)
    assert_close(fused, stock, **FP32_CLOSE, what="tower with every fused op")
