"""The packed encoder (fused_vision.encoder.packed) against transformers' own Gemma 4 vision tower, item by item.

Runs against whichever transformers is importable; `.ci/run` runs it again on transformers 5.9 (the
one-hot era). Towers at both real head sizes, tiny otherwise: E2B/E4B-like (clipped linears, head_dim 64)
and 26B/31B-like (standardized, head_dim 72).
"""

import copy
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fused_vision.encoder.packed as fp
import fused_vision.pipeline.encoding as fe
import fused_vision.pipeline.planner as planner
from fused_vision import _dispatch, apply_fused_vision_to_gemma4, encode_images, revert_fused_vision_gemma4
from fused_vision.encoder import attention
from fused_vision.integrations import transformers as transformers_integration

from gemma4_towers import (
    FP32_CLOSE,
    GRIDS,
    KINDS,
    SEQ_LEN,
    SIZES,
    VERSION,
    alone,
    alone_in_float64,
    assert_gradients_match_stock,
    assert_items_close,
    assert_items_match,
    fused_ops,
    make_inputs,
    mixed_items,
    processor_batch,
    randomize,
    tower_of,
)
from helpers import DEVICE, assert_bit_identical, assert_close, dtype_id, reverting_to_stock

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


stock_after_each_test = reverting_to_stock(revert_fused_vision_gemma4)


@pytest.fixture
def packed_calls(monkeypatch):
    """The items of each packed encoder call."""
    calls, encode = [], fp.encode

    def recording(tower, pixels, ids, pooler_float32, *args, **kwargs):
        calls.append(len(pixels))
        return encode(tower, pixels, ids, pooler_float32, *args, **kwargs)

    monkeypatch.setattr(fp, "encode", recording)
    return calls


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("kind", KINDS)
def test_items_of_different_patch_counts_in_one_call_match_stock_alone(poisoned, packed_calls, kind, dtype):
    tower = tower_of(kind, dtype)
    pixels, ids = mixed_items()
    stock = alone(tower, pixels, ids)
    exact = alone_in_float64(tower, pixels, ids)
    got = encode_images(tower, pixels, ids)
    assert packed_calls == [5], "one packed call for every item"
    assert_items_match(got, stock, exact, dtype)
    assert tower.config._attn_implementation == "sdpa", "the config's attention is restored"


class _DataSizedOps(TorchDispatchMode):
    """Records the ops whose output size depends on tensor values (boolean indexing, nonzero, item): on a
    GPU each makes the host wait for the device's queued work."""

    SIZED = ("aten.nonzero.", "aten.masked_select.", "aten._local_scalar_dense.", "aten.unique")

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        boolean_index = func is torch.ops.aten.index.Tensor and any(
            i is not None and i.dtype == torch.bool for i in args[1]
        )
        if boolean_index or str(func).startswith(self.SIZED):
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("encoder", ["packed", "fused"])
def test_a_packed_call_given_its_counts_sizes_nothing_by_the_data(encoder, monkeypatch):
    """Items packed and their soft tokens gathered by indices whose counts the host holds, and the clipped
    linears' clamps compared by the first call only: nothing that would sync a GPU. Counting the items
    reads the device once, in one ``tolist`` (which no dispatch mode sees: the host reads are counted).
    The ops' PyTorch path checks its ids on the host, which the kernels do on the device: checks off."""
    tower = tower_of("e2b_like")
    pixels, ids = mixed_items()
    stock = alone(tower, pixels, ids)
    apply_fused_vision_to_gemma4(tower, encoder=encoder)
    config = tower.config
    pooler_float32 = transformers_integration.pooler_returns_float32()
    backend = "auto" if encoder == "fused" else None
    reads = []
    for name in ("tolist", "item", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, _recorded(getattr(torch.Tensor, name), name, reads))
    with torch.no_grad():
        fp.encode(tower, pixels, ids, pooler_float32, backend=backend)  # the first call reads the clamps
        reads.clear()
        counts = fp.count_items(ids, config.pooling_kernel_size, config.position_embedding_size)
        assert reads == ["tolist"], "one read of the device for all items"
        reads.clear()
        monkeypatch.setenv("FUSED_VISION_CHECK_IDS", "0")
        with _DataSizedOps() as recorded:
            got = fp.encode(tower, pixels, ids, pooler_float32, counts, backend)
    assert recorded.seen == [] and reads == []
    assert_items_match(got, stock, stock, torch.float32)


