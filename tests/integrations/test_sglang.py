"""fused_vision.integrations.sglang against SGLang's own Gemma 4 embedder and poolers, from its installed package, and
the plugin that SGLang's loader runs. The whole encoder: tests/integrations/test_sglang_encoder.py.
"""

import importlib.abc
import importlib.metadata
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import fused_vision.integrations.sglang as fs
import fused_vision.integrations.stem as stem
from fused_vision import _releases
from fused_vision.integrations.sglang import apply_fused_vision_to_sglang_gemma4, revert_fused_vision_sglang_gemma4

from helpers import (
    DEVICE,
    FLOAT_DTYPES,
    assert_as_accurate_as_stock,
    assert_bit_identical,
    assert_close,
    dtype_id,
    reverting_to_stock,
)
from sglang_towers import (
    GRIDS,
    HIDDEN,
    POOLING,
    SEQ_LEN,
    config,
    embedding_gemma2,
    float64_twin,
    inputs,
    make_embedder,
    ulps_apart,
    vision,
)

EmbeddingPooler = embedding_gemma2.EmbeddingGemma2VisionPooler


stock_after_each_test = reverting_to_stock(revert_fused_vision_sglang_gemma4)


# ---- the modules under test are SGLang's own, as installed ------------------------------------------------


def test_the_modules_under_test_are_sglangs_installed_package():
    package = Path(importlib.metadata.distribution("sglang").locate_file("sglang")).resolve()
    for cls, file in [
        (vision.Gemma4VisionPatchEmbedder, "models/gemma4_vision.py"),
        (vision.Gemma4VisionPooler, "models/gemma4_vision.py"),
        (EmbeddingPooler, "models/embedding_gemma2.py"),
    ]:
        assert Path(inspect.getsourcefile(cls)).resolve() == package / "srt" / file, cls
    assert stem.lookup_is_onehot(vision.Gemma4VisionPatchEmbedder), "SGLang's lookup is the one-hot these tests expect"
    assert "one_hot" in EmbeddingPooler._avg_pool_by_positions.__code__.co_names
    assert vision.Gemma4VisionPatchEmbedder is not _releases.modeling().Gemma4VisionPatchEmbedder


# ---- parity with SGLang's stock modules -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_lookup_alone_is_bit_identical(dtype):
    embedder = make_embedder(dtype)
    pixels, ids, padding = inputs(dtype)
    with torch.no_grad():
        stock, stock_lookup = embedder(pixels, ids, padding), embedder._position_embeddings(ids, padding)
        assert apply_fused_vision_to_sglang_gemma4(embedder, embedder="position_embeddings", pooler=False) == 1
        fused, lookup = embedder(pixels, ids, padding), embedder._position_embeddings(ids, padding)
    assert_bit_identical(fused, stock, "SGLang patch embedder, lookup alone")
    assert_bit_identical(lookup, stock_lookup, "SGLang embedder's _position_embeddings")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_patch_embed_matches_stock(dtype, poisoned):
    embedder = make_embedder(dtype)
    pixels, ids, padding = inputs(dtype)
    with torch.no_grad():
        stock = embedder(pixels, ids, padding)
        exact = float64_twin(embedder)(pixels.double(), ids, padding)
        assert apply_fused_vision_to_sglang_gemma4(embedder, pooler=False) == 1
        fused = embedder(pixels, ids, padding)
    assert fused.dtype == stock.dtype
    if dtype == torch.float32:
        assert_close(fused, stock, rtol=1e-5, atol=1e-5, what="SGLang patch embedder")
    assert_as_accurate_as_stock(fused, stock, exact, ords=(2, float("inf")), what="SGLang patch embedder")


def pooler_inputs(dtype):
    _, ids, padding = inputs()
    hidden = (torch.randn(len(GRIDS), SEQ_LEN, HIDDEN, generator=torch.Generator().manual_seed(3)) + 0.5).to(DEVICE)
    return hidden.to(dtype), ids, padding


