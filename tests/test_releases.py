"""Each transformers release's spelling of what fused_vision reads from its Gemma 4 modules."""

import importlib

import pytest
from torch import nn

from fused_vision import _releases


@pytest.mark.parametrize("name", ["eps", "variance_epsilon"], ids=["eps_5_5_to_5_24", "variance_epsilon_5_25"])
def test_norm_epsilon_reads_each_releases_spelling(name):
    norm = nn.Module()
    setattr(norm, name, 3e-6)
    assert _releases.norm_epsilon(norm) == 3e-6


def test_norm_epsilon_of_the_installed_release():
    modeling = pytest.importorskip("transformers.models.gemma4.modeling_gemma4")
    assert _releases.norm_epsilon(modeling.Gemma4RMSNorm(8, eps=3e-6)) == 3e-6


def test_an_unknown_spelling_names_the_module_and_the_names_tried():
    with pytest.raises(AttributeError, match=r"Gemma4RMSNorm.*variance_epsilon.*eps"):
        _releases.norm_epsilon(type("Gemma4RMSNorm", (nn.Module,), {})())


def test_a_failed_gemma4_import_names_its_real_cause(monkeypatch):
    pytest.importorskip("transformers")
    real = importlib.import_module

    def broken(name, *args):
        if name == "transformers.models.gemma4.modeling_gemma4":
            raise ImportError("cannot import name 'CUDAProperties' from 'kernels'")
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", broken)
    with pytest.raises(ImportError, match="importing transformers.models.gemma4.modeling_gemma4 failed: cannot import"):
        _releases.modeling()
