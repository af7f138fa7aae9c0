"""Triton kernels and their launchers. Installed as ``fused_vision.kernels``.

Nothing here validates inputs or chooses a backend: that policy lives in ``fused_vision``.
"""
