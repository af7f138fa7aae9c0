"""The pipeline from a call's items to their soft tokens (docs/planner.md, docs/encoders.md).

``_inputs`` (the items checked, split and counted), ``planner`` (how many items or tokens a call holds,
from the memory model), ``_memory`` (what the device has free), ``_chunks`` (calls halved on
out-of-memory), and the two entry points that run them: ``encoding.encode_images`` and
``graphs.GraphedEncoder``.
"""
