"""``GraphedEncoder``: the packed encoder's bucketed layout, the items' rows then one padding item, against
stock item by item. Off CUDA it runs that layout eagerly; tests/gpu/test_cuda_graphs.py replays its graphs."""

import warnings

import pytest
import torch

from fused_vision import GraphedEncoder, _dispatch, apply_fused_vision_to_gemma4
from fused_vision.graphs import bucket_offsets

from gemma4_towers import alone, assert_items_match, mixed_items, tower_of


def test_the_offsets_close_with_the_padding_item_then_empty_items():
    assert bucket_offsets([5, 3], 12, max_items=4) == [0, 5, 8, 12, 12, 12]
    assert bucket_offsets([6, 6], 12, max_items=2) == [0, 6, 12, 12], "no padding rows: an empty padding item"


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
    assert list(graphed._captured) == [300, 100]


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
