"""``GraphedEncoder``: the packed encoder's bucketed layout, the items' rows then padding items, against
stock item by item. Off CUDA it runs that layout eagerly; tests/gpu/test_cuda_graphs.py replays its graphs."""

import warnings

import pytest
import torch

from fused_vision import GraphedEncoder, _dispatch, apply_fused_vision_to_gemma4, encode_images
from fused_vision.encoder.packed import count_items
from fused_vision.pipeline.graphs import bucket_lengths, bucket_offsets

from gemma4_towers import (
    GRIDS,
    SEQ_LEN,
    alone,
    assert_items_match,
    make_inputs,
    mixed_items,
    randomize,
    tiny_conditional_generation,
    tower_of,
)
from helpers import assert_bit_identical


def test_the_offsets_close_with_padding_items_then_empty_items():
    assert bucket_lengths([5, 3], 12, max_items=3) == [5, 3, 2, 1, 1, 0]
    assert bucket_offsets([5, 3], 12, max_items=3) == [0, 5, 8, 10, 11, 12, 12]
    assert bucket_lengths([6, 6], 12, max_items=2) == [6, 6, 0, 0], "no padding rows: empty padding items"
    assert bucket_lengths([], 12, max_items=5) == [3, 3, 2, 2, 2, 0, 0, 0, 0, 0], "the capture's layout"


def _attention_pairs(lengths):
    return sum(length * length for length in lengths)


@pytest.mark.parametrize(("real", "rows", "max_items"), [([10_081], 20_160, 8), ([1_261] * 7 + [1_254], 20_160, 8)])
def test_no_padding_item_attends_more_than_a_real_one(real, rows, max_items):
    """A call that fills just over half its bucket: the padding's attention, split into ``max_items`` items,
    costs at most the real items' (one padding item of every remaining row cost 8x the eight images'), and
    no padding item is longer than the longest real one."""
    lengths = bucket_lengths(real, rows, max_items)
    padding = lengths[len(real) : len(real) + max_items]
    assert sum(lengths) == rows and sum(padding) == rows - sum(real)
    assert max(padding) <= max(real)
    assert _attention_pairs(padding) <= _attention_pairs(real)


