"""fused_vision inside the engines that build Gemma 4's vision tower (docs/integrations.md).

``patching`` (swapping methods of classes or modules, and undoing it), ``transformers``, ``vllm`` and
``sglang``. Nothing is imported here, so that the encoder can use ``patching`` on its own.
"""
