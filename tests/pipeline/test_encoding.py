"""fused_vision.encode_images against transformers' own Gemma 4 vision tower, on tiny random configs.

Runs against whichever transformers is importable; `.ci/run` runs it again on transformers 5.9 (the
one-hot era).
"""

import functools

import numpy as np
import pytest
import torch
from torch import nn

import fused_vision.pipeline.encoding as fe
import fused_vision.pipeline.planner as planner
from fused_vision import apply_fused_vision_to_gemma4, encode_images, revert_fused_vision_gemma4
from fused_vision.pipeline._inputs import resolve_tower

from gemma4_towers import (
    FP32_CLOSE,
    GRIDS,
    SEQ_LEN,
    SIZES,
    TINY_TEXT,
    VERSION,
    assert_items_close,
    assert_soft_tokens_match,
    float64_twin,
    fused_ops,
    make_inputs,
    make_tower,
    modeling,
    out_of_memory_above,
    processor_batch,
    randomize,
    run_tower,
    vision_config,
)
from helpers import assert_bit_identical, assert_close, dtype_id, reverting_to_stock

encode_padded = functools.partial(encode_images, packed=False)  # today's buckets by patch count


stock_after_each_test = reverting_to_stock(revert_fused_vision_gemma4)


@pytest.fixture
def planner_calls(monkeypatch):
    """Stand-in for fused_vision.pipeline.planner.plan: 3 items per call, recording what it was asked."""
    calls = []

    def plan(num_items, patches_per_item, tower, path, device, dtype, input_bytes_per_item):
        calls.append((num_items, patches_per_item, dtype))
        return 3

    monkeypatch.setattr(fe, "_plan_chunk", plan)
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
        got = encode_padded(tower, pixels, ids, max_batch=2)
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
        got = encode_padded(tower, pixels, ids, max_batch=1)
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
        got = encode_padded(tower, pixels, ids)
    assert sorted(planner_calls) == [(2, SEQ_LEN, torch.float32), (3, 16, torch.float32)]
    assert_items_close(got, expected)


def many_items(count, seed):
    grids = [GRIDS[i % len(GRIDS)] for i in range(count)]
    return make_inputs(grids, SEQ_LEN, seed=seed)


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "listed"])
def test_encode_images_halves_a_chunk_that_runs_out_of_memory(monkeypatch, stacked):
    tower = make_tower()
    apply_fused_vision_to_gemma4(tower)
    pixels, ids = many_items(7, seed=21)
    if not stacked:
        pixels, ids = list(pixels), list(ids)
    monkeypatch.setattr(fe, "_plan_chunk", lambda num_items, *args: num_items)  # all 7 in one call
    expected = encode_padded(tower, pixels, ids)
    sizes = out_of_memory_above(monkeypatch, tower.encoder, limit=2)
    warning = r"out of memory at 7 -> 3 items per call of 64 patches; went on with at most 1"
    with pytest.warns(RuntimeWarning, match=warning):
        got = encode_padded(tower, pixels, ids)
    assert sizes == [7, 3] + [1] * 7, "halved on each error, and the smaller chunk kept for the rest"
    assert len(got) == len(expected)
    assert_items_close(got, expected)


def test_encode_images_keeps_the_smaller_chunk_for_the_rest_of_the_bucket(monkeypatch):
    tower = make_tower()
    pixels, ids = many_items(5, seed=22)
    monkeypatch.setattr(fe, "_plan_chunk", lambda num_items, *args: num_items)
    expected = encode_padded(tower, pixels, ids)
    sizes = out_of_memory_above(monkeypatch, tower.encoder, limit=4)
    with pytest.warns(RuntimeWarning, match=r"out of memory at 5 items per call of 64 patches; went on with at most 2"):
        got = encode_padded(tower, pixels, ids)
    assert sizes == [5, 2, 2, 1]
    assert_items_close(got, expected)


def test_encode_images_reraises_where_one_item_does_not_fit(monkeypatch):
    tower = make_tower()
    pixels, ids = many_items(5, seed=23)
    monkeypatch.setattr(fe, "_plan_chunk", lambda num_items, *args: num_items)
    sizes = out_of_memory_above(monkeypatch, tower.encoder, limit=0)
    with pytest.raises(torch.OutOfMemoryError, match="injected: 1 items"):
        encode_padded(tower, pixels, ids)
    assert sizes == [5, 2, 1], "the caller's error, not a retry loop"


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
        got = encode_padded(model_with(tower), pixels, ids)
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
        encode_padded(model_with(tower), list(pixels), list(ids))  # stacked per chunk: a copy per item
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
        encode_padded(tower, pixels, ids)
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
        encode_padded(tower, items, list(ids))
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
    with pytest.raises(ValueError, match=r"pixel_values: item 2: expected 12 features \(3 x patch_size\*\*2"):
        encode_images(tower, [*pixels[:2], pixels[2, :, :-1]], list(ids))
    with pytest.raises(ValueError, match="pixel_values: item 0: expected 12 features"):  # the unpatched tower too
        encode_images(tower, pixels[..., :-1], ids, packed=False)
    with pytest.raises(TypeError, match="pixel_values: item 0: expected a floating-point dtype, got torch.int64"):
        encode_images(tower, pixels.long(), ids)
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
    tower = resolve_tower(model)
    assert type(tower) is modeling.Gemma4VisionModel
    randomize(tower, seed=3)
    pixels, ids = make_inputs(GRIDS, SEQ_LEN)
    stock, stock_items = run_tower(tower, pixels, ids), per_item_stock(tower, pixels, ids)

    assert apply_fused_vision_to_gemma4(model) == 2
    assert fused_ops(model) == ["patch_embed(backend=auto)", "pool_by_positions(backend=auto)"]
    assert_close(run_tower(tower, pixels, ids), stock, **FP32_CLOSE, what=f"{family} tower")
    for index, (got, expected) in enumerate(zip(encode_images(model, pixels, ids), stock_items, strict=True)):
        assert_close(got, expected, **FP32_CLOSE, what=f"{family} encode_images item {index}")


def test_processor_items_of_two_budgets_through_encode_padded(planner_calls):
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
        got = encode_padded(tower, pixels, ids, max_batch=2)
    assert sorted(planner_calls) == [(2, 560, torch.float32), (3, 280, torch.float32)]
    assert [g.shape[0] for g in got] == tokens
    assert_items_close(got, expected, what="image")
