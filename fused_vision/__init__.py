"""fused_vision: the Gemma 4 vision stem without the one-hot, as Triton kernels with PyTorch fallbacks."""

import sys
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

from . import (
    _checkout,  # noqa: F401  (from a source tree, makes fused_vision.kernels the checkout's kernels/)
    encoder,
    integrations,
)
from . import patching as patching  # the method swapping the integrations share, public as before
from .encoder import attention, fused_layer, linears, packed
from .encoding import encode_images
from .graphs import GraphedEncoder
from .integrations import sglang, vllm
from .integrations import transformers as gemma4
from .integrations.sglang import apply_fused_vision_to_sglang_gemma4, revert_fused_vision_sglang_gemma4
from .integrations.transformers import apply_fused_vision_to_gemma4, revert_fused_vision_gemma4
from .integrations.vllm import apply_fused_vision_to_vllm_gemma4, revert_fused_vision_vllm_gemma4
from .ops.gate_up_gelu import gate_up_gelu
from .ops.gelu_gate import gelu_gate
from .ops.patch_embed import patch_embed
from .ops.pool_by_positions import pool_by_positions
from .ops.position_embeddings import position_embeddings
from .ops.qkv_norm_rope import qkv_norm_rope
from .ops.residual_rms_norm import residual_rms_norm

# The modules' paths before encoder/ and integrations/ (the entry points of older installs, users' imports)
# name the same module objects: what is patched through an old path is what runs.
_MOVED = {
    "attention": attention,
    "fused_layer": fused_layer,
    "gemma4": gemma4,
    "linears": linears,
    "packed": packed,
    "sglang": sglang,
    "sglang_packed": sglang,
    "vllm": vllm,
}
for _name, _module in _MOVED.items():
    sys.modules[f"{__name__}.{_name}"] = _module
    setattr(sys.modules[__name__], _name, _module)
del _name, _module
# ``fused_vision.encoder`` was one module, whose forward the integration now holds.
encoder.encoder_forward = integrations.encoder.encoder_forward

try:
    __version__ = _version("fused-vision")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "GraphedEncoder",
    "apply_fused_vision_to_gemma4",
    "apply_fused_vision_to_sglang_gemma4",
    "apply_fused_vision_to_vllm_gemma4",
    "encode_images",
    "gate_up_gelu",
    "gelu_gate",
    "patch_embed",
    "pool_by_positions",
    "position_embeddings",
    "qkv_norm_rope",
    "residual_rms_norm",
    "revert_fused_vision_gemma4",
    "revert_fused_vision_sglang_gemma4",
    "revert_fused_vision_vllm_gemma4",
    "__version__",
]