def _recorded(method, name, reads):
    def recording(self, *args, **kwargs):
        reads.append(name)
        return method(self, *args, **kwargs)

    return recording


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("kind", KINDS)
def test_processor_images_of_two_budgets_and_video_frames(packed_calls, kind, dtype):
    pixels70, ids70, tokens70 = processor_batch(SIZES, 70, seed=12)
    pixels140, ids140, tokens140 = processor_batch([(30, 90), (64, 64)], 140, seed=13)
    frames, frame_ids, frame_tokens = processor_batch([(36, 64)] * 4, 70, seed=14)  # video-like: one size
    pixels = [*pixels70, *pixels140, *frames]
    ids = [*ids70, *ids140, *frame_ids]
    positions = max(int(i.max()) for i in ids) + 1
    tower = tower_of(kind, dtype, patch_size=4, positions=positions)
    stock = alone(tower, pixels, ids)
    exact = alone_in_float64(tower, pixels, ids)
    got = encode_images(tower, pixels, ids)
    assert packed_calls == [len(pixels)]
    assert [g.shape[0] for g in got] == [*tokens70, *tokens140, *frame_tokens]
    assert_items_match(got, stock, exact, dtype)


@pytest.mark.parametrize("fused_ops_too", [False, True], ids=["stock_ops", "fused_ops"])
@pytest.mark.parametrize("kind", KINDS)
def test_the_patched_tower_forward_returns_stock_outputs(monkeypatch, kind, fused_ops_too):
    tower = tower_of(kind)
    pixels, ids = make_inputs(GRIDS + [(2, 2)], SEQ_LEN, seed=9)
    stock = tower(pixel_values=pixels, pixel_position_ids=ids)
    keywords = {} if fused_ops_too else dict(embedder=None, pooler=False)
    # the tower and its encoder, and the embedder and pooler with the fused ops
    assert apply_fused_vision_to_gemma4(tower, encoder="packed", **keywords) == (4 if fused_ops_too else 2)
    assert "packed_encoder(backend=auto)" in fused_ops(tower)
    calls, varlen = [], attention.varlen_attention
    monkeypatch.setattr(attention, "varlen_attention", lambda *a, **k: calls.append(a[4]) or varlen(*a, **k))
    got = tower(pixel_values=pixels, pixel_position_ids=ids)
    assert type(got) is type(stock) and list(got.keys()) == list(stock.keys())
    assert calls == [(48, 40, 12, 4)] * 2, "each layer attends within the items' real patches"
    assert_close(got.last_hidden_state, stock.last_hidden_state, **FP32_CLOSE, what="soft tokens")
    with torch.no_grad():  # stock's own forward wherever outputs are recorded
        recorded = tower(pixel_values=pixels, pixel_position_ids=ids, output_hidden_states=True)
    assert len(calls) == 2 and recorded.hidden_states is not None

    assert revert_fused_vision_gemma4(tower) >= 1
    assert_bit_identical(tower(pixel_values=pixels, pixel_position_ids=ids).last_hidden_state, stock.last_hidden_state)
    assert len(calls) == 2, "reverted: stock runs"


