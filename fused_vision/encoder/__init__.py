"""The packed and fused Gemma 4 vision encoders (docs/encoders.md): each call is handed its backend.

``attention`` (attention within each packed item), ``packed`` (the packed encoder), ``fused_layer`` and
``linears`` (its fused layers), ``padded`` (the layers on the padded batch engines hand the encoder).
The forwards patched into transformers' classes are ``fused_vision.integrations.encoder``'s.
"""
