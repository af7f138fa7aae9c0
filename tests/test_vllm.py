"""fused_vision.vllm against vLLM 0.33's own Gemma 4 model, built by vLLM from tiny random configs on the CPU.

The plugin's opt-in is tested anywhere. Everything else needs vLLM in an environment of its own (it brings
its torch and transformers: `pip install vllm==0.33.0`; `bash .ci/run tests_vllm` builds one) and skips
without it. Nothing is downloaded: each model's config is saved to a temporary directory vLLM reads.
"""

import importlib
import importlib.metadata
import random
import sys
import warnings

import pytest
import torch

import fused_vision.gemma4 as fg
import fused_vision.vllm as fv
from fused_vision import (
    apply_fused_vision_to_gemma4,
    apply_fused_vision_to_vllm_gemma4,
    planner,
    revert_fused_vision_gemma4,
    revert_fused_vision_vllm_gemma4,
)
from fused_vision.bench.tower import LOW_MEMORY_TOWER, VISION_TOWERS
from fused_vision.bench.workloads import PATCH_SIZE, POOLING_KERNEL, POSITION_EMBEDDING_SIZE

from conftest import assert_bit_identical, assert_close, dtype_id
from gemma4_towers import gemma4_config, modeling, out_of_memory_above, randomize, vision_config
from op_cases import ULP, grid_ids

try:
    gemma4_mm = importlib.import_module(fv.VLLM_MODULE)
    VLLM_MISSING = ""
except ImportError as exc:
    gemma4_mm = None
    VLLM_MISSING = f"vLLM's Gemma 4 is not importable ({exc}): pip install vllm==0.33.0, in an environment of its own"
needs_vllm = pytest.mark.skipif(gemma4_mm is None, reason=VLLM_MISSING)

GiB = 2**30
FRAME, IMAGE = 630, 2520  # patches per video frame (70 soft tokens) and per image (280), pooling kernel 3
PATCHED = ("_encoder_chunk", "_process_image_input", "_process_video_input")


@pytest.fixture(autouse=True)
def stock_after_each_test():
    yield
    revert_fused_vision_vllm_gemma4()
    revert_fused_vision_gemma4()


def model_class():
    return gemma4_mm.Gemma4ForConditionalGeneration


def stock_methods() -> dict:
    return {name: model_class().__dict__[name] for name in PATCHED}


STOCK = stock_methods() if gemma4_mm is not None else {}


def vllm_is_patched() -> bool:
    return all(isinstance(model_class().__dict__[name], fv.patching.InstanceMethod) for name in PATCHED)


def transformers_is_patched() -> bool:
    return modeling.Gemma4VisionPatchEmbedder.forward is fg._embedder_forward


# ---- the plugin --------------------------------------------------------------------------------------


def test_the_entry_point_is_in_the_installed_package_metadata():
    (entry_point,) = [
        e for e in importlib.metadata.entry_points(group="vllm.general_plugins") if e.dist.name == "fused-vision"
    ]
    assert (entry_point.name, entry_point.value) == ("fused_vision_gemma4", "fused_vision.vllm:vllm_plugin")
    assert entry_point.load() is fv.vllm_plugin


def test_the_plugin_does_nothing_without_the_variable(monkeypatch):
    monkeypatch.delenv(fv.ENV_VLLM, raising=False)
    fv.vllm_plugin()
    assert not transformers_is_patched()
    assert gemma4_mm is None or not vllm_is_patched()


def test_the_plugin_patches_transformers_then_vllm(monkeypatch, caplog):
    monkeypatch.setenv(fv.ENV_VLLM, "1")
    with caplog.at_level("WARNING", logger="fused_vision"):
        fv.vllm_plugin()
    assert transformers_is_patched()
    if gemma4_mm is None:
        assert "FUSED_VISION_VLLM=1 but vLLM's Gemma 4 cannot be patched here" in caplog.text
    else:
        assert vllm_is_patched()
        assert not [record for record in caplog.records if record.name == "fused_vision"]


def test_the_plugin_warns_and_never_raises(monkeypatch, caplog):
    """vLLM runs its plugins unguarded in every process: an error there would stop vLLM's start-up."""
    monkeypatch.setenv(fv.ENV_VLLM, "1")
    monkeypatch.setitem(sys.modules, "transformers.models.gemma4.modeling_gemma4", None)
    monkeypatch.setitem(sys.modules, fv.VLLM_MODULE, None)
    with caplog.at_level("WARNING", logger="fused_vision"):
        fv.vllm_plugin()
    assert "FUSED_VISION_VLLM=1 but Gemma 4 cannot be patched here" in caplog.text
    assert "FUSED_VISION_VLLM=1 but vLLM's Gemma 4 cannot be patched here" in caplog.text

    monkeypatch.setattr(fv, "apply_fused_vision_to_vllm_gemma4", lambda: 1 / 0)  # no ImportError: still caught
    caplog.clear()
    with caplog.at_level("WARNING", logger="fused_vision"):
        fv.vllm_plugin()
    assert "vLLM's Gemma 4 cannot be patched here (division by zero)" in caplog.text


