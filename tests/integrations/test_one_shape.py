"""Every engine's ``apply_…`` and ``revert_…`` have one shape (docs/integrations.md): the same parameters, in
the same order, of the same kinds, defaults and annotations; the same error for the same bad input, raised
before the engine is imported, so these tests run whether or not vLLM and SGLang are installed."""

import inspect
from pathlib import Path

import pytest
from torch import nn

import fused_vision
from fused_vision.integrations import sglang, transformers

from helpers import reverting_to_stock

APPLY = {
    "transformers": fused_vision.apply_fused_vision_to_gemma4,
    "vllm": fused_vision.apply_fused_vision_to_vllm_gemma4,
    "sglang": fused_vision.apply_fused_vision_to_sglang_gemma4,
}
REVERT = {
    "transformers": fused_vision.revert_fused_vision_gemma4,
    "vllm": fused_vision.revert_fused_vision_vllm_gemma4,
    "sglang": fused_vision.revert_fused_vision_sglang_gemma4,
}
ENCODERS = {"transformers": transformers.ENCODERS, "vllm": transformers.ENCODERS, "sglang": sglang.SGLANG_ENCODERS}
DOCS = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"

# a call that raised must have patched nothing, in this process's engines least of all
stock_after_each_test = reverting_to_stock(*REVERT.values())


def shape(function) -> tuple:
    signature = inspect.signature(function)
    parameters = [(p.name, p.kind, p.default, p.annotation) for p in signature.parameters.values()]
    return parameters, signature.return_annotation


@pytest.mark.parametrize("functions", [APPLY, REVERT], ids=["apply", "revert"])
def test_every_engine_has_the_same_signature(functions):
    transformers_shape = shape(functions["transformers"])
    for engine, function in functions.items():
        assert shape(function) == transformers_shape, engine


def test_the_shape_is_the_documented_one():
    kinds = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY
    parameters, returns = shape(APPLY["transformers"])
    assert [(name, kind, default) for name, kind, default, _ in parameters] == [
        ("model", kinds[0], None),
        ("embedder", kinds[1], "patch_embed"),
        ("pooler", kinds[1], True),
        ("encoder", kinds[1], "stock"),
        ("backend", kinds[1], "auto"),
    ]
    assert returns == "int"
    assert shape(REVERT["transformers"]) == ([("model", kinds[0], None, "nn.Module | None")], "int")
    documented = DOCS.read_text()
    assert 'apply_fused_vision_to_<engine>(model=None, *, embedder="patch_embed", pooler=True, encoder="stock", ' in (
        documented
    )
    for function in (*APPLY.values(), *REVERT.values()):
        assert function.__name__ in documented and "docs/integrations.md" in function.__doc__, function.__name__


def bad_inputs(engine: str):
    """(keywords, error, message) for each bad input every ``apply_…`` refuses alike."""
    caller = APPLY[engine].__name__
    return [
        (dict(model="google/gemma-4-e2b-it"), TypeError, "model: expected a torch.nn.Module or None, got str"),
        (
            dict(model=nn.Linear(2, 2), embedder="one_hot"),
            ValueError,
            "embedder: expected one of ('patch_embed', 'position_embeddings') or None, got 'one_hot'",
        ),
        (dict(encoder="fastest"), ValueError, f"encoder: expected one of {ENCODERS[engine]}, got 'fastest'"),
        (dict(backend="cuda"), ValueError, "backend: expected one of ('auto', 'triton', 'reference'), got 'cuda'"),
        (
            dict(embedder=None, pooler=False),
            ValueError,
            f"{caller}: nothing selected (embedder=None, pooler=False, encoder='stock')",
        ),
    ]


@pytest.mark.parametrize("engine", APPLY)
def test_the_same_bad_input_raises_the_same_error_before_the_engine_is_imported(engine):
    for keywords, error, message in bad_inputs(engine):
        with pytest.raises(error) as raised:
            APPLY[engine](**keywords)
        assert message in str(raised.value), (engine, keywords)
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module or None, got str"):
        REVERT[engine]("google/gemma-4-e2b-it")


def test_sglangs_encoder_takes_fewer_choices():
    """SGLang's tower has no fused layers: ``encoder="fused"`` names the choices it takes."""
    assert sglang.SGLANG_ENCODERS == ("stock", "packed") and transformers.ENCODERS == ("stock", "packed", "fused")
    with pytest.raises(ValueError, match=r"encoder: expected one of \('stock', 'packed'\), got 'fused'"):
        fused_vision.apply_fused_vision_to_sglang_gemma4(encoder="fused")
