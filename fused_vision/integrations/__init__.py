"""fused_vision inside the engines that build Gemma 4's vision tower (docs/integrations.md).

``stem`` (the embedder's and pooler's forwards the towers share), ``encoder`` (the encoder's forwards),
``transformers``, ``vllm`` and ``sglang``; the patching they do is ``fused_vision.patching``'s.
"""
