"""From a source checkout, ``fused_vision.kernels`` is the top-level kernels/ folder.

kernels/ has no ``__init__.py``: from a checkout's root, first on ``sys.path`` under ``python -m``, it is then
only a namespace portion, which loses to any installed regular package named ``kernels`` (Hugging Face's
kernel hub, which transformers imports). A wheel ships the folder as fused_vision/kernels/; setuptools'
editable finder resolves no folder without ``__init__.py``, so from a checkout it is registered here.
"""

import importlib.machinery
import importlib.util
import sys
from pathlib import Path

_NAME = f"{__package__}.kernels"

if importlib.util.find_spec(_NAME) is None:
    _spec = importlib.machinery.ModuleSpec(_NAME, None, is_package=True)
    _spec.submodule_search_locations = [str(Path(__file__).resolve().parent.parent / "kernels")]
    sys.modules[_NAME] = importlib.util.module_from_spec(_spec)
    sys.modules[__package__].kernels = sys.modules[_NAME]  # as an import would bind it
