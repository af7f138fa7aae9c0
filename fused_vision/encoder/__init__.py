"""The packed and fused Gemma 4 vision encoders (docs/encoders.md).

``attention`` (attention within each packed item), ``packed`` (the packed encoder), ``fused_layer`` and
``linears`` (its fused layers), ``padded`` (``Gemma4VisionEncoder.forward`` on the padded batch engines
hand it, whose ``encoder_forward`` this package also names, as the module ``fused_vision.encoder`` did).
"""

from .padded import encoder_forward, packs

__all__ = ["encoder_forward", "packs"]
