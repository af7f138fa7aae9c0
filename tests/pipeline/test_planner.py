"""The encoder chunk planner: vLLM's formula kept exactly, the transient model, the packed price."""

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fused_vision.pipeline import planner
from fused_vision.pipeline.planner import encoder_chunk, plan, transient_bytes_per_item

from real_towers import FRAME, IMAGE, TOWER_26B_31B, TOWER_E2B_E4B, GiB, MiB, P


def vllm_encoder_chunk(patches_per_item, free_bytes, total_bytes, position_embedding_size):
    """vLLM's ``_encoder_chunk`` (gemma4_mm.py), restated line by line."""
    if patches_per_item <= 0:
        return 1
    budget = min(free_bytes // 2, total_bytes // 10)
    if budget <= 0:
        return 1
    cost = patches_per_item * 4 * position_embedding_size * 8
    return max(1, budget // cost) if cost > 0 else 1


# ---- encoder_chunk: vLLM's function ------------------------------------------------------------------


@pytest.mark.parametrize("patches, expected", [(FRAME, 7), (IMAGE, 1)])
def test_small_card_keeps_the_onehot_within_half_the_free_memory(patches, expected):
    free, total = 3 * GiB, 22 * GiB
    chunk = encoder_chunk(patches, free, total, P)
    assert chunk == expected
    assert chunk == 1 or chunk * patches * 32 * P <= free // 2


@pytest.mark.parametrize("patches, expected", [(FRAME, 72), (IMAGE, 18)])
def test_large_card_batches(patches, expected):
    assert encoder_chunk(patches, 100 * GiB, 139 * GiB, P) == expected


def test_60_of_80_gib_keeps_batching():
    assert encoder_chunk(FRAME, 60 * GiB, 80 * GiB, P) == (8 * GiB) // (FRAME * 32 * P) > 1
    assert encoder_chunk(IMAGE, 60 * GiB, 80 * GiB, P) > 1


@pytest.mark.parametrize(
    "args",
    [
        (0, 100 * GiB, 139 * GiB, P),  # zero patches
        (-5, 100 * GiB, 139 * GiB, P),
        (FRAME, 100 * GiB, 139 * GiB, 0),  # zero position_embedding_size: no division by zero
        (FRAME, 100 * GiB, 139 * GiB, -1),
        (FRAME, 0, 139 * GiB, P),  # zero free memory
        (FRAME, -GiB, 139 * GiB, P),
        (FRAME, 100 * GiB, 0, P),
        (FRAME, 1, 1, P),  # budget far below one item
    ],
)
def test_degenerate_inputs_give_one(args):
    assert encoder_chunk(*args) == 1


def test_matches_vllm_on_random_integers():
    rng = random.Random(0)
    scales = [1, 10, 2**10, 2**20, 2**31, 2**40, 2**70]
    for _ in range(5000):
        args = [rng.randint(-rng.choice(scales), rng.choice(scales)) for _ in range(4)]
        if rng.random() < 0.5:  # mostly realistic inputs, where the quotient is not trivially 1
            args = [rng.randint(-10, 12000), rng.randint(-GiB, 200 * GiB), rng.randint(0, 200 * GiB)]
            args.append(rng.randint(-2, P))
        chunk = encoder_chunk(*args)
        assert chunk == vllm_encoder_chunk(*args), args
        assert chunk >= 1


def test_numpy_integers_do_not_overflow():
    # 32·N·P = 2**64 + 2**20 wraps to 2**20 in int64, which would admit 2**19 items.
    args = (np.int64(2**59 + 2**15), np.int64(2**40), np.int64(2**50), np.int64(1))
    assert encoder_chunk(*args) == vllm_encoder_chunk(*(int(a) for a in args)) == 1


# ---- plan -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("patches, fused_chunk", [(FRAME, 67), (IMAGE, 16)])
def test_fused_plan_admits_what_the_onehot_price_refused(patches, fused_chunk):
    # 3 GiB free of 22 GiB: vLLM admits 7 frames or 1 image (above); the tower's activations allow more.
    chunk = plan(1000, patches, TOWER_26B_31B, free_bytes=3 * GiB, total_bytes=22 * GiB)
    assert chunk == fused_chunk
    assert chunk * transient_bytes_per_item(patches, TOWER_26B_31B) <= 3 * GiB // 2


@pytest.mark.parametrize("tower", [TOWER_26B_31B, TOWER_E2B_E4B], ids=["26b", "e2b"])
@pytest.mark.parametrize("patches", [FRAME, 1260, IMAGE, 5040, 10080])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_onehot_plan_is_vllms_with_sdpa(tower, patches, dtype):
    rng = random.Random(patches)
    for _ in range(200):
        total = rng.randint(GiB, 200 * GiB)
        free = rng.randint(0, total)
        items = rng.randint(1, 256)
        chunk = plan(items, patches, tower, path="onehot", free_bytes=free, total_bytes=total, dtype=dtype)
        assert chunk == min(items, encoder_chunk(patches, free, total, P))


def test_plan_properties_on_random_inputs():
    rng = random.Random(1)
    for _ in range(500):
        tower = rng.choice([TOWER_26B_31B, TOWER_E2B_E4B])
        patches = rng.choice([FRAME, 1260, IMAGE, 5040, 10080, rng.randint(1, 12000)])
        items = rng.randint(1, 512)
        total = rng.randint(0, 200 * GiB)
        free = rng.randint(0, total)
        kwargs = dict(
            dtype=rng.choice([torch.bfloat16, torch.float16, torch.float32]),
            attn_implementation=rng.choice(["sdpa", "eager"]),
        )
        fused = plan(items, patches, tower, free_bytes=free, total_bytes=total, **kwargs)
        onehot = plan(items, patches, tower, path="onehot", free_bytes=free, total_bytes=total, **kwargs)
        more_free = plan(items, patches, tower, free_bytes=free + GiB, total_bytes=total + 10 * GiB, **kwargs)
        assert 1 <= onehot <= fused <= more_free <= items
        cost = transient_bytes_per_item(patches, tower, **kwargs)
        assert fused == 1 or fused * cost <= min(free // 2, total // 10)


@pytest.mark.parametrize("free", [0, 1, 2**20])
def test_plan_without_memory_gives_one(free):
    assert plan(64, FRAME, TOWER_26B_31B, free_bytes=free, total_bytes=80 * GiB) == 1


def test_plan_queries_the_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (3 * GiB, 22 * GiB))
    assert plan(1000, IMAGE, TOWER_26B_31B, device="cuda") == 16
    chunk = plan(4, FRAME, TOWER_26B_31B, device="cpu")
    assert 1 <= chunk <= 4


def test_plan_defaults_to_the_current_accelerator(monkeypatch):
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (3 * GiB, 22 * GiB))
    assert plan(1000, FRAME, TOWER_26B_31B) == 67


def test_plan_on_a_cuda_build_without_a_gpu_plans_for_the_cpu(monkeypatch):
    """torch.accelerator names the build's accelerator unless asked whether one is available."""

    def cuda_build(check_available=False):
        return None if check_available else torch.device("cuda")

    def no_driver(*args, **kwargs):
        raise RuntimeError("Found no NVIDIA driver on your system")

    monkeypatch.setattr(torch.accelerator, "current_accelerator", cuda_build)
    monkeypatch.setattr(torch.cuda, "mem_get_info", no_driver)
    assert 1 <= plan(4, FRAME, TOWER_26B_31B) <= 4


def _tower_with(**changes):
    return SimpleNamespace(**{**vars(TOWER_26B_31B), **changes})


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(path="triton"), ValueError, "path"),
        (dict(num_items=0), ValueError, "num_items"),
        (dict(num_items=2.0), TypeError, "num_items"),
        (dict(num_items=True), TypeError, "num_items"),
        (dict(patches_per_item=0), ValueError, "patches_per_item"),
        (dict(free_bytes=GiB, total_bytes=None), ValueError, "free_bytes, total_bytes"),
        (dict(free_bytes=-1), ValueError, "free_bytes"),
        (dict(total_bytes=-1), ValueError, "total_bytes"),
        (dict(free_bytes=1.5), TypeError, "free_bytes"),
        (dict(total_bytes=1.5), TypeError, "total_bytes"),
        (dict(free_bytes=11 * GiB), ValueError, rf"free_bytes={11 * GiB} > total_bytes={10 * GiB}"),
        (dict(device="cpu"), ValueError, "device"),
        (dict(dtype=torch.int32), TypeError, "dtype"),
        (dict(dtype="bfloat16"), TypeError, "dtype"),
        (dict(attn_implementation="flash_attention_2"), ValueError, "attn_implementation"),
        (dict(vision_config=SimpleNamespace(hidden_size=1152)), TypeError, "vision_config"),
        (dict(vision_config=_tower_with(head_dim=0)), ValueError, "head_dim"),
        (dict(vision_config=_tower_with(num_key_value_heads=4)), ValueError, "num_key_value_heads"),
    ],
)
def test_plan_rejects_bad_arguments(kwargs, error, match):
    call = dict(num_items=8, patches_per_item=FRAME, vision_config=TOWER_26B_31B, free_bytes=GiB, total_bytes=10 * GiB)
    call.update(kwargs)
    with pytest.raises(error, match=match):
        plan(call.pop("num_items"), call.pop("patches_per_item"), call.pop("vision_config"), **call)


