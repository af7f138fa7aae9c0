"""fused_vision.sglang against SGLang's own Gemma 4 vision tower (``sglang.srt.models.gemma4_vision``).

SGLang needs CUDA and some 140 packages, so where it is not installed these tests load SGLang's real
module files from the directory FUSED_VISION_SGLANG_MODELS names (CI takes them from the sglang wheel):
``gemma4_vision.py`` alone, with the sglang modules it imports replaced by inert stand-ins, and from
``embedding_gemma2.py`` only its vision pooler, a class that uses torch alone (the rest of that file
builds SGLang's layers). The patch embedder and the poolers use torch alone; the encoder's attention
layers, which use the stand-ins, are replaced by a small stand-in block in the whole-encoder tests, so
the rest of SGLang's ``Gemma4VisionEncoder.forward`` runs as shipped.
"""

import ast
import importlib
import importlib.abc
import importlib.metadata
import importlib.util
import inspect
import os
import sys
import types
from pathlib import Path

import pytest
import torch
from torch import nn

import fused_vision.gemma4 as fg
import fused_vision.sglang as fs
from fused_vision.gemma4 import apply_fused_vision_to_gemma4
from fused_vision.sglang import apply_fused_vision_to_sglang_gemma4, revert_fused_vision_sglang_gemma4

from conftest import DEVICE, FLOAT_DTYPES, assert_as_accurate_as_stock, assert_bit_identical, assert_close, dtype_id
from gemma4_towers import float64_twin, make_inputs, randomize, vision_config

SGLANG_INSTALLED = importlib.util.find_spec("sglang") is not None  # told before any stand-in exists
SGLANG_DIR_ENV = "FUSED_VISION_SGLANG_MODELS"
SGLANG_FETCH = (
    "pip download --no-deps sglang==0.5.23, then extract gemma4_vision.py and embedding_gemma2.py of "
    "sglang/srt/models from the wheel into one directory (as .ci/run does)"
)
POOLING = 3  # Gemma 4's k: bf16's 1/9 is where SGLang's pooler rounds its weights
GRIDS = [(9, 6), (6, 3), (3, 12)]  # 6, 2 and 4 soft tokens of L = 9, each item padded
SEQ_LEN = 81
HIDDEN = 40


