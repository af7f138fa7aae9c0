"""fused_vision's patched tower on the batches stock broadcasts: inputs of one item beside three.

Runs against whichever transformers is importable, as test_transformers.py beside it does (CI runs both
files on transformers 5.9 too).
"""

import pytest
import torch

import fused_vision.integrations.stem as stem
import fused_vision.integrations.transformers as fg
from fused_vision import apply_fused_vision_to_gemma4, revert_fused_vision_gemma4

from gemma4_towers import (
    FP32_CLOSE,
    GRIDS,
    SEQ_LEN,
    make_inputs,
    make_tower,
    run_tower,
)
from helpers import DEVICE, assert_bit_identical, assert_close, reverting_to_stock

stock_after_each_test = reverting_to_stock(revert_fused_vision_gemma4)


# Batches of (pixels or hidden states, ids, padding) that stock broadcasts to 3 items: transformers' own
# tests pair (1, N, 2) ids with (B, N, K) pixels.
BROADCASTS = {"ids_of_one": (3, 1, 1), "padding_of_one": (3, 3, 1), "pixels_of_one": (1, 3, 3)}


def spy(monkeypatch, module, name):
    """Record the calls of the fused op ``name`` that ``module`` runs, so a test knows the fused path ran."""
    calls, op = [], getattr(module, name)

    def recorded(*args, **kwargs):
        calls.append(args[0].shape)
        return op(*args, **kwargs)

    monkeypatch.setattr(module, name, recorded)
    return calls


def broadcast_inputs(batches, features=None):
    pixels, ids = make_inputs(GRIDS, SEQ_LEN)
    features = pixels if features is None else features
    return features[: batches[0]], ids[: batches[1]], (ids == -1).all(-1)[: batches[2]]


def materialized(*tensors):
    return [t.expand(len(GRIDS), *t.shape[1:]).contiguous() for t in tensors]


@pytest.mark.parametrize("batches", BROADCASTS.values(), ids=BROADCASTS)
@pytest.mark.parametrize("embedder", ["position_embeddings", "patch_embed"])
def test_the_embedder_broadcasts_a_batch_of_one_as_stock(monkeypatch, embedder, batches):
    tower = make_tower()
    inputs = broadcast_inputs(batches)
    with torch.no_grad():
        stock = tower.patch_embedder(*inputs)
        apply_fused_vision_to_gemma4(tower, embedder=embedder, pooler=False)
        op = "_fused_patch_embed" if embedder == "patch_embed" else "_fused_position_embeddings"
        calls = spy(monkeypatch, stem, op)
        fused = tower.patch_embedder(*inputs)
        rows = tower.patch_embedder(*materialized(*inputs))
    assert calls, "the fused op did not run"
    assert fused.shape == stock.shape == (len(GRIDS), SEQ_LEN, 32)
    assert_bit_identical(fused, rows, "broadcast against materialized rows")
    if embedder == "position_embeddings":
        assert_bit_identical(fused, stock, "the lookup alone")
    else:
        assert_close(fused, stock, **FP32_CLOSE)


def test_the_lookup_method_broadcasts_a_batch_of_one_as_stock(monkeypatch):
    tower = make_tower()
    _, ids, padding = broadcast_inputs((3, 1, 3))
    with torch.no_grad():
        stock = tower.patch_embedder._position_embeddings(ids, padding)
        apply_fused_vision_to_gemma4(tower, embedder="position_embeddings", pooler=False)
        calls = spy(monkeypatch, stem, "_fused_position_embeddings")
        fused = tower.patch_embedder._position_embeddings(ids, padding)
    assert calls, "the fused op did not run"
    assert_bit_identical(fused, stock, "vLLM's lookup call")


@pytest.mark.parametrize("pooled", [True, False], ids=["pooled", "n_equals_l"])
@pytest.mark.parametrize("batches", BROADCASTS.values(), ids=BROADCASTS)
def test_the_pooler_broadcasts_a_batch_of_one_as_stock(monkeypatch, batches, pooled):
    tower = make_tower()
    hidden = torch.randn(len(GRIDS), SEQ_LEN, 32, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    inputs = broadcast_inputs(batches, features=hidden)
    length = 16 if pooled else SEQ_LEN
    with torch.no_grad():
        stock, stock_mask = tower.pooler(*inputs, output_length=length)
        apply_fused_vision_to_gemma4(tower, embedder=None)
        calls = spy(monkeypatch, fg, "_fused_pool_by_positions")
        fused, mask = tower.pooler(*inputs, output_length=length)
    assert calls, "the fused op did not run"
    assert fused.shape == stock.shape and fused.dtype == stock.dtype
    assert_bit_identical(mask, stock_mask, "mask")  # one row per item of the ids, or the padding itself
    assert_close(fused, stock, **FP32_CLOSE)


@pytest.mark.parametrize(
    "ids_shape", [(2, SEQ_LEN, 2), (SEQ_LEN, 2), (3, 1, 2)], ids=["batch_of_two", "no_batch", "one_patch"]
)
def test_shapes_stock_does_not_broadcast_to_rows_run_stock(ids_shape):
    """No batch of one to expand: the patched modules hand them to stock, which gives its result or raises
    its error (the F.embedding era broadcasts 2-D ids; the one-hot era raises)."""
    tower = make_tower()
    pixels, _ = make_inputs(GRIDS, SEQ_LEN)
    ids = torch.zeros(ids_shape, dtype=torch.long, device=DEVICE)
    padding = (ids == -1).all(-1)

    def outcome():
        try:
            with torch.no_grad():
                return tower.patch_embedder(pixels, ids, padding)
        except Exception as exc:  # the patched module must fail as stock does
            return type(exc)

    stock = outcome()
    apply_fused_vision_to_gemma4(tower)
    fused = outcome()
    if isinstance(stock, torch.Tensor):
        assert_bit_identical(fused, stock, "stock's broadcast result")
    else:
        assert fused is stock, f"stock raises {stock.__name__}, the patched embedder {fused}"


def test_a_tower_given_ids_of_one_fails_as_stock_does():
    """Gemma4VisionModel.forward itself does not take (1, N, 2) ids with B items: it raises when it
    selects the pooled tokens, after the embedder and pooler, which broadcast. The patched tower too."""
    tower = make_tower()
    pixels, ids = make_inputs(GRIDS, SEQ_LEN)
    with pytest.raises(IndexError) as stock:
        run_tower(tower, pixels, ids[:1])
    apply_fused_vision_to_gemma4(tower)
    with pytest.raises(IndexError, match=str(stock.value)):
        run_tower(tower, pixels, ids[:1])