def test_the_class_patch_reaches_get_image_features(monkeypatch):
    from gemma4_towers import tiny_conditional_generation

    model = tiny_conditional_generation()
    randomize(model.model.vision_tower, seed=4)
    pixels, ids = make_inputs(GRIDS, SEQ_LEN, seed=10)
    pixels, ids = pixels.cpu(), ids.cpu()
    with torch.no_grad():
        stock = model.model.get_image_features(pixels, ids).pooler_output
        assert apply_fused_vision_to_gemma4(encoder="packed") == 4
        calls, varlen = [], attention.varlen_attention
        monkeypatch.setattr(attention, "varlen_attention", lambda *a, **k: calls.append(1) or varlen(*a, **k))
        got = model.model.get_image_features(pixels, ids).pooler_output
    assert calls, "the packed encoder ran"
    assert_close(got, stock, **FP32_CLOSE, what="image features")


def test_gradients_through_the_packed_tower_match_stock():
    stock_tower = tower_of("31b_like")
    tower = copy.deepcopy(stock_tower)
    apply_fused_vision_to_gemma4(tower, encoder="packed")
    pixels, ids = make_inputs(GRIDS, SEQ_LEN, seed=11)
    assert_gradients_match_stock(stock_tower, tower, pixels, ids)


def test_packed_calls_fill_up_to_the_token_budget(monkeypatch, packed_calls):
    tower = tower_of("e2b_like")
    pixels, ids = mixed_items()  # real patches 48, 16, 40, 12, 12
    budgets = []

    def plan_tokens(longest, config, **kwargs):
        budgets.append((longest, kwargs["path"], kwargs["extra_bytes_per_patch"]))
        return 60

    monkeypatch.setattr(planner, "plan_tokens", plan_tokens)
    expected = alone(tower, pixels, ids)
    got = encode_images(tower, pixels, ids)
    assert packed_calls == [1, 2, 2], "48 | 16 + 40 | 12 + 12: whole items up to 60 patches"
    # an unpatched 5.5-5.9 tower's embedder builds the one-hot the planner must price
    assert budgets == [(48, "onehot" if VERSION < (5, 10) else "fused", 12 * 4 + 2 * 8)]
    packed_calls.clear()
    encode_images(tower, pixels, ids, max_batch=1)
    assert packed_calls == [1] * 5
    assert_items_close(got, expected)