# ---- the transient model ----------------------------------------------------------------------------

# Measured baselines (bench/baselines.md): peak memory ("MB") of the stock 26B/31B tower per forward, random weights,
# bf16, sdpa, on an H200.
BASELINE_PEAKS = {
    (IMAGE, 1): 91,
    (IMAGE, 2): 182,
    (IMAGE, 4): 364,
    (IMAGE, 8): 729,
    (IMAGE, 16): 1455,
    (FRAME, 4): 87,
    (FRAME, 16): 347,
    (FRAME, 32): 693,
    (FRAME, 64): 1384,
}


@pytest.mark.parametrize("patches, items", sorted(BASELINE_PEAKS))
def test_model_bounds_the_baseline_h200_peaks(patches, items):
    # The baselines write MB; torch counts bytes and the figures are most likely MiB. Check each side
    # against the reading that is harder to pass: above the MiB figure, within 25 % of the MB one.
    measured = BASELINE_PEAKS[patches, items]
    predicted = items * transient_bytes_per_item(patches, TOWER_26B_31B, dtype=torch.bfloat16)
    assert measured * MiB <= predicted <= 1.25 * measured * 1e6


def test_layers_do_not_enter_but_eager_scores_do():
    deep = _tower_with(num_hidden_layers=270)
    assert transient_bytes_per_item(IMAGE, deep) == transient_bytes_per_item(IMAGE, TOWER_26B_31B)
    eager = transient_bytes_per_item(IMAGE, TOWER_26B_31B, attn_implementation="eager")
    assert eager >= 16 * IMAGE * IMAGE * (2 + 4 + 4)  # bf16 scores, their float32 copy, the float32 softmax
    # From 2520 patches up, eager attention costs more than vLLM's one-hot price: plan() sees it.
    assert eager > IMAGE * 32 * P
    assert transient_bytes_per_item(IMAGE, TOWER_26B_31B, path="onehot", attn_implementation="eager") == eager


