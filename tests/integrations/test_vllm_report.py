"""The vLLM plugin: its entry point, its opt-in, its one call, and its report: one line when it patches, one
after the first encoding call, through vLLM's own logger at INFO, once per process. The opt-in is tested
anywhere; what it patches in vLLM's model needs vLLM (tests/integrations/vllm_models.py)."""

import importlib.metadata
import logging
import sys

import pytest

import fused_vision.integrations.vllm as fv
from fused_vision import (
    _dispatch,
    apply_fused_vision_to_gemma4,
    apply_fused_vision_to_vllm_gemma4,
    revert_fused_vision_gemma4,
    revert_fused_vision_vllm_gemma4,
)
from fused_vision.integrations import report

from gemma4_towers import modeling, out_of_memory_above
from helpers import reverting_to_stock
from vllm_models import (  # noqa: F401 (the fixtures)
    GiB,
    gemma4_mm,
    memory,
    needs_vllm,
    run,
    tiny_model,
    transformers_is_patched,
    video_input,
    vllm_is_patched,
    vllm_process,
)

stock_after_each_test = reverting_to_stock(
    revert_fused_vision_vllm_gemma4, revert_fused_vision_gemma4, fresh_warnings=True
)


# ---- the plugin --------------------------------------------------------------------------------------


def test_the_entry_point_is_in_the_installed_package_metadata():
    (entry_point,) = [
        e for e in importlib.metadata.entry_points(group="vllm.general_plugins") if e.dist.name == "fused-vision"
    ]
    assert entry_point.name == "fused_vision_gemma4"
    assert entry_point.value == "fused_vision.integrations.vllm:vllm_plugin"
    assert entry_point.load() is fv.vllm_plugin


def test_the_plugin_does_nothing_without_the_variable(monkeypatch):
    monkeypatch.delenv(fv.ENV_VLLM, raising=False)
    fv.vllm_plugin()
    assert not transformers_is_patched()
    assert gemma4_mm is None or not vllm_is_patched()


def test_the_plugin_patches_transformers_and_vllm_in_one_call(monkeypatch, caplog):
    monkeypatch.setenv(fv.ENV_VLLM, "1")
    with caplog.at_level("WARNING", logger="fused_vision"):
        fv.vllm_plugin()
    if gemma4_mm is None:  # the call patches nothing where vLLM's Gemma 4 is missing
        assert not transformers_is_patched()
        assert "FUSED_VISION_VLLM=1 but vLLM's Gemma 4 cannot be patched here" in caplog.text
    else:
        assert transformers_is_patched() and vllm_is_patched()
        assert not [record for record in caplog.records if record.name == "fused_vision"]


@pytest.mark.parametrize("missing", ["transformers.models.gemma4.modeling_gemma4", fv.VLLM_MODULE])
def test_the_plugin_warns_and_never_raises(monkeypatch, caplog, missing):
    """vLLM runs its plugins unguarded in every process: an error there would stop vLLM's start-up. Where
    either Gemma 4 is missing, its one call patches nothing, vLLM's model included."""
    monkeypatch.setenv(fv.ENV_VLLM, "1")
    with monkeypatch.context() as gone:
        gone.setitem(sys.modules, missing, None)
        with caplog.at_level("WARNING", logger="fused_vision"):
            fv.vllm_plugin()
    assert "FUSED_VISION_VLLM=1 but vLLM's Gemma 4 cannot be patched here" in caplog.text
    assert not transformers_is_patched()
    assert gemma4_mm is None or fv.patching.fused_state(gemma4_mm.Gemma4ForConditionalGeneration) is None

    monkeypatch.setattr(
        fv, "apply_fused_vision_to_vllm_gemma4", lambda **keywords: 1 / 0
    )  # no ImportError: still caught
    caplog.clear()
    with caplog.at_level("WARNING", logger="fused_vision"):
        fv.vllm_plugin()
    assert "vLLM's Gemma 4 cannot be patched here (division by zero)" in caplog.text


@pytest.mark.parametrize("choice, encoder", [(None, None), ("", None), ("packed", "packed"), ("fused", "fused")])
def test_the_plugin_patches_the_encoder_it_is_told_to(monkeypatch, caplog, choice, encoder):
    from fused_vision.integrations.encoder import encoder_forward

    monkeypatch.setenv(fv.ENV_VLLM, "1")
    if choice is None:
        monkeypatch.delenv(fv.ENV_VLLM_ENCODER, raising=False)
    else:
        monkeypatch.setenv(fv.ENV_VLLM_ENCODER, choice)
    with caplog.at_level("WARNING", logger="fused_vision"):
        fv.vllm_plugin()
    patched = vars(modeling.Gemma4VisionEncoder).get("forward") is encoder_forward
    state = getattr(modeling.Gemma4VisionEncoder, "_fused_vision", None)
    if gemma4_mm is None:  # the encoder is patched for vLLM's towers only
        assert not patched and state is None
        return
    assert patched == (encoder is not None) and (state is None or state.op == f"{encoder}_encoder")
    assert vllm_is_patched()
    assert not [record for record in caplog.records if record.name == "fused_vision"]


def test_an_unknown_encoder_choice_stops_the_plugin_by_name(monkeypatch):
    monkeypatch.setenv(fv.ENV_VLLM, "1")
    monkeypatch.setenv(fv.ENV_VLLM_ENCODER, "fastest")
    with pytest.raises(ValueError, match="FUSED_VISION_VLLM_ENCODER='fastest': expected one of stock, packed, fused"):
        fv.vllm_plugin()
    assert not transformers_is_patched(), "nothing patched"
    with pytest.raises(ValueError, match="encoder: expected one of"):
        apply_fused_vision_to_vllm_gemma4(encoder="fastest")


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


