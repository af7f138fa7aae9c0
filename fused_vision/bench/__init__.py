"""The benchmark: fused_vision against the one-hot it replaces and its peers, on the present device.

``python -m fused_vision bench`` (or ``fused-vision bench``, ``cli``) runs it; ``run(Options(...))`` is the same
from Python. Providers, per op: ``onehot`` (transformers 5.5-5.9), ``embedding`` (5.10+, two
F.embedding), ``compiled`` (torch.compile of the 5.10+ code; of the stock pooler), ``reference``
(fused_vision's public op on its PyTorch path, what a CPU runs), ``fused`` (the public op, Triton
backend) and ``fused_kernel`` (its Triton launcher alone); for the
encoders, ``stock`` (the tower's padded forward), ``padded``, ``packed`` and ``fused`` (``encode_images``),
and for the layer ops ``stock`` (their eager PyTorch code). Ops: the lookup, the patch embedder, the pooler,
the backward of each, the encoder layer's three fused ops, the E2B/E4B and 26B/31B vision towers, their
encoders on processor mixes, and vLLM's low-memory scenario. A run ends with a plain summary.
"""

from .plan import OP_GROUPS, OPS, PROVIDERS, Options
from .runner import run
from .workloads import Case

__all__ = ["Case", "OPS", "OP_GROUPS", "Options", "PROVIDERS", "run"]
