"""What transformers' Gemma 4 modules are called, release by release, read in one place.

Each spelling is told from the module itself, never from a version string, so a release that renames an
attribute fails here, by name, rather than deep inside a forward.
"""

from __future__ import annotations

import importlib

from torch import nn

__all__ = ["modeling", "norm_epsilon"]

# Gemma4RMSNorm's epsilon: ``eps`` in 5.5-5.24, ``variance_epsilon`` from 5.25.
_NORM_EPSILON_NAMES = ("variance_epsilon", "eps")


def modeling():
    """``transformers.models.gemma4.modeling_gemma4``, with an error that names the real cause."""
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(
            f"fused_vision's Gemma 4 patch needs transformers>=5.5 ({exc}): pip install 'fused-vision[gemma4]'"
        ) from exc
    name = "transformers.models.gemma4.modeling_gemma4"
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and name.startswith(exc.name):
            raise ImportError(
                f"transformers {transformers.__version__} has no Gemma 4 ({name}); it arrived in transformers 5.5"
            ) from exc
        raise ImportError(f"transformers {transformers.__version__}: importing {name} failed: {exc}") from exc
    except ImportError as exc:
        raise ImportError(f"transformers {transformers.__version__}: importing {name} failed: {exc}") from exc


def norm_epsilon(norm: nn.Module) -> float:
    """The epsilon of a Gemma 4 RMS norm, under whichever name its release gave it."""
    for name in _NORM_EPSILON_NAMES:
        value = getattr(norm, name, None)
        if isinstance(value, float):
            return value
    raise AttributeError(
        f"{type(norm).__qualname__} has none of {_NORM_EPSILON_NAMES} as a float: "
        "this transformers release renamed its norm's epsilon; fused_vision does not know it yet"
    )
