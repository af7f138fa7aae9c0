"""The fused layer's concatenated q/k/v and gate/up weights, shared with the parameters, not copied.

The first fused forward (or ``apply_…(model, encoder="fused")``) moves q/k/v's (gate/up's) weights into one
tensor whose row blocks the parameters then view, the same ``nn.Parameter`` objects. A weight later
replaced or moved (``.to``, a load with ``assign=True``) is concatenated again at the next forward, never
as an inference tensor (a forward under ``inference_mode`` leaves the parameters trainable). Where
autograd needs the weights' gradients the GEMM reads ``torch.cat`` of the parameters instead, so training
and LoRA on other modules see stock's gradients; under torch.compile too, as compiled graphs cannot rely
on storage checks.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from . import linears

__all__ = ["GROUPS", "gemm_weight", "group_modules", "release", "share_weights", "unshare_weights"]

# The concatenated projections: (the layer's submodule, its clipped linears in the GEMM's column order)
GROUPS = {"qkv": ("self_attn", ("q_proj", "k_proj", "v_proj")), "gate_up": ("mlp", ("gate_proj", "up_proj"))}
_SHARED = "_fused_vision_weights"  # the layer's {group: concatenated weight}, a plain attribute
_SHARING: weakref.WeakSet = weakref.WeakSet()  # the layers whose parameters view concatenated weights


def group_modules(layer: nn.Module, group: str) -> list[nn.Module]:
    parent, names = GROUPS[group]
    return [getattr(getattr(layer, parent), name) for name in names]


def _views_of(base: torch.Tensor | None, weights: list[torch.Tensor]) -> bool:
    """Whether ``weights`` are still the consecutive row blocks of ``base``."""
    if base is None or base.dtype != weights[0].dtype or base.device != weights[0].device or base.is_inference():
        return False
    row = 0
    for weight in weights:
        if weight.dim() != 2 or weight.shape[1] != base.shape[1] or not weight.is_contiguous():
            return False
        if weight.data_ptr() != base[row].data_ptr():
            return False
        row += weight.shape[0]
    return row == base.shape[0]


def share_weights(layer: nn.Module) -> dict[str, torch.Tensor]:
    """The layer's concatenated q/k/v and gate/up weights, whose row blocks its parameters view; made (or
    made again, where a weight was replaced or moved) here. The parameters stay the same objects."""
    shared = layer.__dict__.setdefault(_SHARED, {})
    for group in GROUPS:
        modules = [clipped.linear for clipped in group_modules(layer, group)]
        if not all(linears.computes_linear(module) for module in modules):
            continue  # each keeps its own GEMM
        if _views_of(shared.get(group), [module.weight for module in modules]):
            continue
        # Never an inference tensor, even under inference_mode: parameters viewing one get no gradient later.
        with torch.inference_mode(False), torch.no_grad():
            base = torch.cat([module.weight for module in modules])
            row = 0
            for module in modules:
                rows = module.weight.shape[0]
                module.weight.data = base[row : row + rows]  # the same Parameter, its storage now base's
                row += rows
        shared[group] = base
    _SHARING.add(layer)
    return shared


def unshare_weights(layer: nn.Module) -> bool:
    """Give the parameters storage of their own again (a checkpoint writer may refuse shared storage)."""
    shared = layer.__dict__.pop(_SHARED, None)
    _SHARING.discard(layer)
    if not shared:
        return False
    for group, base in shared.items():
        for clipped in group_modules(layer, group):
            weight = clipped.linear.weight
            if weight.untyped_storage().data_ptr() == base.untyped_storage().data_ptr():
                weight.data = weight.data.clone()
    return True


def gemm_weight(layer: nn.Module, group: str) -> torch.Tensor:
    weights = [clipped.linear.weight for clipped in group_modules(layer, group)]
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and any(w.requires_grad for w in weights)):
        return torch.cat(weights)
    return share_weights(layer)[group]


def release(model: nn.Module | None) -> int:
    """Unshare the weights of the layers in ``model`` (None: of every layer); returns how many."""
    layers = list(_SHARING) if model is None else [m for m in model.modules() if m in _SHARING]
    return sum(unshare_weights(layer) for layer in layers)
