"""fused_vision.integrations.vllm against vLLM's own Gemma 4 model (0.33 and 0.34), built by vLLM on the CPU.

It needs vLLM in an environment of its own (tests/integrations/vllm_models.py; `bash .ci/run tests_vllm` builds
one for both releases) and skips without it; the plugin's tests are in test_vllm_report.py.
"""

import importlib
import importlib.metadata
import random
import sys
import warnings

import pytest
import torch

import fused_vision.integrations.stem as stem
import fused_vision.integrations.transformers as fg
import fused_vision.integrations.vllm as fv
from fused_vision import (
    apply_fused_vision_to_gemma4,
    apply_fused_vision_to_vllm_gemma4,
    revert_fused_vision_gemma4,
    revert_fused_vision_vllm_gemma4,
)
from fused_vision.bench.tower import LOW_MEMORY_TOWER, VISION_TOWERS
from fused_vision.bench.workloads import PATCH_SIZE, POOLING_KERNEL, POSITION_EMBEDDING_SIZE
from fused_vision.pipeline import planner

from gemma4_towers import modeling, out_of_memory_above
from helpers import assert_bit_identical, assert_close, reverting_to_stock
from op_cases import ULP
from vllm_models import (  # noqa: F401 (the fixtures)
    PATCHED,
    GiB,
    build_vllm_model,
    gemma4_mm,
    image_input,
    memory,
    model_class,
    needs_vllm,
    run,
    tiny_model,
    transformers_is_patched,
    video_input,
    vision_input,
    vllm_is_patched,
    vllm_process,
)

FRAME, IMAGE = 630, 2520  # patches per video frame (70 soft tokens) and per image (280), pooling kernel 3


stock_after_each_test = reverting_to_stock(revert_fused_vision_vllm_gemma4, revert_fused_vision_gemma4)


def guarded(method: str) -> str:
    """The method the out-of-memory guard wraps for vLLM's ``method``: 0.34's ``_local`` half, else itself."""
    return f"{method}_local" if hasattr(model_class(), f"{method}_local") else method


def stock_methods() -> dict:
    return {name: model_class().__dict__[name] for name in PATCHED}


STOCK = stock_methods() if gemma4_mm is not None else {}


# ---- vLLM's model, built by vLLM on the CPU ---------------------------------------------------------------


@pytest.fixture(scope="module")
def target_model(vllm_process, tmp_path_factory):
    """The 26B/31B checkpoints' tower in bf16 with sdpa, on the meta device: only its shapes are read."""
    tower = dict(
        VISION_TOWERS[LOW_MEMORY_TOWER],
        patch_size=PATCH_SIZE,
        pooling_kernel_size=POOLING_KERNEL,
        position_embedding_size=POSITION_EMBEDDING_SIZE,
    )
    vision = modeling.Gemma4VisionConfig(**tower)
    return build_vllm_model(tmp_path_factory.mktemp("target"), vision, torch.bfloat16, device="meta")


def patch_both():
    apply_fused_vision_to_gemma4()
    assert apply_fused_vision_to_vllm_gemma4() == 3


@needs_vllm
def test_the_target_tower_is_what_vllm_built(target_model):
    config = target_model.vision_tower.config
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (1152, 4304, 27)
    assert (config.num_attention_heads, config.head_dim, config.position_embedding_size) == (16, 72, 10240)
    assert (config.patch_size, config.pooling_kernel_size, config._attn_implementation) == (16, 3, "sdpa")
    assert target_model.model_dtype == torch.bfloat16


# ---- the chunk: the planner's through a model, vLLM's through the class ------------------------------------


