"""fused_vision: the Gemma 4 vision stem without the one-hot, as Triton kernels with PyTorch fallbacks."""

from importlib.metadata import PackageNotFoundError, version as _version

from .patch_embed import patch_embed
from .pooler import pool_by_positions
from .position_embedding import position_embeddings

try:
    __version__ = _version("fused-vision")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["patch_embed", "pool_by_positions", "position_embeddings", "__version__"]
