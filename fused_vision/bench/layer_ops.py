"""The fused encoder layer's three ops, at a Gemma 4 vision tower's shape, on a case's patches packed.

Each op runs on T tokens, the case's real patches with the padding dropped, as the fused encoder runs them
(19,872 at image_8x280), at the shape of the tower of the run's width D: 1152 the 26B/31B tower's (16 heads
of 72, intermediate 4304), 768 the E2B/E4B tower's (with its clipped linears' clamps), 64 --tiny's.

Providers: ``stock``, the eager PyTorch formulation of stock's modules (``fused_vision.reference``);
``compiled``, that formulation through ``torch.compile`` (static shapes), what inductor makes of the same code;
``reference``, the public op with its PyTorch backend (stock's formulation behind the op's input checks);
``fused``, the public op with the Triton backend; ``fused_kernel``, its Triton launcher alone. Byte models count each
input read once and each output written once, so GB/s over the copy ceiling says how near an op is to the
memory bound that all three are held to.
"""

from functools import partial

import torch

import fused_vision
from fused_vision import reference

from .ops import ID_BYTES, StemBench, Unsupported, compile_static
from .tower import TINY_TOWER, VISION_TOWERS, tower_shape

CLAMP_BOUND = 1e4  # wide enough that no clamp binds: the clamps cost their loads, as at the checkpoints' bounds


def layer_shape(hidden: int) -> dict:
    """The shape of the vision tower of width ``hidden``: a checkpoint's, or --tiny's 26B/31B-structured one."""
    for name, shape in VISION_TOWERS.items():
        if shape["hidden_size"] == hidden:
            return tower_shape(name, tiny=False)
    if hidden == TINY_TOWER["hidden_size"]:
        return tower_shape("tower_26b_31b", tiny=True)
    widths = sorted({shape["hidden_size"] for shape in VISION_TOWERS.values()} | {TINY_TOWER["hidden_size"]})
    raise Unsupported(f"no Gemma 4 vision tower has width D={hidden} (the layer ops run at {widths})")


def qkv_norm_rope_bytes(tokens: int, shape: dict, dtype: torch.dtype) -> int:
    """(T, (H + 2 Hkv) d) projections and (T, 2) int64 ids read, q, k, v of the same size written; the two
    (d,) norm weights, the (d / 4,) fp32 frequencies and the fp32 clamps (E2B/E4B) read."""
    head_dim = shape["head_dim"]
    width = (shape["num_attention_heads"] + 2 * shape["num_key_value_heads"]) * head_dim
    clamps = 3 * 2 * 4 if shape["use_clipped_linears"] else 0
    small = 2 * head_dim * dtype.itemsize + head_dim // 4 * 4 + clamps
    return tokens * (2 * width * dtype.itemsize + 2 * ID_BYTES) + small


def residual_rms_norm_bytes(tokens: int, shape: dict, dtype: torch.dtype) -> int:
    """(T, D) x and residual read, (T, D) h and y written; the two (D,) weights read."""
    hidden = shape["hidden_size"]
    return (4 * tokens + 2) * hidden * dtype.itemsize


def gelu_gate_bytes(tokens: int, shape: dict, dtype: torch.dtype) -> int:
    """(T, 2I) gate and up read, (T, I) written; the fp32 clamps (E2B/E4B) read."""
    clamps = 3 * 2 * 4 if shape["use_clipped_linears"] else 0
    return 3 * tokens * shape["intermediate_size"] * dtype.itemsize + clamps


class LayerBench(StemBench):
    """One layer op on the case's packed tokens at the tower's shape of width ``hidden``."""

    providers = ("stock", "compiled", "reference", "fused", "fused_kernel")

    def __init__(self, case, hidden, dtype, device):
        super().__init__(case, hidden, dtype, device)
        self.shape = layer_shape(hidden)
        self.tokens = int((~self.padding).sum())
        self.dtype, self.device = dtype, device

    def random(self, *size: int) -> torch.Tensor:
        return torch.randn(*size, device=self.device).to(self.dtype)

    def clamps(self, rows: int) -> torch.Tensor | None:
        if not self.shape["use_clipped_linears"]:
            return None
        return torch.tensor([[-CLAMP_BOUND, CLAMP_BOUND]] * rows, device=self.device)