def test_the_budget_is_the_planners_under_vllms_safety_net(monkeypatch):
    tower = tower_of("31b_like")
    pixels, ids = mixed_items()
    monkeypatch.setattr(planner, "device_memory", lambda device: (10**9, 10**9))
    seen = []
    real = planner.plan_tokens

    def plan_tokens(*args, **kwargs):
        seen.append(real(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(planner, "plan_tokens", plan_tokens)
    encode_images(tower, pixels, ids)
    path = "onehot" if VERSION < (5, 10) else "fused"
    expected = real(48, tower.config, path=path, free_bytes=10**9, total_bytes=10**9, dtype=torch.float32)
    assert seen == [
        real(
            48,
            tower.config,
            path=path,
            free_bytes=10**9,
            total_bytes=10**9,
            dtype=torch.float32,
            extra_bytes_per_patch=64,
        )
    ]
    assert seen[0] < expected, "the input copies are priced"


def test_a_packed_call_that_runs_out_of_memory_is_halved(monkeypatch):
    tower = tower_of("e2b_like")
    pixels, ids = make_inputs([GRIDS[i % 3] for i in range(7)], SEQ_LEN, seed=21)
    expected = encode_images(tower, pixels, ids)
    sizes, encode = [], fp.encode

    def limited(tower, pixels, ids, pooler_float32, counts, backend):
        sizes.append(len(pixels))
        if len(pixels) > 2:
            raise torch.OutOfMemoryError(f"injected: {len(pixels)} items")
        return encode(tower, pixels, ids, pooler_float32, counts)

    monkeypatch.setattr(fp, "encode", limited)
    with pytest.warns(RuntimeWarning, match=r"out of memory at 7 -> 3 items per packed call; went on with at most 1"):
        got = encode_images(tower, pixels, ids)
    assert sizes == [7, 3] + [1] * 7
    assert_items_close(got, expected)


def test_a_packed_call_of_one_item_that_runs_out_of_memory_reraises(monkeypatch):
    tower = tower_of("e2b_like")
    pixels, ids = mixed_items()
    sizes = []

    def always(tower, pixels, ids, pooler_float32, counts, backend):
        sizes.append(len(pixels))
        raise torch.OutOfMemoryError(f"injected: {len(pixels)} items")

    monkeypatch.setattr(fp, "encode", always)
    with pytest.raises(torch.OutOfMemoryError, match="injected: 1 items"):
        encode_images(tower, pixels, ids)
    assert sizes == [5, 2, 1], "the caller's error, not a retry loop"


def test_bad_input_names_the_argument():
    tower = tower_of("e2b_like")
    pixels, ids = mixed_items()
    no_real = torch.full_like(ids[1], -1)
    with pytest.raises(ValueError, match=r"pixel_position_ids: item 1: no real patch"):
        encode_images(tower, pixels, [ids[0], no_real, *ids[2:]])
    outside = ids[2].clone()
    outside[0] = torch.tensor([64, 0])
    with pytest.raises(ValueError, match=r"pixel_position_ids: item 2: real patch ids outside .*\[0, 64\)"):
        encode_images(tower, pixels, [*ids[:2], outside, *ids[3:]])
    with pytest.raises(ValueError, match=r"pixel_values: item 0: 63 patches, not a multiple"):
        encode_images(tower, [pixels[0][:63], *pixels[1:]], [ids[0][:63], *ids[1:]])
    with pytest.raises(ValueError, match=r"pixel_values: item 1: expected 12 features \(3 x patch_size"):
        encode_images(tower, [pixels[0], pixels[1][:, :-1], *pixels[2:]], ids)
    with pytest.raises(ValueError, match=r"item 1: expected pixels \(N, K\) and position ids \(N, 2\)"):
        encode_images(tower, pixels, [ids[0], ids[1][:8], *ids[2:]])
    with pytest.raises(ValueError, match="encoder: expected one of"):
        apply_fused_vision_to_gemma4(tower, encoder="padded")
    assert len(encode_images(tower, pixels, ids)) == len(pixels), "no item lost"


def test_an_unsupported_attention_implementation(monkeypatch):
    tower = tower_of("e2b_like", attention_implementation="flex_attention")
    with pytest.raises(ValueError, match=r"encoder: the packed encoder replaces .* 'flex_attention'"):
        apply_fused_vision_to_gemma4(tower, encoder="packed")
    assert fused_ops(tower) == [], "nothing patched"

    monkeypatch.setattr(_dispatch, "_WARNED", set())
    padded = []
    monkeypatch.setattr(fe, "_encode_chunk", lambda tower, p, i: padded.append(len(p)) or [p[0, :1]] * len(p))
    pixels, ids = mixed_items()
    with pytest.warns(RuntimeWarning, match="'flex_attention' attention; the padded path runs"):
        assert len(encode_images(tower, pixels, ids)) == len(pixels)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        encode_images(tower, pixels, ids)
    assert sorted(padded) == [2, 2, 3, 3], "the padded buckets ran, twice"

    apply_fused_vision_to_gemma4(encoder="packed")  # the class patch meets it only at call time
    with pytest.raises(ValueError, match="encoder: the packed encoder replaces"):
        tower(pixel_values=pixels[0][None], pixel_position_ids=ids[0][None])


def test_attention_paths_a_kernel_does_not_take_go_to_sdpa(monkeypatch):
    monkeypatch.setattr(_dispatch, "_WARNED", set())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CUDA warns once that no varlen kernel takes these
        for dtype, head_dim in ((torch.float32, 64), (torch.float16, 36), (torch.bfloat16, 264)):
            query = torch.randn(10, 2, head_dim, device=DEVICE, dtype=dtype)
            assert attention.attention_path(query) == "sdpa", (dtype, head_dim)
    with pytest.raises(ValueError, match="path: expected"):
        attention.varlen_attention(query, query, query, None, [10], 10, scale=1.0, path="flash")
