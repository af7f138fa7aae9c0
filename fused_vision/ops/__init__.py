"""The public ops: input checks, backend dispatch, autograd and ``torch.library`` registration.

One module per op, each named after its function (``fused_vision.position_embeddings`` lives in
``ops/position_embeddings.py``), over the Triton launcher of the same name in ``fused_vision.kernels``
and the PyTorch reference of the same name in ``fused_vision.reference``.
"""
