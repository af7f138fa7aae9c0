"""The GEMMs of a fused layer's linears: the weight read directly, or the module's own call.

A fused layer reads a linear's weight (and concatenates q/k/v's and gate/up's into one GEMM) where the
module computes exactly ``F.linear(x, weight)``: transformers' bias-free ``nn.Linear``, and vLLM's
unquantized ``ReplicatedLinear`` (what vLLM turns the tower's linears into) whose GEMM is ``F.linear``.
Every other linear module (quantized, LoRA-wrapped, biased, another GEMM backend) is called as stock
calls it, and the layer's norms, RoPE, GELU gate and clamps stay fused around it.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["computes_linear", "project", "reads_weight", "unusable"]

_VLLM_LINEAR = "vllm.model_executor.layers.linear"
_VLLM_GEMMS = "vllm.model_executor.layers.utils"
# vLLM's unquantized GEMMs that are ``F.linear`` itself (CUDA's, unless it marked the layer for its skinny GEMM)
_LINEAR_GEMMS = ("default_unquantized_gemm", "cuda_unquantized_gemm")


def _is_vllm(obj, module: str, name: str) -> bool:
    cls = type(obj)
    return cls.__name__ == name and cls.__module__ == module


def _vllm_gemm_is_linear(linear: nn.Module) -> bool:
    """Whether vLLM's unquantized ``ReplicatedLinear`` computes ``F.linear(x, weight)``: no bias, no batch-
    invariant mode, and its GEMM F.linear (CUDA's default; the CPU's where vLLM packed no weight)."""
    if not _is_vllm(linear, _VLLM_LINEAR, "ReplicatedLinear") or getattr(linear, "return_bias", True):
        return False
    method = getattr(linear, "quant_method", None)
    if not _is_vllm(method, _VLLM_LINEAR, "UnquantizedLinearMethod") or linear.bias is not None:
        return False
    envs = sys.modules.get("vllm.envs")
    if envs is None or getattr(envs, "VLLM_BATCH_INVARIANT", True):
        return False
    gemm = getattr(method, "_gemm_impl", None)
    gemms = sys.modules.get(_VLLM_GEMMS)
    if gemms is None or gemm is None:
        return False
    if any(gemm is getattr(gemms, name, None) for name in _LINEAR_GEMMS):
        return not getattr(linear, "use_skinny_gemm", False)
    return gemm is getattr(gemms, "cpu_unquantized_gemm", None) and getattr(linear, "cpu_linear", None) is F.linear


def computes_linear(linear: nn.Module) -> bool:
    """Whether ``linear`` computes exactly ``F.linear(x, linear.weight)`` with a 2-D weight."""
    weight = getattr(linear, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return False
    if type(linear) is nn.Linear:  # quantized, LoRA-adapted or parametrized linears are subclasses
        return linear.bias is None and type(weight) in (nn.Parameter, torch.Tensor)
    return _vllm_gemm_is_linear(linear)


def reads_weight(linear: nn.Module, x: torch.Tensor) -> bool:
    """Whether a fused layer may compute ``linear`` on ``x`` as ``F.linear(x, linear.weight)``: the module
    computes just that, with a weight of x's dtype and device."""
    if not computes_linear(linear):
        return False
    return linear.weight.dtype == x.dtype and linear.weight.device == x.device


def unusable(linear: nn.Module) -> str | None:
    """Why a fused layer cannot call ``linear`` as stock does, or None."""
    if not isinstance(linear, nn.Module):
        return f"is a {type(linear).__name__}, not a module"
    if getattr(linear, "return_bias", False) and type(linear).__module__.startswith("vllm."):
        return "returns its bias beside its output"
    return None


def project(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``linear`` applied to ``x``: its weight read directly where ``reads_weight``, else its own call."""
    return F.linear(x, linear.weight) if reads_weight(linear, x) else linear(x)