def pool_before_and_after_the_patch(pooler, dtype):
    """(stock, fused, stock's mask) of a pooler run before and after its patch; checks that the masks are
    equal and that the fused values are no further from the float64 result than stock's."""
    hidden, ids, padding = pooler_inputs(dtype)
    length = SEQ_LEN // POOLING**2
    with torch.no_grad():
        stock, stock_mask = pooler(hidden, ids, padding, output_length=length)
        exact, _ = pooler(hidden.double(), ids, padding, output_length=length)
        assert apply_fused_vision_to_sglang_gemma4(pooler, embedder=None) == 1
        fused, mask = pooler(hidden, ids, padding, output_length=length)
    assert "fused_vision=pool_by_positions(backend=auto)" in repr(pooler)
    assert fused.dtype == stock.dtype == dtype
    assert_bit_identical(mask, stock_mask, "pooler mask")
    floor = 2**-24 * 16 if dtype == torch.float32 else 0.0
    assert_as_accurate_as_stock(fused, stock, exact, slack=1.0, floor=floor, ords=(2, float("inf")), what="pooled")
    return stock, fused, stock_mask


@pytest.mark.parametrize("mask_first", [False, True], ids=["gemma4_mm", "mask_pad_before_pool"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_pooler_matches_stock(dtype, mask_first, poisoned):
    """The mask bit for bit; the pooled values closer to the float64 truth than stock, within 2 ulps of it
    (stock's weights are 1/9 rounded to the dtype); padding pools into slot 0 exactly when stock's does."""
    pooler = vision.Gemma4VisionPooler(config(), mask_pad_before_pool=mask_first)
    stock, fused, stock_mask = pool_before_and_after_the_patch(pooler, dtype)
    if dtype == torch.float32:
        assert_close(fused, stock, rtol=1e-6, atol=1e-6, what="SGLang pooled")
    else:
        filled = stock_mask.unsqueeze(-1).expand_as(stock)
        assert ulps_apart(fused[filled], stock[filled]) <= 2


# Batches of (hidden states, ids, padding) that stock broadcasts to the items: a batch of one among them.
BROADCASTS = {"ids_of_one": (3, 1, 1), "padding_of_one": (3, 3, 1), "hidden_of_one": (1, 3, 3)}


@pytest.mark.parametrize("batches", BROADCASTS.values(), ids=BROADCASTS)
@pytest.mark.parametrize(
    "make_pooler",
    [
        lambda: vision.Gemma4VisionPooler(config()),
        lambda: vision.Gemma4VisionPooler(config(), True),
        lambda: EmbeddingPooler(config()),
    ],
    ids=["gemma4_mm", "mask_pad_before_pool", "embedding_gemma2"],
)
def test_poolers_broadcast_a_batch_of_one_as_stock(monkeypatch, make_pooler, batches):
    """The fused pool runs on the rows stock broadcasts (a test spies on it), with stock's shapes: pooled
    over the broadcast batch, the mask a row per item of the ids."""
    pooler = make_pooler()
    hidden, ids, padding = (t[:batch] for t, batch in zip(pooler_inputs(torch.float32), batches))
    length = SEQ_LEN // POOLING**2
    with torch.no_grad():
        stock, stock_mask = pooler(hidden, ids, padding, output_length=length)
        apply_fused_vision_to_sglang_gemma4(pooler, embedder=None)
        calls, op = [], fs._fused_pool_by_positions
        monkeypatch.setattr(fs, "_fused_pool_by_positions", lambda *a, **k: calls.append(a[0].shape) or op(*a, **k))
        fused, mask = pooler(hidden, ids, padding, output_length=length)
    assert calls == [(len(GRIDS), SEQ_LEN, HIDDEN)], "the fused pool did not run on the broadcast rows"
    assert fused.shape == stock.shape
    assert_bit_identical(mask, stock_mask, "mask")
    assert_close(fused, stock, rtol=1e-6, atol=1e-6, what="pooled")


def test_pooler_leaves_the_unpooled_path_and_errors_to_stock():
    pooler = vision.Gemma4VisionPooler(config())
    _, ids, padding = inputs()
    hidden = torch.randn(len(GRIDS), SEQ_LEN, HIDDEN).to(DEVICE, torch.bfloat16)
    stock = pooler(hidden, ids, padding, output_length=SEQ_LEN)  # N == L: a scale, and the padding as the mask
    apply_fused_vision_to_sglang_gemma4(pooler)
    fused = pooler(hidden, ids, padding, output_length=SEQ_LEN)
    for got, expected, what in zip(fused, stock, ("unpooled", "mask")):
        assert_bit_identical(got, expected, what)
    with pytest.raises(ValueError, match="output_length is required"):
        pooler(hidden, ids, padding)
    with pytest.raises(ValueError, match="Cannot pool"):
        pooler(hidden, ids, padding, output_length=SEQ_LEN // 2)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_embedding_pooler_matches_stock(dtype, poisoned):
    """EmbeddingGemma2's pooler pools and scales in float32, then casts once: the mask bit for bit, the
    pooled values stock's up to float32 summation order (in bf16 and fp16 at most 1 ulp apart), and no
    further from the float64 result than stock's."""
    stock, fused, _ = pool_before_and_after_the_patch(EmbeddingPooler(config()), dtype)
    if dtype == torch.float32:
        assert_close(fused, stock, rtol=1e-6, atol=1e-6, what="EmbeddingGemma2 pooled")
    else:
        assert ulps_apart(fused, stock) <= 1


def test_embedding_pooler_leaves_the_unpooled_path_and_errors_to_stock():
    pooler = EmbeddingPooler(config())
    hidden, ids, padding = pooler_inputs(torch.bfloat16)
    with torch.no_grad():
        stock = pooler(hidden, ids, padding, output_length=SEQ_LEN)  # N == L: a scale, the padding as mask
        apply_fused_vision_to_sglang_gemma4(pooler)
        fused = pooler(hidden, ids, padding, output_length=SEQ_LEN)
    for got, expected, what in zip(fused, stock, ("unpooled", "mask"), strict=True):
        assert_bit_identical(got, expected, what)
    with pytest.raises(ValueError, match="output_length is required"):
        pooler(hidden, ids, padding)
    with pytest.raises(ValueError, match="Cannot output more soft tokens"):
        pooler(hidden, ids, padding, output_length=SEQ_LEN + 1)
    with pytest.raises(ValueError, match="Cannot pool"):
        pooler(hidden, ids, padding, output_length=SEQ_LEN // 2)
    with pytest.raises(
        ValueError, match="contains no Gemma4VisionPatchEmbedder, Gemma4VisionPooler or EmbeddingGemma2VisionPooler, so"
    ):
        apply_fused_vision_to_sglang_gemma4(nn.Linear(2, 2))


def test_embedding_gemma2_that_is_absent_or_does_not_import_leaves_gemma4_patched(monkeypatch, caplog):
    class MissingDependency(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == fs.SGLANG_EMBEDDING_MODULE:
                raise ModuleNotFoundError("No module named 'flashinfer'", name="flashinfer")

    monkeypatch.setitem(sys.modules, fs.SGLANG_EMBEDDING_MODULE, None)  # an SGLang without EmbeddingGemma2
    with caplog.at_level("WARNING", logger="fused_vision"):
        assert apply_fused_vision_to_sglang_gemma4() == 2
    assert caplog.text == ""
    monkeypatch.delitem(sys.modules, fs.SGLANG_EMBEDDING_MODULE)
    monkeypatch.setattr(sys, "meta_path", [MissingDependency(), *sys.meta_path])
    with caplog.at_level("WARNING", logger="fused_vision"):
        assert apply_fused_vision_to_sglang_gemma4() == 2
    assert f"{fs.SGLANG_EMBEDDING_MODULE} does not import (No module named 'flashinfer')" in caplog.text
    assert vision.Gemma4VisionPooler.forward is fs._pooler_forward
    assert EmbeddingPooler.forward is not fs._embedding_pooler_forward


# ---- the plugin ----------------------------------------------------------------------------------------------


def test_sglang_plugin_is_in_the_installed_metadata_and_opt_in(monkeypatch, caplog):
    (entry_point,) = [
        e for e in importlib.metadata.distribution("fused-vision").entry_points if e.group == "sglang.srt.plugins"
    ]
    assert entry_point.value == "fused_vision.integrations.sglang:sglang_plugin"
    assert entry_point in importlib.metadata.entry_points(group="sglang.srt.plugins")  # where SGLang looks
    plugin = entry_point.load()
    assert plugin is fs.sglang_plugin
    stock_forward = vision.Gemma4VisionPooler.forward
    monkeypatch.delenv(fs.ENV_SGLANG, raising=False)
    plugin()
    assert vision.Gemma4VisionPooler.forward is stock_forward
    monkeypatch.setenv(fs.ENV_SGLANG, "1")
    plugin()
    assert vision.Gemma4VisionPatchEmbedder.forward is stem._embedder_forward
    assert vision.Gemma4VisionPooler.forward is fs._pooler_forward
    revert_fused_vision_sglang_gemma4()
    assert vision.Gemma4VisionPooler.forward is stock_forward
    # where SGLang's Gemma 4 is missing it warns rather than raise inside SGLang's plugin loader
    monkeypatch.setitem(sys.modules, fs.SGLANG_MODULE, None)
    with caplog.at_level("WARNING", logger="fused_vision"):
        plugin()
    assert "cannot be patched" in caplog.text


def test_sglang_plugin_reports_once_through_sglangs_logger(monkeypatch, caplog):
    from fused_vision import _dispatch
    from fused_vision.integrations import report
    from fused_vision.pipeline import _memory

    monkeypatch.setattr(report, "_LOGGED", set())
    monkeypatch.setattr(_dispatch, "_WARNED", set())
    monkeypatch.setenv(fs.ENV_SGLANG, "1")
    monkeypatch.setenv("FUSED_VISION_BACKEND", "reference")
    with caplog.at_level("INFO", logger=fs.engine_logger.name):
        fs.sglang_plugin()
        fs.sglang_plugin()  # SGLang loads its plugins once per process: nothing new to say
    (line,) = [record.getMessage() for record in caplog.records if record.name == fs.engine_logger.name]
    assert fs.engine_logger.name.startswith("sglang.")
    classes = "Gemma4VisionPatchEmbedder -> patch_embed(backend=auto), Gemma4VisionPooler -> pool_by_positions("
    assert line.startswith(f"fused_vision: patched SGLang's Gemma 4 tower: {classes}")
    device = _memory.current_device()
    assert f"; on {device}: Gemma4VisionPatchEmbedder: reference, Gemma4VisionPooler: reference" in line
    assert line.endswith("; fallbacks: none")


# A fresh process, as each SGLang process is: its plugin loader runs once there, then the classes are read.
LOADER_PROBE = """
import json
from sglang.srt.plugins import load_plugins
load_plugins()
import fused_vision.integrations.sglang as fs
from fused_vision import patching
from fused_vision.integrations import stem
from sglang.srt.models import embedding_gemma2, gemma4_vision
classes = [gemma4_vision.Gemma4VisionPatchEmbedder, gemma4_vision.Gemma4VisionPooler,
           embedding_gemma2.EmbeddingGemma2VisionPooler]
forwards = [stem._embedder_forward, fs._pooler_forward, fs._embedding_pooler_forward]
print(json.dumps({c.__name__: [str(patching.fused_state(c)), c.forward is f] for c, f in zip(classes, forwards)}))
"""


def test_sglangs_plugin_loader_applies_the_patch_only_when_asked(tmp_path):
    env = {name: value for name, value in os.environ.items() if name not in ("SGLANG_PLUGINS", fs.ENV_SGLANG)}
    runs = {
        setting: subprocess.Popen(
            [sys.executable, "-c", LOADER_PROBE],
            cwd=tmp_path,
            env=env | ({fs.ENV_SGLANG: setting} if setting else {}),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for setting in ("1", "0", None)
    }
    seen = {}
    for setting, run in runs.items():
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, err
        seen[setting] = json.loads(out.strip().splitlines()[-1])
    fused = "pool_by_positions(backend=auto)"
    assert seen["1"] == {
        "Gemma4VisionPatchEmbedder": ["patch_embed(backend=auto)", True],
        "Gemma4VisionPooler": [fused, True],
        "EmbeddingGemma2VisionPooler": [fused, True],
    }
    stock = {name: ["None", False] for name in seen["1"]}
    assert seen["0"] == seen[None] == stock
