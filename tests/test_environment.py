"""Every environment switch fused_vision reads, through its one parser: each spelling docs/environment.md
lists takes effect, and any other value is a ValueError naming the variable and the values it takes."""

import pathlib
import re
import types

import pytest
import torch

from fused_vision import _dispatch, _validation
from fused_vision._environment import OFF, ON, flag
from fused_vision.encoder import mlp, varlen
from fused_vision.integrations import sglang, vllm

PACKAGE = pathlib.Path(__file__).parents[1] / "fused_vision"
ON_SPELLINGS = [*ON, "TRUE", "Yes", " 1", "on\n"]
OFF_SPELLINGS = [*OFF, "FALSE", "No", " 0 ", "Off"]
TYPOS = ["2", "garbage", "enabled", "1 1", "y"]


def _gpu_ids(monkeypatch):
    """Ids on a GPU, as ``id_checks_enabled`` sees them, outside any capture or sync debug mode."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    return types.SimpleNamespace(is_cuda=True)


def _plugin(plugin, *also: str):
    """A plugin run with no patch to make: its switch is read, then nothing is imported."""

    def run(monkeypatch):
        for name in also:
            monkeypatch.setenv(name, "1")
        monkeypatch.setattr(vllm, "apply_fused_vision_to_vllm_gemma4", lambda encoder: None)
        monkeypatch.setattr(sglang, "apply_fused_vision_to_sglang_gemma4", lambda: None)
        return plugin()

    return run


# variable -> what reads it (given monkeypatch)
READERS = {
    "FUSED_VISION_BACKEND": lambda monkeypatch: _dispatch.resolve_backend("auto", torch.device("cpu")),
    "FUSED_VISION_CHECK_IDS": lambda monkeypatch: _validation.id_checks_enabled(_gpu_ids(monkeypatch), guarded=True),
    "FUSED_VISION_GATE_UP_EPILOGUE": lambda monkeypatch: mlp.gate_up_epilogue(),
    "FUSED_VISION_ATTENTION": lambda monkeypatch: varlen.attention_path(torch.empty(4, 2, 64)),
    "FUSED_VISION_VLLM": _plugin(vllm.vllm_plugin),
    "FUSED_VISION_VLLM_ENCODER": _plugin(vllm.vllm_plugin, "FUSED_VISION_VLLM"),
    "FUSED_VISION_SGLANG": _plugin(sglang.sglang_plugin),
}
FLAGS = ["FUSED_VISION_CHECK_IDS", "FUSED_VISION_GATE_UP_EPILOGUE", "FUSED_VISION_VLLM", "FUSED_VISION_SGLANG"]


def test_every_switch_the_package_reads_is_tested_here():
    named = {
        name for path in PACKAGE.rglob("*.py") for name in re.findall(r'"(FUSED_VISION_[A-Z_]+)"', path.read_text())
    }
    assert named == set(READERS)


@pytest.mark.parametrize("name", READERS)
@pytest.mark.parametrize("value", TYPOS)
def test_a_value_no_switch_takes_is_refused_by_name(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=rf"^{name}={re.escape(repr(value))}: expected one of .* \(or unset\)$"):
        READERS[name](monkeypatch)


@pytest.mark.parametrize("value", ON_SPELLINGS)
def test_every_spelling_of_on_turns_the_id_checks_on_on_a_gpu(monkeypatch, value):
    """Unset, a GPU kernel's ids go unchecked; asked for in any listed spelling, they are checked."""
    assert READERS["FUSED_VISION_CHECK_IDS"](monkeypatch) is False
    monkeypatch.setenv("FUSED_VISION_CHECK_IDS", value)
    assert READERS["FUSED_VISION_CHECK_IDS"](monkeypatch) is True


@pytest.mark.parametrize("value", OFF_SPELLINGS)
def test_every_spelling_of_off_turns_the_id_checks_off_on_the_host(monkeypatch, value):
    ids = torch.zeros(1, 4, 2, dtype=torch.int64)
    assert _validation.id_checks_enabled(ids) is True
    monkeypatch.setenv("FUSED_VISION_CHECK_IDS", value)
    assert _validation.id_checks_enabled(ids) is False


@pytest.mark.parametrize("name", FLAGS)
def test_each_flag_takes_every_spelling_and_unset_or_empty_is_its_default(monkeypatch, name):
    for value, expected in [*((v, True) for v in ON_SPELLINGS), *((v, False) for v in OFF_SPELLINGS)]:
        monkeypatch.setenv(name, value)
        assert flag(name) is expected, repr(value)
    monkeypatch.setenv(name, "")
    assert flag(name) is False
    monkeypatch.delenv(name)
    assert flag(name, default=None) is None


def test_named_values_are_read_in_any_case(monkeypatch):
    monkeypatch.setenv("FUSED_VISION_BACKEND", " Reference ")
    assert READERS["FUSED_VISION_BACKEND"](monkeypatch) == "reference"
    monkeypatch.setenv("FUSED_VISION_GATE_UP_EPILOGUE", "ON")
    assert mlp.gate_up_epilogue() is True
    monkeypatch.setenv("FUSED_VISION_ATTENTION", "SDPA")
    assert READERS["FUSED_VISION_ATTENTION"](monkeypatch) == "sdpa"