class QkvNormRope(LayerBench):
    name = "qkv_norm_rope"

    def __init__(self, case, hidden, dtype, device):
        super().__init__(case, hidden, dtype, device)
        shape = self.shape
        heads, kv_heads, head_dim = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
        qkv = self.random(self.tokens, (heads + 2 * kv_heads) * head_dim)
        weights = (torch.rand(head_dim, device=device).to(dtype) for _ in range(2))
        inv_freq = torch.rand(head_dim // 4, device=device)  # the angles' values do not change the cost
        self.args = (qkv, self.ids[~self.padding], *weights, inv_freq, heads, kv_heads)
        self.kwargs = dict(eps=1e-6, clamps=self.clamps(3))
        self.model_bytes = qkv_norm_rope_bytes(self.tokens, shape, dtype)

    def stock(self):
        return partial(reference.qkv_norm_rope, *self.args, **self.kwargs)

    def compiled(self):
        return partial(compile_static(reference.qkv_norm_rope), *self.args, **self.kwargs)

    def reference(self):
        return partial(fused_vision.qkv_norm_rope, *self.args, **self.kwargs, backend="reference")

    def fused(self):
        return partial(fused_vision.qkv_norm_rope, *self.args, **self.kwargs, backend="triton")

    def fused_kernel(self):
        from fused_vision.kernels.qkv_norm_rope import qkv_norm_rope

        return partial(qkv_norm_rope, *self.args, self.kwargs["eps"], self.kwargs["clamps"])


class ResidualRmsNorm(LayerBench):
    """The pass between the attention and the MLP: post-attention norm, residual add, pre-feed-forward norm."""

    name = "residual_rms_norm"

    def __init__(self, case, hidden, dtype, device):
        super().__init__(case, hidden, dtype, device)
        x, residual = self.random(self.tokens, hidden), self.random(self.tokens, hidden)
        weights = (torch.rand(hidden, device=device).to(dtype) for _ in range(2))
        self.args = (x, residual, *weights)
        self.model_bytes = residual_rms_norm_bytes(self.tokens, self.shape, dtype)

    def stock(self):
        return partial(reference.residual_rms_norm, *self.args, 1e-6)

    def compiled(self):
        return partial(compile_static(reference.residual_rms_norm), *self.args, 1e-6)

    def reference(self):
        return partial(fused_vision.residual_rms_norm, *self.args, eps=1e-6, backend="reference")

    def fused(self):
        return partial(fused_vision.residual_rms_norm, *self.args, eps=1e-6, backend="triton")

    def fused_kernel(self):
        from fused_vision.kernels.residual_rms_norm import residual_rms_norm

        return partial(residual_rms_norm, *self.args, 1e-6)


class GeluGate(LayerBench):
    name = "gelu_gate"

    def __init__(self, case, hidden, dtype, device):
        super().__init__(case, hidden, dtype, device)
        self.args = (self.random(self.tokens, 2 * self.shape["intermediate_size"]), self.clamps(3))
        self.model_bytes = gelu_gate_bytes(self.tokens, self.shape, dtype)

    def stock(self):
        return partial(reference.gelu_gate, *self.args)

    def compiled(self):
        return partial(compile_static(reference.gelu_gate), *self.args)

    def reference(self):
        return partial(fused_vision.gelu_gate, *self.args, backend="reference")

    def fused(self):
        return partial(fused_vision.gelu_gate, *self.args, backend="triton")

    def fused_kernel(self):
        from fused_vision.kernels.gelu_gate import gelu_gate

        return partial(gelu_gate, *self.args)


def gate_up_gelu_bytes(tokens: int, shape: dict, dtype: torch.dtype) -> int:
    """(T, D) y and the (2I, D) weight read, (T, I) written; the fp32 clamps (E2B/E4B) read. The separate
    path also writes and reads the (T, 2I) gate/up activations: 3 T I elements more."""
    hidden, intermediate = shape["hidden_size"], shape["intermediate_size"]
    clamps = 3 * 2 * 4 if shape["use_clipped_linears"] else 0
    return (tokens * hidden + 2 * intermediate * hidden + tokens * intermediate) * dtype.itemsize + clamps


class GateUpGelu(LayerBench):
    """The MLP's gate/up GEMM and its GELU gate: ``separate`` is what the fused layer runs by default
    (cuBLAS's GEMM, then the gate kernel), ``fused`` the one GEMM with the gate in its epilogue."""

    name = "gate_up_gelu"
    providers = (*LayerBench.providers, "separate")

    def __init__(self, case, hidden, dtype, device):
        super().__init__(case, hidden, dtype, device)
        intermediate = self.shape["intermediate_size"]
        weight = self.random(2 * intermediate, hidden) / hidden**0.5
        self.args = (self.random(self.tokens, hidden), weight, self.clamps(3))
        self.model_bytes = gate_up_gelu_bytes(self.tokens, self.shape, dtype)

    def stock(self):
        return partial(reference.gate_up_gelu, *self.args)

    def compiled(self):
        return partial(compile_static(reference.gate_up_gelu), *self.args)

    def reference(self):
        return partial(fused_vision.gate_up_gelu, *self.args, backend="reference")

    def fused(self):
        return partial(fused_vision.gate_up_gelu, *self.args, backend="triton")

    def fused_kernel(self):
        if self.dtype == torch.float32:
            raise Unsupported("the epilogue GEMM takes bf16 and fp16 (float32 runs cuBLAS and the gate kernel)")
        from fused_vision.kernels.gate_up_gelu import gate_up_gelu

        return partial(gate_up_gelu, *self.args)

    def separate(self):
        y, weight, clamps = self.args
        return lambda: fused_vision.gelu_gate(torch.nn.functional.linear(y, weight), clamps, backend="triton")


LAYER_OPS: dict[str, type[LayerBench]] = {op.name: op for op in (QkvNormRope, ResidualRmsNorm, GeluGate, GateUpGelu)}
