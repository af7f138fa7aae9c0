"""fused_vision inside the engines that build Gemma 4's vision tower (docs/integrations.md).

``stem`` (the embedder's and pooler's forwards the towers share), ``transformers``, ``vllm`` and
``sglang``; the patching they do is ``fused_vision.patching``'s, named here too under its old path.
"""

import sys

from .. import patching

sys.modules[f"{__name__}.patching"] = patching