@needs_vllm
@pytest.mark.parametrize(
    "variable, allowed, patched",
    [
        (None, None, False),
        ("1", None, True),
        ("0", None, False),
        ("1", "fused_vision_gemma4", True),
        ("1", "lora_filesystem_resolver", False),  # another plugin allowed, ours not
        ("1", "", False),  # VLLM_PLUGINS="" allows none
    ],
)
def test_vllms_plugin_loader_patches_only_when_asked(monkeypatch, variable, allowed, patched):
    import vllm.plugins

    for name, value in ((fv.ENV_VLLM, variable), ("VLLM_PLUGINS", allowed)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)  # vLLM loads them once per process
    vllm.plugins.load_general_plugins()
    assert vllm_is_patched() == transformers_is_patched() == patched


# ---- vLLM's model, built by vLLM on the CPU ---------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_process(tmp_path_factory):
    """What vLLM's constructors need in a CPU-only process: a one-process group (its ReplicatedLinear asks for
    one), and an attention backend for the language model's layers, which this platform names none of."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.platforms import current_platform

    with pytest.MonkeyPatch.context() as patch, set_current_vllm_config(VllmConfig(device_config=DeviceConfig("cpu"))):
        cpu_attention = "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"
        patch.setattr(current_platform, "get_attn_backend_cls", lambda *args, **kwargs: cpu_attention)
        rendezvous = f"file://{tmp_path_factory.mktemp('gloo')}/rendezvous"
        parallel_state.init_distributed_environment(1, 0, rendezvous, 0, backend="gloo")
        parallel_state.ensure_model_parallel_initialized(1, 1)
        yield
        parallel_state.destroy_model_parallel()
        parallel_state.destroy_distributed_environment()


def build_vllm_model(directory, vision, dtype, device="cpu"):
    """vLLM's ``Gemma4ForConditionalGeneration`` from a tiny Gemma 4 config with ``vision`` as its tower."""
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    config = gemma4_config(vision)
    config.architectures = ["Gemma4ForConditionalGeneration"]
    config.save_pretrained(directory)
    model_config = ModelConfig(model=str(directory), skip_tokenizer_init=True, dtype=dtype)
    vllm_config = VllmConfig(model_config=model_config, device_config=DeviceConfig("cpu"))
    # As vLLM's model loader builds it, without the weights it would load next.
    with set_current_vllm_config(vllm_config), set_default_torch_dtype(dtype), torch.device(device):
        model = initialize_model(vllm_config=vllm_config)
    assert type(model) is model_class()
    return model.eval()


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=dtype_id)
def tiny_model(request, vllm_process, tmp_path_factory):
    """A tiny model with fresh random weights (vLLM leaves the tower as torch.empty made it)."""
    model = build_vllm_model(tmp_path_factory.mktemp("tiny"), vision_config(standardize=True), request.param)
    randomize(model.vision_tower, seed=5)
    randomize(model.embed_vision, seed=6)
    return model


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


@pytest.fixture
def memory(monkeypatch):
    """Sets the (free, total) bytes vLLM's loops read: torch.accelerator.get_memory_info raises without a driver."""

    def set_memory(free, total):
        monkeypatch.setattr(torch.accelerator, "get_memory_info", lambda *args: (free, total))

    set_memory(100 * GiB, 139 * GiB)
    return set_memory


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
def test_a_stock_one_hot_embedder_is_priced_as_vllm_prices_it(target_model, monkeypatch):
    """Where a 5.5-5.9 embedder runs its stock one-hot (vLLM 0.33 pins 5.16+, so it is played here), the
    one-hot is the price: with sdpa, vLLM's own answer."""
    monkeypatch.setattr(fg, "onehot_lookup", lambda: True)
    assert apply_fused_vision_to_vllm_gemma4() == 3  # transformers' classes stay stock
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
    assert revert_fused_vision_vllm_gemma4() == 1
    assert saved(IMAGE, 3 * GiB, 22 * GiB, POSITION_EMBEDDING_SIZE) == 1, "a method saved before runs stock after"
    assert stock_methods() == STOCK and all(stock_methods()[name] is STOCK[name] for name in PATCHED)
    assert not any(name.startswith("_fused_vision") for name in vars(model_class()))
    assert target_model._encoder_chunk(IMAGE, 3 * GiB, 22 * GiB, POSITION_EMBEDDING_SIZE) == 1
    assert revert_fused_vision_vllm_gemma4() == 0


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
    assert copies["_process_image_input"] is STOCK["_process_image_input"]
    assert copies["_process_video_input"] is STOCK["_process_video_input"]