@needs_vllm
@pytest.mark.parametrize("patches, vllms, planned", [(IMAGE, 1, 16), (FRAME, 7, 67)], ids=["images", "frames"])
def test_the_26b_31b_tower_on_3_of_22_gib_gets_the_planners_chunk(target_model, patches, vllms, planned):
    free, total, rows = 3 * GiB, 22 * GiB, POSITION_EMBEDDING_SIZE
    assert target_model._encoder_chunk(patches, free, total, rows) == vllms  # stock
    patch_both()
    assert target_model._encoder_chunk(patches, free, total, rows) == planned
    assert model_class()._encoder_chunk(patches, free, total, rows) == vllms, "through the class: vLLM's"
    price = planner.transient_bytes_per_item(patches, target_model.vision_tower.config, dtype=torch.bfloat16)
    budget = min(free // 2, total // 10)
    assert planned * price <= budget < (planned + 1) * price, "the largest chunk within vLLM's budget"


@needs_vllm
def test_a_reading_with_more_free_than_total_memory_gets_vllms_own_chunk(target_model):
    """No device reads so; the planner would raise on it, and vLLM's formula, its safety net, answers."""
    patch_both()
    free, total = 22 * GiB, 3 * GiB
    with pytest.warns(RuntimeWarning, match="free_bytes=.* > total_bytes="):
        chunk = target_model._encoder_chunk(IMAGE, free, total, POSITION_EMBEDDING_SIZE)
    assert chunk == model_class()._encoder_chunk(IMAGE, free, total, POSITION_EMBEDDING_SIZE)


@needs_vllm
def test_a_stock_one_hot_embedder_is_priced_as_vllm_prices_it(target_model, monkeypatch):
    """Where a 5.5-5.9 embedder runs its stock one-hot (vLLM 0.33 pins 5.16+, so it is played here), the
    one-hot is the price: with sdpa, vLLM's own answer."""
    monkeypatch.setattr(fg, "onehot_lookup", lambda: True)
    assert apply_fused_vision_to_vllm_gemma4(embedder=None) == 2  # the pooler and vLLM's model; the embedder stock
    arguments = (3 * GiB, 22 * GiB, POSITION_EMBEDDING_SIZE)
    assert [target_model._encoder_chunk(patches, *arguments) for patches in (IMAGE, FRAME)] == [1, 7]
    apply_fused_vision_to_gemma4()  # now the lookup is fused
    assert [target_model._encoder_chunk(patches, *arguments) for patches in (IMAGE, FRAME)] == [16, 67]


@needs_vllm
def test_vllms_loop_runs_the_planners_chunks(tiny_model, memory, monkeypatch):
    patches = 64
    video = video_input(tiny_model, [2, 3], patches, seed=7)
    config, dtype = tiny_model.vision_tower.config, tiny_model.model_dtype
    price = planner.transient_bytes_per_item(patches, config, dtype=dtype)
    memory(4 * price + 3, 1000 * GiB)  # budget: half the free bytes, room for 2 frames
    patch_both()
    sizes = out_of_memory_above(monkeypatch, tiny_model.vision_tower.encoder, limit=5)  # records, never raises
    with torch.no_grad():
        tiny_model._process_video_input(video)
    assert sizes == [2, 2, 1]
    assert model_class()._encoder_chunk(patches, 4 * price + 3, 1000 * GiB, 64) == 1  # vLLM's one-hot price


@needs_vllm
def test_the_revert_restores_vllms_methods_exactly(target_model):
    patch_both()
    assert repr(target_model).splitlines()[1].strip() == "fused_vision=planner"
    saved = target_model._encoder_chunk  # ours, bound: a caller may hold it across the revert
    assert revert_fused_vision_vllm_gemma4() == 3, "vLLM's class and transformers' two"
    assert not transformers_is_patched()
    assert saved(IMAGE, 3 * GiB, 22 * GiB, POSITION_EMBEDDING_SIZE) == 1, "a method saved before runs stock after"
    assert stock_methods() == STOCK and all(stock_methods()[name] is STOCK[name] for name in PATCHED)
    assert not any(name.startswith("_fused_vision") for name in vars(model_class()))
    assert target_model._encoder_chunk(IMAGE, 3 * GiB, 22 * GiB, POSITION_EMBEDDING_SIZE) == 1
    assert revert_fused_vision_vllm_gemma4() == 0


# ---- the keywords every apply_… shares, and model= ----------------------------------------------------------

TOWER = ("Gemma4VisionPatchEmbedder", "Gemma4VisionPooler", "Gemma4VisionModel", "Gemma4VisionEncoder")


def tower_states() -> list:
    return [str(fv.patching.fused_state(getattr(modeling, name))) for name in TOWER]


@needs_vllm
def test_one_call_patches_the_tower_as_transformers_apply_does(target_model):
    keywords = dict(embedder="position_embeddings", pooler=False, encoder="packed", backend="reference")
    assert apply_fused_vision_to_vllm_gemma4(**keywords) == 4, "the embedder, tower, encoder and vLLM's class"
    assert apply_fused_vision_to_vllm_gemma4(**keywords) == 4, "again: the same patch"
    assert vllm_is_patched() and fv.patching.fused_state(model_class()) == "planner"
    states = tower_states()
    assert states == ["position_embeddings(backend=reference)", "None", *["packed_encoder(backend=reference)"] * 2]
    assert apply_fused_vision_to_vllm_gemma4() == 3, "the embedder and pooler reconfigured, the encoder left packed"
    assert tower_states()[2:] == states[2:]
    revert_fused_vision_vllm_gemma4()
    assert apply_fused_vision_to_gemma4(**keywords) == 3
    assert tower_states() == states, "transformers' own call, the same states"


@needs_vllm
def test_bad_keywords_raise_before_anything_is_patched(target_model):
    for keywords, error in [
        (dict(embedder=None, pooler=False), "apply_fused_vision_to_vllm_gemma4: nothing selected"),
        (dict(embedder="one_hot"), "embedder: expected one of"),
        (dict(encoder="fused", backend="cuda"), "backend: expected one of"),
    ]:
        with pytest.raises(ValueError, match=error):
            apply_fused_vision_to_vllm_gemma4(target_model, **keywords)
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module or None, got str"):
        apply_fused_vision_to_vllm_gemma4("google/gemma-4-31b-it")
    with pytest.raises(ValueError, match="Linear contains no .*LLM.apply_model hands it over"):
        apply_fused_vision_to_vllm_gemma4(torch.nn.Linear(2, 2))
    assert not transformers_is_patched() and not vllm_is_patched()
    assert fv.patching.fused_state(target_model) is None


@needs_vllm
def test_a_model_patched_alone_plans_its_own_chunks(target_model, tiny_model):
    arguments = (IMAGE, 3 * GiB, 22 * GiB, POSITION_EMBEDDING_SIZE)
    assert apply_fused_vision_to_vllm_gemma4(target_model) == 3, "its embedder, its pooler and itself"
    assert apply_fused_vision_to_vllm_gemma4(target_model) == 3, "again: the same patch"
    assert target_model._encoder_chunk(*arguments) == 16
    assert tiny_model._encoder_chunk(*arguments) == 1, "another model: vLLM's chunk"
    assert fv.patching.fused_state(tiny_model.vision_tower.patch_embedder) is None
    assert fv.patching.fused_state(model_class()) is None and tower_states() == ["None"] * 4, "the classes: stock"
    assert revert_fused_vision_vllm_gemma4(target_model) == 3
    assert target_model._encoder_chunk(*arguments) == 1
    apply_fused_vision_to_vllm_gemma4()
    assert revert_fused_vision_vllm_gemma4(target_model) == 3, "pinned to stock while the classes are patched"
    assert target_model._encoder_chunk(*arguments) == 1 and tiny_model._encoder_chunk(*arguments) > 1
    assert apply_fused_vision_to_vllm_gemma4(tiny_model.vision_tower) == 2, "a tower without vLLM's model: alone"


@needs_vllm
def test_a_model_patched_alone_runs_its_encoder_and_its_guard(tiny_model, memory, monkeypatch):
    assert apply_fused_vision_to_vllm_gemma4(tiny_model, encoder="fused") == 5, "4 tower modules and the model"
    assert str(fv.patching.fused_state(tiny_model.vision_tower.encoder)) == "fused_encoder(backend=auto)"
    inputs = video_input(tiny_model, [2, 3], 64, seed=15)
    *_, unconstrained = run(tiny_model, "_process_video_input", inputs)
    called = out_of_memory_above(monkeypatch, tiny_model.vision_tower.encoder, limit=2)
    warning = "ran out of memory at 5 items per vision-tower call; went on with at most 2$"
    with pytest.warns(RuntimeWarning, match=warning):
        *_, got = run(tiny_model, "_process_video_input", inputs)
    assert called == [5, 2, 2, 1]
    for index, (g, e) in enumerate(zip(got, unconstrained, strict=True)):
        assert_bit_identical(g, e, f"item {index}")


@needs_vllm
@pytest.mark.parametrize("patched", [False, True], ids=["stock", "patched"])
def test_vllms_own_encoder_chunk_cases_through_the_class(patched):
    """vLLM's wheel ships no tests; its `_encoder_chunk` cases restated, and the class's answer equal to
    ``planner.encoder_chunk`` (fused_vision's copy of vLLM's function) on random integers."""
    if patched:
        patch_both()
    chunk = model_class()._encoder_chunk
    assert chunk is STOCK["_encoder_chunk"].__func__
    rows = POSITION_EMBEDDING_SIZE
    assert [chunk(IMAGE, 3 * GiB, 22 * GiB, rows), chunk(FRAME, 3 * GiB, 22 * GiB, rows)] == [1, 7]
    assert [chunk(IMAGE, 100 * GiB, 139 * GiB, rows), chunk(FRAME, 100 * GiB, 139 * GiB, rows)] == [18, 72]
    assert chunk(0, GiB, GiB, rows) == chunk(IMAGE, 1, 1, rows) == chunk(IMAGE, GiB, GiB, 0) == 1
    rng = random.Random(11)
    for _ in range(2000):
        args = (rng.randint(-5, 5000), rng.randint(-GiB, 200 * GiB), rng.randint(0, 200 * GiB), rng.randint(0, 20000))
        assert chunk(*args) == planner.encoder_chunk(*args), args


@needs_vllm
@pytest.mark.parametrize(
    "module, name",
    [("embedding_gemma2", "EmbeddingGemma2Model"), ("diffusion_gemma", "DiffusionGemmaForConditionalGeneration")],
)
def test_models_that_copy_the_methods_in_their_class_bodies_keep_vllms(monkeypatch, module, name):
    patch_both()
    module = f"vllm.model_executor.models.{module}"
    monkeypatch.delitem(sys.modules, module, raising=False)  # its class body runs now, under the patch
    copies = vars(getattr(importlib.import_module(module), name))
    assert copies["_encoder_chunk"].__func__ is STOCK["_encoder_chunk"].__func__
    copied = [name for name in PATCHED[1:] if name in copies]
    assert copied and all(copies[name] is STOCK[name] for name in copied)


# ---- numerics: vLLM's image and video paths, stock and patched ---------------------------------------------


@needs_vllm
@pytest.mark.parametrize("method", ["_process_image_input", "_process_video_input"], ids=["images", "video"])
def test_vllms_embeddings_match_stock_without_a_one_hot(tiny_model, memory, monkeypatch, method):
    inputs = vision_input(tiny_model, method, seed=9)
    one_hots, one_hot = [], torch.nn.functional.one_hot
    monkeypatch.setattr(
        torch.nn.functional, "one_hot", lambda *args, **kwargs: one_hots.append(1) or one_hot(*args, **kwargs)
    )
    stock_embedded, stock_pooled, stock = run(tiny_model, method, inputs)
    assert one_hots, "stock's pooler builds a one-hot: the check below can fail"

    patch_both()

    def no_one_hot(*args, **kwargs):
        raise AssertionError("the patched tower called F.one_hot")

    lookups, lookup = [], stem._fused_position_embeddings
    monkeypatch.setattr(torch.nn.functional, "one_hot", no_one_hot)
    monkeypatch.setattr(
        stem, "_fused_position_embeddings", lambda *args, **kwargs: lookups.append(1) or lookup(*args, **kwargs)
    )
    embedded, pooled, fused = run(tiny_model, method, inputs)
    chunks = 2 if method == "_process_image_input" else 1  # the image buckets; all frames at once
    assert len(lookups) == chunks, "each chunk's lookup is fused"
    # 0.33 calls the embedder's forward; 0.34 inlines it and calls its _position_embeddings alone
    assert len(embedded) == len(stock_embedded) == (0 if hasattr(model_class(), "_embed_patches") else chunks)
    for got, expected in zip(embedded, stock_embedded, strict=True):
        assert_bit_identical(got, expected, "patch embedder")
    assert_within_one_rounding(pooled[0], stock_pooled[0], "pooled soft tokens")
    assert len(fused) == len(stock)
    for index, (got, expected) in enumerate(zip(fused, stock, strict=True)):
        assert got.dtype == expected.dtype == tiny_model.model_dtype
        assert_within_one_rounding(got, expected, f"embeddings of item {index}")


def assert_within_one_rounding(got, expected, what):
    """An ulp of the dtype from stock: of each element, or of the largest one for those near zero."""
    ulp = ULP[expected.dtype]
    assert_close(got, expected, rtol=ulp, atol=ulp * expected.abs().max().item(), what=what)


# ---- the out-of-memory guard ---------------------------------------------------------------------------


@needs_vllm
@pytest.mark.parametrize(
    "method, limit, sizes, message",
    [
        ("_process_video_input", 2, [5, 2, 2, 1], "at 5 items per vision-tower call; went on with at most 2"),
        # the second bucket's chunk ran out, not the first's: cut to its 3 items, then halved
        ("_process_image_input", 2, [2, 3, 1, 1, 1, 1, 1], "at 3 items per vision-tower call; went on with at most 1"),
    ],
    ids=["video", "images"],
)
def test_a_call_that_runs_out_of_memory_runs_again_at_half_the_chunk(
    tiny_model, memory, monkeypatch, method, limit, sizes, message
):
    patch_both()
    inputs = vision_input(tiny_model, method, seed=12)
    *_, unconstrained = run(tiny_model, method, inputs)
    called = out_of_memory_above(monkeypatch, tiny_model.vision_tower.encoder, limit)
    with pytest.warns(RuntimeWarning, match=f"vLLM's {guarded(method)} ran out of memory {message}$"):
        *_, got = run(tiny_model, method, inputs)
    assert called == sizes
    assert len(got) == len(unconstrained)
    for index, (g, e) in enumerate(zip(got, unconstrained, strict=True)):
        assert_bit_identical(g, e, f"item {index}")
    assert fv._GUARDED.get() is None, "the guard leaves no cap behind for the next call"


@needs_vllm
def test_one_frame_that_does_not_fit_raises_its_error(tiny_model, memory, monkeypatch):
    patch_both()
    inputs = video_input(tiny_model, [2, 3], 64, seed=13)
    called = out_of_memory_above(monkeypatch, tiny_model.vision_tower.encoder, limit=0)
    warning = "ran out of memory at 5 -> 2 -> 1 items per vision-tower call; re-raised the last error$"
    with pytest.warns(RuntimeWarning, match=warning), pytest.raises(torch.OutOfMemoryError, match="injected: 1 items"):
        run(tiny_model, "_process_video_input", inputs)
    assert called == [5, 2, 1]
    assert fv._GUARDED.get() is None


@needs_vllm
def test_under_mm_lora_there_is_no_chunk_to_halve(tiny_model, memory, monkeypatch, recwarn):
    """vLLM encodes every image in one call under MM-LoRA and asks ``_encoder_chunk`` nothing."""
    patch_both()
    monkeypatch.setattr(tiny_model, "_enable_mm_lora", True)
    # the images are padded to this many soft tokens' patches, 64; a checkpoint's config.json names it
    monkeypatch.setattr(tiny_model.config.vision_config, "default_output_length", 16, raising=False)
    called = out_of_memory_above(monkeypatch, tiny_model.vision_tower.encoder, limit=2)
    with pytest.raises(torch.OutOfMemoryError, match="injected: 5 items"):
        run(tiny_model, "_process_image_input", image_input(tiny_model, seed=14))
    assert called == [5]
    assert not [w for w in recwarn if "ran out of memory" in str(w.message)]


@needs_vllm
def test_a_vllm_without_a_method_is_patched_where_it_can_be(target_model, monkeypatch):
    video = guarded("_process_video_input")
    monkeypatch.delattr(model_class(), video)
    if video != "_process_video_input":  # 0.34: without the _local half, the whole call is guarded
        monkeypatch.delattr(model_class(), "_process_video_input")
    with pytest.warns(RuntimeWarning, match="has no _process_video_input: no out-of-memory guard there"):
        assert apply_fused_vision_to_vllm_gemma4() == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert apply_fused_vision_to_vllm_gemma4() == 3, "again: the same patch, and no second warning"
    assert [name for name in PATCHED if isinstance(vars(model_class()).get(name), fv.patching.InstanceMethod)] == [
        name for name in PATCHED if name != video
    ], "the two methods it has"
    assert target_model._encoder_chunk(IMAGE, 3 * GiB, 22 * GiB, POSITION_EMBEDDING_SIZE) == 16
    assert video not in vars(model_class())
    assert revert_fused_vision_vllm_gemma4() == 3
    assert all(vars(model_class())[name] is STOCK[name] for name in PATCHED[:2])

    monkeypatch.delattr(model_class(), "_encoder_chunk")
    with pytest.warns(RuntimeWarning, match="has no _encoder_chunk: its chunks stay vLLM's"):
        assert apply_fused_vision_to_vllm_gemma4() == 2, "the tower alone"
    assert vars(model_class())[PATCHED[1]] is STOCK[PATCHED[1]]
    assert transformers_is_patched() and fv.patching.fused_state(model_class()) is None