def test_onehot_price_is_vllms_for_real_shapes():
    for patches in (FRAME, IMAGE, 10080):
        assert transient_bytes_per_item(patches, TOWER_26B_31B, path="onehot") == patches * 32 * P


def test_config_object_and_its_attn_implementation():
    transformers = pytest.importorskip("transformers")
    config = transformers.Gemma4VisionConfig(**vars(TOWER_26B_31B))
    assert transient_bytes_per_item(IMAGE, config) == transient_bytes_per_item(IMAGE, TOWER_26B_31B)
    eager_config = transformers.Gemma4VisionConfig(**vars(TOWER_26B_31B), attn_implementation="eager")
    eager = transient_bytes_per_item(IMAGE, TOWER_26B_31B, attn_implementation="eager")
    assert transient_bytes_per_item(IMAGE, eager_config) == eager
    assert transient_bytes_per_item(IMAGE, eager_config, attn_implementation="sdpa") < eager


# ---- the packed encoder ---------------------------------------------------------------------------------


@pytest.mark.parametrize("tower", [TOWER_26B_31B, TOWER_E2B_E4B], ids=["26b_31b", "e2b_e4b"])
def test_packed_price_per_real_patch(tower):
    """No mask and no padding: the docstring's phases with m = 0 and scores 2·b·Q + 4·H, per real patch."""
    b, D, I, H, d = 2, tower.hidden_size, tower.intermediate_size, tower.num_attention_heads, tower.head_dim  # noqa: E741
    Q, F = H * d, 3 * 16**2
    held = 2 * b * D + 2 * b * d
    per_patch = 64 + max(
        max(8 * F, b * F + 5 * b * D),
        held + 2 * b * D + 8 * D,
        held + b * D + 3 * b * Q + max(8 * Q, 2 * b * Q + 4 * H),
        held + 2 * b * D + 3 * b * I,
    )
    for real in (1, 567, 2268):
        packed = transient_bytes_per_item(real, tower, encoder="packed")
        assert packed == -(-real * per_patch * 21 // 20)
        assert packed < transient_bytes_per_item(real, tower), "cheaper than stock at the same N: no mask"
    assert planner.plan_tokens(2268, tower, free_bytes=3 * GiB, total_bytes=22 * GiB) == (3 * GiB // 2) // -(
        -per_patch * 21 // 20
    )


def test_packed_tokens_hold_more_than_stocks_items():
    """At 280 tokens (N = 2520, ~2268 real), the packed budget holds at least stock's items' patches."""
    memory = dict(free_bytes=3 * GiB, total_bytes=22 * GiB)
    items = plan(1000, IMAGE, TOWER_26B_31B, **memory)
    assert planner.plan_tokens(IMAGE, TOWER_26B_31B, **memory) >= items * IMAGE


def test_packed_eager_pricing_counts_the_longest_items_scores():
    """Where the kernel materialises scores (eager-priced: MPS), one item's at a time: a fixed term."""
    memory = dict(free_bytes=40 * GiB, total_bytes=80 * GiB, attn_implementation="eager")
    short, long = (planner.plan_tokens(n, TOWER_26B_31B, **memory) for n in (630, 2520))
    assert long < short
    sdpa = planner.plan_tokens(2520, TOWER_26B_31B, free_bytes=40 * GiB, total_bytes=80 * GiB)
    assert long < sdpa


def test_packed_onehot_and_extra_bytes_and_errors():
    memory = dict(free_bytes=3 * GiB, total_bytes=22 * GiB)
    onehot = planner.plan_tokens(2520, TOWER_26B_31B, path="onehot", **memory)
    assert onehot == (3 * GiB // 2) // (32 * P), "vLLM's budget over the one-hot's 32·P bytes per patch"
    assert planner.plan_tokens(2520, TOWER_26B_31B, extra_bytes_per_patch=10**6, **memory) < onehot
    assert planner.plan_tokens(1, TOWER_26B_31B, free_bytes=0, total_bytes=0) == 1
    with pytest.raises(ValueError, match="encoder: expected one of"):
        transient_bytes_per_item(630, TOWER_26B_31B, encoder="padded")
    with pytest.raises(ValueError, match="path: expected one of"):
        planner.plan_tokens(630, TOWER_26B_31B, path="packed", **memory)
    with pytest.raises(ValueError, match="longest_item"):
        planner.plan_tokens(0, TOWER_26B_31B, **memory)
    with pytest.raises(ValueError, match="free_bytes, total_bytes"):
        planner.plan_tokens(630, TOWER_26B_31B, free_bytes=1)
    with pytest.raises(ValueError, match=r"free_bytes=2 > total_bytes=1"):
        planner.plan_tokens(630, TOWER_26B_31B, free_bytes=2, total_bytes=1)
    with pytest.raises(ValueError, match="total_bytes"):
        planner.plan_tokens(630, TOWER_26B_31B, free_bytes=0, total_bytes=-1)