# ---- inputs as vLLM's processors hand them ----------------------------------------------------------------


def items(grids, patches, seed):
    """Random pixels on each grid's patches, zero on the padding (as the processor pads), and their ids."""
    generator = torch.Generator().manual_seed(seed)
    ids = [grid_ids(w, h, patches) for w, h in grids]
    pixels = [
        torch.rand(patches, 3 * 2**2, generator=generator).masked_fill((i == -1).all(-1, keepdim=True), 0) for i in ids
    ]
    return pixels, ids


def image_input(model, seed):
    """Images of two resolution buckets, interleaved: the first (16 patches) holds 2, the second (64) 3."""
    small, big = items([(4, 4), (2, 6)], 16, seed), items([(8, 6), (4, 10), (6, 2)], 64, seed + 1)
    order = [(small, 0), (big, 0), (small, 1), (big, 1), (big, 2)]
    pixels, ids = [source[0][i] for source, i in order], [source[1][i] for source, i in order]
    return model._parse_and_validate_image_input(pixel_values=pixels, pixel_position_ids=ids)


def video_input(model, frame_counts, patches, seed):
    grids = [[(8, 6), (4, 10), (6, 2)][i % 3] for i in range(sum(frame_counts))]
    pixels, ids = items(grids, patches, seed)
    return model._parse_and_validate_video_input(
        pixel_values_videos=torch.stack(pixels),
        pixel_position_ids_videos=torch.stack(ids),
        video_frame_counts=torch.tensor(frame_counts),
    )


def vision_input(model, method, seed):
    """What ``method`` takes: the images above, or two videos of 2 and 3 frames of 64 patches."""
    return image_input(model, seed) if method == "_process_image_input" else video_input(model, [2, 3], 64, seed)


def run(model, method, inputs):
    """vLLM's ``method`` on ``inputs``: what its patch embedder returned, what its projection was handed
    (the pooled, standardized soft tokens) and its embeddings."""
    embedded, pooled = [], []
    hooks = [
        model.vision_tower.patch_embedder.register_forward_hook(lambda module, args, out: embedded.append(out)),
        model.embed_vision.register_forward_pre_hook(
            lambda module, args, kwargs: pooled.append(kwargs["inputs_embeds"]), with_kwargs=True
        ),
    ]
    try:
        with torch.no_grad():
            embeddings = getattr(model, method)(inputs)
    finally:
        for hook in hooks:
            hook.remove()
    return embedded, pooled, embeddings


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

    lookups, lookup = [], fg._fused_position_embeddings
    monkeypatch.setattr(torch.nn.functional, "one_hot", no_one_hot)
    monkeypatch.setattr(
        fg, "_fused_position_embeddings", lambda *args, **kwargs: lookups.append(1) or lookup(*args, **kwargs)
    )
    embedded, pooled, fused = run(tiny_model, method, inputs)
    chunks = 2 if method == "_process_image_input" else 1  # the image buckets; all frames at once
    assert len(embedded) == len(stock_embedded) == len(lookups) == chunks, "each chunk's lookup is fused"
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
        ("_process_video_input", 2, [5, 2, 2, 1], "at 5 items per vision-tower call; re-ran with at most 2"),
        # the second bucket's chunk ran out, not the first's: cut to its 3 items, then halved
        ("_process_image_input", 2, [2, 3, 1, 1, 1, 1, 1], "at 3 items per vision-tower call; re-ran with at most 1"),
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
    with pytest.warns(RuntimeWarning, match=f"vLLM's {method} ran out of memory {message}$"):
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
    monkeypatch.delattr(model_class(), "_process_video_input")
    with pytest.warns(RuntimeWarning, match="has no _process_video_input: no out-of-memory guard there"):
        assert apply_fused_vision_to_vllm_gemma4() == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert apply_fused_vision_to_vllm_gemma4() == 2, "again: the same patch, and no second warning"
    assert target_model._encoder_chunk(IMAGE, 3 * GiB, 22 * GiB, POSITION_EMBEDDING_SIZE) == 16
    assert "_process_video_input" not in vars(model_class())
    assert revert_fused_vision_vllm_gemma4() == 1
    assert all(vars(model_class())[name] is STOCK[name] for name in PATCHED[:2])

    monkeypatch.delattr(model_class(), "_encoder_chunk")
    with pytest.warns(RuntimeWarning, match="has no _encoder_chunk: its chunks stay vLLM's"):
        assert apply_fused_vision_to_vllm_gemma4() == 0
    assert vars(model_class())["_process_image_input"] is STOCK["_process_image_input"]