def _stand_in(name: str) -> types.ModuleType:
    """An empty package whose every public name is a callable returning False."""
    module = types.ModuleType(name)
    module.__path__ = []  # a package: its submodules resolve through sys.modules

    def inert(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return lambda *args, **kwargs: False

    module.__getattr__ = inert
    return module


def _load_file_alone(path: Path, replaced: dict) -> types.ModuleType:
    """Execute SGLang's module file as ``fs.SGLANG_MODULE``, with stand-ins for the sglang modules (and
    any missing third-party ones, such as einops) it imports. ``replaced`` receives the sys.modules
    entries it sets, with what they held before (None: nothing), to restore."""
    tree = ast.parse(path.read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 0}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    stand_ins = {"sglang", "sglang.srt", "sglang.srt.models"}
    for name in imported:
        root = name.split(".")[0]
        if root == "sglang" or importlib.util.find_spec(root) is None:
            parts = name.split(".")
            stand_ins |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    for name in sorted(stand_ins) + [fs.SGLANG_MODULE]:
        replaced[name] = sys.modules.get(name)
    for name in stand_ins:
        sys.modules[name] = _stand_in(name)
    spec = importlib.util.spec_from_file_location(fs.SGLANG_MODULE, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[fs.SGLANG_MODULE] = module
    spec.loader.exec_module(module)
    return module


def _load_class_alone(path: Path, module_name: str, class_name: str) -> types.ModuleType:
    """A module ``module_name`` holding one class of SGLang's module file, executed with torch, nn and F
    alone: a name the class takes from elsewhere in the file fails loudly when it runs."""
    tree = ast.parse(path.read_text())
    (node,) = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == class_name]
    module = types.ModuleType(module_name)
    module.__file__ = str(path)
    module.__dict__.update(torch=torch, nn=nn, F=torch.nn.functional)
    exec(compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec"), module.__dict__)
    return module


def _sglang_file(name: str) -> Path:
    directory = os.environ.get(SGLANG_DIR_ENV)
    if not directory:
        pytest.skip(f"SGLang is not installed and {SGLANG_DIR_ENV} is unset: {SGLANG_FETCH}")
    return Path(directory) / name


@pytest.fixture(scope="module")
def sgl():
    """SGLang's Gemma 4 vision module: the installed one, else the file in the environment's directory."""
    if SGLANG_INSTALLED:
        yield importlib.import_module(fs.SGLANG_MODULE)
        return
    path = _sglang_file("gemma4_vision.py")
    saved: dict = {}
    try:
        yield _load_file_alone(path, saved)
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


@pytest.fixture
def embedding_pooler(sgl, monkeypatch):
    """SGLang's ``EmbeddingGemma2VisionPooler``: installed, else loaded alone from embedding_gemma2.py and
    put where the class patch imports it from, for this test only."""
    if SGLANG_INSTALLED:
        return importlib.import_module(fs.SGLANG_EMBEDDING_MODULE).EmbeddingGemma2VisionPooler
    module = _load_class_alone(
        _sglang_file("embedding_gemma2.py"), fs.SGLANG_EMBEDDING_MODULE, "EmbeddingGemma2VisionPooler"
    )
    monkeypatch.setitem(sys.modules, fs.SGLANG_EMBEDDING_MODULE, module)
    return module.EmbeddingGemma2VisionPooler


def sglang_classes() -> int:
    """The classes the class patch sets: EmbeddingGemma2's pooler too, where it imports."""
    try:
        importlib.import_module(fs.SGLANG_EMBEDDING_MODULE)
    except ImportError:
        return 2
    return 3


@pytest.fixture(autouse=True)
def stock_after_each_test():
    yield
    revert_fused_vision_sglang_gemma4()


class StandInBlock(nn.Module):
    """In place of SGLang's tensor-parallel transformer: a residual tanh MLP that mixes each patch's
    features (and, through the mask, leaves padding rows as they came)."""

    def __init__(self, config, quant_config=None, prefix=""):
        super().__init__()
        self.mix = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, inputs_embeds, attention_mask, patch_positions):
        update = torch.tanh(self.mix(inputs_embeds))
        return inputs_embeds + update * attention_mask.unsqueeze(-1).to(update.dtype)


def config():
    return vision_config(patch_size=2, pooling=POOLING, positions=64, hidden=HIDDEN)


def make_embedder(sgl, dtype, seed=0):
    return randomize(sgl.Gemma4VisionPatchEmbedder(config()), seed).to(DEVICE, dtype).eval()


def make_encoder(sgl, monkeypatch, dtype, *, mask_first=False, standardize=False, seed=0):
    monkeypatch.setattr(sgl, "Gemma4VisionTransformer", StandInBlock)
    vision = config()
    vision.standardize = standardize
    encoder = sgl.Gemma4VisionEncoder(vision, mask_pad_before_pool=mask_first)
    return randomize(encoder, seed).to(DEVICE, dtype).eval()


def inputs(dtype=torch.float32):
    pixels, ids = make_inputs(GRIDS, SEQ_LEN)
    return pixels.to(dtype), ids, (ids == -1).all(-1)


def ulps_apart(actual: torch.Tensor, expected: torch.Tensor) -> int:
    """The most units in the last place between same-signed finite values of one float dtype."""
    int_view = {2: torch.int16, 4: torch.int32}[actual.element_size()]
    assert (actual.sign() * expected.sign() >= 0).all()
    return int((actual.view(int_view).long() - expected.view(int_view).long()).abs().max())


# ---- the module under test is SGLang's own -------------------------------------------------------------


def test_the_tower_under_test_is_sglangs_own_code(sgl):
    source = Path(inspect.getsourcefile(sgl.Gemma4VisionPatchEmbedder)).resolve()
    assert source.name == "gemma4_vision.py" and source == Path(sgl.__file__).resolve()
    assert sgl.Gemma4VisionPooler.__module__ == fs.SGLANG_MODULE
    assert fg.lookup_is_onehot(sgl.Gemma4VisionPatchEmbedder), "SGLang's lookup is the one-hot these tests expect"
    assert sgl.Gemma4VisionPatchEmbedder is not fg._modeling().Gemma4VisionPatchEmbedder


def test_the_embedding_pooler_under_test_is_sglangs_own_code(embedding_pooler):
    source = Path(inspect.getsourcefile(embedding_pooler)).resolve()
    assert source.name == "embedding_gemma2.py" and embedding_pooler.__module__ == fs.SGLANG_EMBEDDING_MODULE
    assert "one_hot" in embedding_pooler._avg_pool_by_positions.__code__.co_names


# ---- parity with SGLang's stock modules -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_lookup_alone_is_bit_identical(sgl, dtype):
    embedder = make_embedder(sgl, dtype)
    pixels, ids, padding = inputs(dtype)
    with torch.no_grad():
        stock, stock_lookup = embedder(pixels, ids, padding), embedder._position_embeddings(ids, padding)
        assert apply_fused_vision_to_sglang_gemma4(embedder, embedder="position_embeddings", pooler=False) == 1
        fused, lookup = embedder(pixels, ids, padding), embedder._position_embeddings(ids, padding)
    assert_bit_identical(fused, stock, "SGLang patch embedder, lookup alone")
    assert_bit_identical(lookup, stock_lookup, "SGLang embedder's _position_embeddings")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_patch_embed_matches_stock(sgl, dtype, poisoned):
    embedder = make_embedder(sgl, dtype)
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
def test_pooler_matches_stock(sgl, dtype, mask_first, poisoned):
    """The mask bit for bit; the pooled values closer to the float64 truth than stock, within 2 ulps of it
    (stock's weights are 1/9 rounded to the dtype); padding pools into slot 0 exactly when stock's does."""
    pooler = sgl.Gemma4VisionPooler(config(), mask_pad_before_pool=mask_first)
    stock, fused, stock_mask = pool_before_and_after_the_patch(pooler, dtype)
    if dtype == torch.float32:
        assert_close(fused, stock, rtol=1e-6, atol=1e-6, what="SGLang pooled")
    else:
        filled = stock_mask.unsqueeze(-1).expand_as(stock)
        assert ulps_apart(fused[filled], stock[filled]) <= 2


def test_pooler_leaves_the_unpooled_path_and_errors_to_stock(sgl):
    pooler = sgl.Gemma4VisionPooler(config())
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
def test_embedding_pooler_matches_stock(embedding_pooler, dtype, poisoned):
    """EmbeddingGemma2's pooler pools and scales in float32, then casts once: the mask bit for bit, the
    pooled values stock's up to float32 summation order (in bf16 and fp16 at most 1 ulp apart), and no
    further from the float64 result than stock's."""
    stock, fused, _ = pool_before_and_after_the_patch(embedding_pooler(config()), dtype)
    if dtype == torch.float32:
        assert_close(fused, stock, rtol=1e-6, atol=1e-6, what="EmbeddingGemma2 pooled")
    else:
        assert ulps_apart(fused, stock) <= 1


def test_embedding_pooler_leaves_the_unpooled_path_and_errors_to_stock(embedding_pooler):
    pooler = embedding_pooler(config())
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


def no_one_hot(*args, **kwargs):
    raise AssertionError("F.one_hot ran inside a patched SGLang tower")


def assert_soft_tokens_match_stock(fused, mask, stock, stock_mask, exact, what):
    """An encoder's (soft tokens, mask) against stock's: the mask bit for bit, the tokens stock's in fp32
    and no less accurate than stock's against the float64 twin's."""
    assert_bit_identical(mask, stock_mask, f"{what}: pooler mask")
    if stock.dtype == torch.float32:
        assert_close(fused, stock, rtol=1e-5, atol=1e-5, what=what)
    floor = 16 * 2**-24 if stock.dtype == torch.float32 else 2**-8
    assert_as_accurate_as_stock(fused, stock, exact, floor=floor, ords=(2, float("inf")), what=what)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_embedding_gemma2_encoder_matches_stock_without_a_one_hot(sgl, embedding_pooler, monkeypatch, dtype):
    """SGLang's EmbeddingGemma2Model builds Gemma4VisionEncoder and swaps in its own pooler: patched at
    the class, and then at the instance, its tower runs no F.one_hot and gives stock's soft tokens."""
    encoder = make_encoder(sgl, monkeypatch, dtype)
    encoder.pooler = embedding_pooler(encoder.config)  # as EmbeddingGemma2Model.__init__ does
    pixels, ids, _ = inputs(dtype)
    with torch.no_grad():
        stock, stock_mask = encoder(pixels, ids)
        exact, _ = float64_twin(encoder)(pixels.double(), ids)
        results = {}
        assert apply_fused_vision_to_sglang_gemma4() == 3
        with monkeypatch.context() as patch:
            patch.setattr(torch.nn.functional, "one_hot", no_one_hot)
            results["class patch"] = encoder(pixels, ids)
        revert_fused_vision_sglang_gemma4()
        assert apply_fused_vision_to_sglang_gemma4(encoder) == 2
        assert "fused_vision=pool_by_positions(backend=auto)" in repr(encoder.pooler)
        monkeypatch.setattr(torch.nn.functional, "one_hot", no_one_hot)
        results["instance patch"] = encoder(pixels, ids)
    for how, (fused, mask) in results.items():
        assert_soft_tokens_match_stock(fused, mask, stock, stock_mask, exact, f"{how}: EmbeddingGemma2 soft tokens")


@pytest.mark.parametrize("standardize", [False, True], ids=["plain", "standardize"])
@pytest.mark.parametrize("mask_first", [False, True], ids=["gemma4_mm", "mask_pad_before_pool"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_encoder_forward_matches_stock_without_a_one_hot(sgl, monkeypatch, dtype, mask_first, standardize):
    """SGLang's own ``Gemma4VisionEncoder.forward`` with both modules patched at the class: no F.one_hot
    runs, and the soft tokens are stock's (fp32) and no less accurate than stock's against float64."""
    encoder = make_encoder(sgl, monkeypatch, dtype, mask_first=mask_first, standardize=standardize)
    pixels, ids, _ = inputs(dtype)
    with torch.no_grad():
        stock, stock_mask = encoder(pixels, ids)
        exact, _ = float64_twin(encoder)(pixels.double(), ids)
        assert apply_fused_vision_to_sglang_gemma4() == sglang_classes()
        assert "fused_vision=patch_embed(backend=auto)" in repr(encoder.patch_embedder)
        monkeypatch.setattr(torch.nn.functional, "one_hot", no_one_hot)
        fused, mask = encoder(pixels, ids)
    assert_soft_tokens_match_stock(fused, mask, stock, stock_mask, exact, "SGLang soft tokens")


# ---- patching: instances, revert, errors, the plugin -------------------------------------------------------


def test_instance_patch_and_revert(sgl, monkeypatch):
    encoder = make_encoder(sgl, monkeypatch, torch.float32)
    pixels, ids, _ = inputs()
    with torch.no_grad():
        stock, _ = encoder(pixels, ids)
    assert apply_fused_vision_to_sglang_gemma4(encoder, backend="reference") == 2
    assert apply_fused_vision_to_sglang_gemma4(encoder, backend="reference") == 2  # idempotent
    assert "fused_vision=pool_by_positions(backend=reference)" in repr(encoder.pooler)
    other = make_encoder(sgl, monkeypatch, torch.float32)
    assert getattr(other.patch_embedder, "_fused_vision", None) is None  # the instance patch stays its own
    assert revert_fused_vision_sglang_gemma4(encoder) == 2
    assert "fused_vision" not in repr(encoder)
    with torch.no_grad():
        assert_bit_identical(encoder(pixels, ids)[0], stock, "reverted encoder")


def test_apply_errors_name_the_problem(sgl, monkeypatch):
    encoder = make_encoder(sgl, monkeypatch, torch.float32)
    with pytest.raises(ValueError, match="nothing selected"):
        apply_fused_vision_to_sglang_gemma4(embedder=None, pooler=False)
    with pytest.raises(ValueError, match="backend"):
        apply_fused_vision_to_sglang_gemma4(backend="cuda")
    with pytest.raises(TypeError, match="Module"):
        apply_fused_vision_to_sglang_gemma4("encoder")
    wanted = {
        2: "Gemma4VisionPatchEmbedder or Gemma4VisionPooler",
        3: "Gemma4VisionPatchEmbedder, Gemma4VisionPooler or EmbeddingGemma2VisionPooler",
    }[sglang_classes()]
    with pytest.raises(ValueError, match=f"contains no {wanted}, so .*for transformers"):
        apply_fused_vision_to_sglang_gemma4(nn.Linear(2, 2))
    # transformers' patch, handed SGLang's tower, points to this one
    with pytest.raises(ValueError, match="SGLang model.*apply_fused_vision_to_sglang_gemma4"):
        apply_fused_vision_to_gemma4(encoder)
    monkeypatch.setitem(sys.modules, fs.SGLANG_MODULE, None)
    with pytest.raises(ImportError, match="needs SGLang with Gemma 4"):
        apply_fused_vision_to_sglang_gemma4()


def test_embedding_gemma2_that_is_absent_or_does_not_import_leaves_gemma4_patched(sgl, monkeypatch, caplog):
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
    assert sgl.Gemma4VisionPooler.forward is fs._pooler_forward


def test_sglang_plugin_is_registered_and_opt_in(sgl, monkeypatch, caplog):
    (entry_point,) = [
        e for e in importlib.metadata.entry_points(group="sglang.srt.plugins") if e.value.startswith("fused_vision")
    ]
    plugin = entry_point.load()
    assert plugin is fs.sglang_plugin
    stock_forward = sgl.Gemma4VisionPooler.forward
    monkeypatch.delenv(fs.ENV_SGLANG, raising=False)
    plugin()
    assert sgl.Gemma4VisionPooler.forward is stock_forward
    monkeypatch.setenv(fs.ENV_SGLANG, "1")
    plugin()
    assert sgl.Gemma4VisionPatchEmbedder.forward is fg._embedder_forward
    assert sgl.Gemma4VisionPooler.forward is fs._pooler_forward
    revert_fused_vision_sglang_gemma4()
    assert sgl.Gemma4VisionPooler.forward is stock_forward
    # where SGLang's Gemma 4 is missing it warns rather than raise inside SGLang's plugin loader
    monkeypatch.setitem(sys.modules, fs.SGLANG_MODULE, None)
    with caplog.at_level("WARNING", logger="fused_vision"):
        plugin()
    assert "cannot be patched" in caplog.text