# ---- its report ---------------------------------------------------------------------------------------


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def lines(monkeypatch):
    """What the plugin logs through vLLM's logger (whose own handler vLLM may keep from the root's), each
    test in a process that has reported nothing yet."""
    monkeypatch.setattr(report, "_LOGGED", set())
    monkeypatch.setattr(_dispatch, "_failed", set())
    handler, level = Lines(), fv.engine_logger.level
    fv.engine_logger.setLevel(logging.INFO)
    fv.engine_logger.addHandler(handler)
    yield handler.lines
    fv.engine_logger.removeHandler(handler)
    fv.engine_logger.setLevel(level)


def test_vllms_logger_is_the_one_the_report_goes_through():
    assert fv.engine_logger.name.startswith("vllm.")


def test_the_plugin_says_what_it_patched_once_per_process(monkeypatch, lines):
    monkeypatch.setenv(fv.ENV_VLLM, "1")
    monkeypatch.setenv(fv.ENV_VLLM_ENCODER, "fused")
    fv.vllm_plugin()
    fv.vllm_plugin()  # vLLM loads plugins once per process; a second load says nothing new
    if gemma4_mm is None:  # nothing patched: nothing to say (the warning says why)
        assert lines == []
        return
    (line,) = lines
    assert "Gemma4VisionPatchEmbedder -> patch_embed(backend=auto)" in line
    assert "Gemma4VisionPooler -> pool_by_positions(backend=auto)" in line
    assert "Gemma4VisionEncoder -> fused_encoder(backend=auto)" in line
    guarded = ", ".join(name for name in fv._methods(gemma4_mm.Gemma4ForConditionalGeneration) if "process" in name)
    assert f"the chunk planner (_encoder_chunk), the out-of-memory guard ({guarded})" in line


def test_without_the_variable_the_plugin_says_nothing(monkeypatch, lines):
    monkeypatch.delenv(fv.ENV_VLLM, raising=False)
    fv.vllm_plugin()
    assert lines == []


@needs_vllm
@pytest.mark.parametrize("forced", [None, "reference"])
def test_the_first_encoding_call_reports_backends_chunks_and_fallbacks(tiny_model, memory, monkeypatch, lines, forced):
    if forced is None:
        monkeypatch.delenv(_dispatch.ENV_BACKEND, raising=False)
    else:
        monkeypatch.setenv(_dispatch.ENV_BACKEND, forced)
    apply_fused_vision_to_gemma4()
    apply_fused_vision_to_vllm_gemma4()
    inputs = video_input(tiny_model, [2, 3], 64, seed=3)
    memory(64 * GiB, 128 * GiB)
    expected = tiny_model._encoder_chunk(64, 64 * GiB, 128 * GiB, 64)
    vllms = gemma4_mm.Gemma4ForConditionalGeneration._encoder_chunk(64, 64 * GiB, 128 * GiB, 64)
    run(tiny_model, "_process_video_input", inputs)
    run(tiny_model, "_process_video_input", inputs)  # the second call says nothing
    (line,) = lines
    backend = "triton (interpreted)" if forced is None else "reference"  # tests/conftest.py: TRITON_INTERPRET=1
    assert line.startswith("fused_vision: Gemma 4's vision tower on cpu: ")
    assert f"the embedder's position_embeddings (the projection is vLLM's): {backend}" in line
    assert f"the pooler's pool_by_positions: {backend}; the encoder: stock" in line
    method = next(name for name in fv._methods(type(tiny_model)) if "video" in name)  # 0.34: its _local half
    chunk = f"{expected} items of 64 patches per tower call in 13107 MiB (vLLM's own: {vllms})"
    assert f"{method}'s chunks: {chunk}; fallbacks: none" in line


@needs_vllm
def test_a_fallback_is_reported_with_its_reason(tiny_model, memory, monkeypatch, lines):
    """A layer the fused encoder cannot take (a forward hook on it) runs stock code: the report says which and why."""
    apply_fused_vision_to_gemma4()
    apply_fused_vision_to_vllm_gemma4(encoder="fused")
    handle = tiny_model.vision_tower.encoder.layers[0].register_forward_hook(lambda *args: None)
    try:
        with pytest.warns(RuntimeWarning, match="layer.s. 0 run stock code"):
            run(tiny_model, "_process_video_input", video_input(tiny_model, [2, 3], 64, seed=4))
    finally:
        handle.remove()
    (line,) = lines
    assert "the encoder: fused, attention " in line and ", its layers triton (interpreted);" in line
    assert "fused encoder: layer(s) 0 run stock code: the layer has forward hooks" in line.split("fallbacks: ")[1]


@needs_vllm
def test_an_out_of_memory_rerun_still_reports_the_first_chunk(tiny_model, memory, monkeypatch, lines):
    apply_fused_vision_to_gemma4()
    apply_fused_vision_to_vllm_gemma4()
    out_of_memory_above(monkeypatch, tiny_model.vision_tower.encoder, limit=2)
    with pytest.warns(RuntimeWarning, match="ran out of memory at 5 items"):
        run(tiny_model, "_process_video_input", video_input(tiny_model, [2, 3], 64, seed=5))
    (line,) = lines
    assert "chunks: 2 items of 64 patches per tower call" in line, "the chunks of the run that answered"


def test_a_line_that_cannot_be_composed_says_why_and_never_fails_the_call(monkeypatch, lines):
    def broken(*args):
        raise AttributeError("no vision_tower")

    monkeypatch.setattr(fv, "_first_call_line", broken)
    fv._report_first_call(None, "_process_image_input", None)
    fv._report_first_call(None, "_process_image_input", None)
    assert lines == ["fused_vision: no report of the first encoding call (AttributeError: no vision_tower)"]