@pytest.mark.parametrize("encoder", ["packed", "fused"])
def test_items_in_a_bucket_with_padding_rows_match_stock_alone(encoder, monkeypatch):
    monkeypatch.setattr(_dispatch, "_WARNED", set())  # warned once per process: this test's own warning
    tower = tower_of("e2b_like")
    pixels, ids = mixed_items()
    stock = alone(tower, pixels, ids)
    apply_fused_vision_to_gemma4(tower, encoder=encoder)
    graphed = GraphedEncoder(tower, token_buckets=(300, 100), max_items=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = graphed(pixels, ids)  # 128 real patches: the 300-row bucket
        again = graphed(pixels[1:4], ids[1:4])  # 68: the 100-row bucket
        once_more = graphed(pixels[:3], ids[:3])  # 104: the 300 rows again, other items
    assert [str(w.message) for w in caught if "GraphedEncoder" in str(w.message)] == [
        "GraphedEncoder: no CUDA graphs on cpu: each call runs eagerly"
    ]
    assert_items_match(got, stock, stock, torch.float32)
    assert_items_match(again, stock[1:4], stock[1:4], torch.float32)
    assert_items_match(once_more, stock[:3], stock[:3], torch.float32)
    assert list(graphed._captured) == [(300, torch.float32), (100, torch.float32)]


def test_what_a_graph_cannot_hold_is_refused_by_name():
    tower = tower_of("e2b_like")
    pixels, ids = mixed_items()
    with pytest.raises(ValueError, match="token_buckets: expected positive ints, got 0"):
        GraphedEncoder(tower, token_buckets=(64, 0), max_items=4)
    with pytest.raises(ValueError, match="max_items: expected a positive int, got True"):
        GraphedEncoder(tower, token_buckets=(64,), max_items=True)
    with pytest.raises(ValueError, match="token_buckets: expected at least one"):
        GraphedEncoder(tower, token_buckets=(), max_items=4)
    with pytest.raises(ValueError, match="5 items, more than max_items=4"):
        GraphedEncoder(tower, token_buckets=(512,), max_items=4)(pixels, ids)
    with pytest.raises(ValueError, match=r"real patches, more than the largest of token_buckets \(64\)"):
        GraphedEncoder(tower, token_buckets=(64,), max_items=8)(pixels, ids)


def _encode_images(tower, pixels, ids):
    return encode_images(tower, pixels, ids)


def _graphed(tower, pixels, ids):
    return GraphedEncoder(tower, token_buckets=(512,), max_items=8)(pixels, ids)


def _bad_inputs(pixels, ids):
    """(what, pixels, ids) that neither entry point takes, ``pixels`` and ``ids`` listed items."""
    return [
        ("5 pixel items, 3 id items", pixels, ids[:3]),
        ("3 pixel items, 5 id items", pixels[:3], ids),
        ("rows that disagree", pixels, [ids[0], ids[1][:8], *ids[2:]]),
        ("pixels too narrow", [p[:, :-1] for p in pixels], ids),
        ("integer pixels", [p.long() for p in pixels], ids),
        ("float ids", pixels, [i.float() for i in ids]),
        ("not tensors", [p.numpy() for p in pixels], ids),
        ("no real patch", pixels, [ids[0], torch.full_like(ids[1], -1), *ids[2:]]),
    ]


def test_graphed_encoder_refuses_what_encode_images_refuses_with_the_same_error():
    """One validation for both: each bad input raises the same exception with the same message, naming the
    argument, where the graphed encoder used to drop or mispair items."""
    tower = tower_of("e2b_like")
    pixels, ids = mixed_items()
    for what, bad_pixels, bad_ids in _bad_inputs(pixels, ids):
        raised = []
        for call in (_encode_images, _graphed):
            with pytest.raises((TypeError, ValueError)) as error:
                call(tower, bad_pixels, bad_ids)
            raised.append((type(error.value), str(error.value)))
        assert raised[0] == raised[1], what
        assert raised[0][1].startswith(("pixel_values", "pixel_position_ids", "item ")), raised[0][1]


def test_graphed_encoder_takes_what_encode_images_takes(monkeypatch):
    """A whole model, (1, N, K) items, stacked (B, N, K) tensors and no items."""
    monkeypatch.setattr(_dispatch, "_WARNED", set())
    model = tiny_conditional_generation()
    tower = randomize(model.model.vision_tower, seed=3)
    pixels, ids = make_inputs(GRIDS, SEQ_LEN)
    stock = alone(tower, list(pixels), list(ids))
    graphed = GraphedEncoder(model, token_buckets=(512,), max_items=8)
    assert graphed.tower is tower
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no CUDA graphs on a CPU
        for form in (pixels, [p[None] for p in pixels], list(pixels)):
            assert_items_match(graphed(form, ids if form is pixels else list(ids)), stock, stock, torch.float32)
        assert graphed([], []) == []


def test_graphed_encoder_names_its_arguments():
    tower = tower_of("e2b_like")
    pixels, ids = mixed_items()
    with pytest.raises(TypeError, match="token_buckets: expected a sequence of positive ints, got 300"):
        GraphedEncoder(tower, 300, 8)
    with pytest.raises(TypeError, match="tower: expected a Gemma4VisionModel .* got Linear"):
        GraphedEncoder(torch.nn.Linear(2, 2), (300,), 8)
    counts = count_items(ids[:3], 2, 64)
    with pytest.raises(ValueError, match="counts: expected the counts of 5 items, got 3"):
        GraphedEncoder(tower, (300,), 8)(pixels, ids, counts)
    with pytest.raises(TypeError, match="counts: expected the items' ItemCounts"):
        GraphedEncoder(tower, (300,), 8)(pixels, ids, [48, 16, 40, 12, 12])


def test_a_bucket_keeps_one_layout_per_pixel_dtype():
    """fp32 pixels after bf16 pixels in the same bucket are not rounded to bf16: each dtype has its own."""
    tower = tower_of("31b_like")
    pixels, ids = mixed_items()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fresh = GraphedEncoder(tower, token_buckets=(300,), max_items=8)(pixels, ids)
        graphed = GraphedEncoder(tower, token_buckets=(300,), max_items=8)
        graphed([p.bfloat16() for p in pixels], ids)
        got = graphed(pixels, ids)
    for index, (tokens, expected) in enumerate(zip(got, fresh, strict=True)):
        assert_bit_identical(tokens, expected, f"item {index}")
    assert list(graphed._captured) == [(300, torch.bfloat16), (300, torch.float32)]


def test_a_moved_tower_drops_the_buckets_its_graphs_read():
    """A graph reads the weights where they were at its capture: once they move, every bucket goes."""
    tower = tower_of("31b_like")
    apply_fused_vision_to_gemma4(tower, encoder="fused")
    pixels, ids = mixed_items()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graphed = GraphedEncoder(tower, token_buckets=(300,), max_items=8)
        graphed(pixels, ids)
        first = graphed._captured[300, torch.float32]
        graphed(pixels, ids)
        assert graphed._captured[300, torch.float32] is first, "the same tower: the same bucket"
        tower.double()
        got = graphed(pixels, ids)
    assert graphed._captured[300, torch.float32] is not first
    stock = alone(tower, pixels, ids)
    assert_items_match(got, stock, stock, torch.float32)
