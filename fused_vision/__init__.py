"""fused_vision: the Gemma 4 vision stem without the one-hot, as Triton kernels with PyTorch fallbacks."""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

from . import _checkout  # noqa: F401  (from a source tree, makes fused_vision.kernels the checkout's kernels/)
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
from .pipeline.encoding import encode_images
from .pipeline.graphs import GraphedEncoder

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
