"""The packed and fused Gemma 4 vision encoders (docs/encoders.md).

``attention`` (attention within each packed item), ``packed`` (the packed encoder), ``fused_layer`` and
``linears`` (its fused layers), ``graphs`` (its embedder and layers in CUDA graphs, per token bucket),
``padded`` (``Gemma4VisionEncoder.forward`` on the padded batch engines hand it). ``encoder_forward`` and
``packs`` are named here too: ``fused_vision.encoder`` was that module.
"""

from .padded import encoder_forward, packs

__all__ = ["encoder_forward", "packs"]
