"""The packed encoder inside SGLang's own ``Gemma4VisionEncoder`` (``encoder="packed"`` in
``fused_vision.sglang.apply_fused_vision_to_sglang_gemma4``).

SGLang's FA3 and Triton vision backends drop stock's padding mask, so padded items attend their padding
keys. The packed forward strips each item's padding and runs SGLang's own embedder and encoder without a
mask: on one sequence whose varlen backends (``VARLEN_BACKENDS``) get the items' ``cu_seqlens``, or item by
item on every other backend; SGLang's pooler then runs on the rows put back at their padded length, zeros
at the padding. The boundaries travel with the call. Details: docs/sglang.md.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ..encoder import packed
from ..encoder.attention import Packing
from . import patching

__all__ = ["VARLEN_BACKENDS", "encoder_target", "packed_encoder_forward"]

# SGLang's attention backends (``QKV_BACKEND_IMPL`` names) that attend within each cu_seqlens segment of
# one (T, H, d) sequence: flash-attn's varlen layout.
VARLEN_BACKENDS = ("triton_attn", "fa3", "fa4", "aiter_attn")


class _Varlen:
    """A layer's attention backend for one packed call, handed the packing's boundaries: SGLang's attention
    passes every argument by keyword, ``cu_seqlens=None`` among them."""

    def __init__(self, backend: nn.Module, packing: Packing):
        self.backend, self.packing = backend, packing

    def forward(self, **kwargs):
        boundaries = {"cu_seqlens": self.packing.cu_seqlens, "max_seqlen": self.packing.longest}
        return self.backend.forward(**{**kwargs, **boundaries})

    __call__ = forward


def _attention_forward(self, *args, **kwargs):
    """SGLang's ``Gemma4VisionAttention.forward``: stock's; where its mask is a ``Packing``, stock's without
    a mask on a view of the module whose backend attends within the packing's items."""
    packing = next((value for value in (*args, *kwargs.values()) if isinstance(value, Packing)), None)
    if packing is not None:
        args = tuple(None if value is packing else value for value in args)
        kwargs = {name: None if value is packing else value for name, value in kwargs.items()}
        self = patching.call_view(self, qkv_backend=_Varlen(self.qkv_backend, packing))
    return patching.stock_method(self, "forward")(*args, **kwargs)


def _keyword_names(code) -> set[str]:
    names = set()
    for const in code.co_consts:
        if isinstance(const, tuple):
            names.update(item for item in const if isinstance(item, str))
    return names


@functools.cache
def _attention_takes_boundaries(attention_cls: type) -> bool:
    """Whether ``attention_cls``'s stock forward calls its ``qkv_backend.forward`` with keywords only,
    cu_seqlens and attention_mask among them: where it does not, the backend cannot be handed the boundaries."""
    code = getattr(patching.stock_attribute(attention_cls, "forward"), "__code__", None)
    if code is None or "qkv_backend" not in code.co_names:
        return False
    return {"cu_seqlens", "attention_mask", "bsz", "seq_len"} <= _keyword_names(code)


def _vit_cuda_graph() -> bool:
    try:
        from sglang.srt.environ import envs

        return bool(envs.SGLANG_VIT_ENABLE_CUDA_GRAPH.get())
    except (ImportError, AttributeError):
        return False


def _install(vision) -> None:
    """SGLang's ``Gemma4VisionAttention.forward`` patched to take a ``Packing`` (stock's for every other
    call): once, and again after a revert restored the class."""
    attention_cls = vision.Gemma4VisionAttention
    if attention_cls.__dict__.get("forward") is not _attention_forward:
        patching.install_methods(attention_cls, {"forward": _attention_forward})


def _varlen(vision, transformer) -> bool:
    """Whether every layer takes the packed sequence with a ``Packing``: SGLang's own attention forward,
    which hands a backend that attends within cu_seqlens segments the boundaries."""
    if not _attention_takes_boundaries(vision.Gemma4VisionAttention):
        return False
    _install(vision)
    for layer in transformer.layers:
        attention = layer.self_attn
        backend = type(getattr(attention, "qkv_backend", None))
        if type(attention).forward is not _attention_forward:  # a subclass's own forward
            return False
        if not any(backend is vision.QKV_BACKEND_IMPL.get(name) for name in VARLEN_BACKENDS):
            return False
    return True


def _encode(vision, transformer, inputs_embeds, ids, lengths) -> torch.Tensor:
    """SGLang's encoder on the (1, T, D) packed sequence, attention within each item: (T, D)."""
    if _varlen(vision, transformer):
        packing = Packing.of(lengths, inputs_embeds.device)
        return transformer(inputs_embeds=inputs_embeds, attention_mask=packing, patch_positions=ids)[0]
    items = zip(torch.split(inputs_embeds[0], lengths), torch.split(ids[0], lengths))
    return torch.cat(
        [transformer(inputs_embeds=e[None], attention_mask=None, patch_positions=i[None])[0] for e, i in items]
    )


def _takes(vision, encoder, pixel_values, pixel_position_ids, args, kwargs) -> bool:
    """Whether the packed forward returns what stock would: SGLang's own modules, padded (B, N, ·) tensors
    with N a multiple of k^2; else stock runs (and raises where it raises)."""
    if args or kwargs or _vit_cuda_graph():
        return False
    if not isinstance(getattr(encoder, "encoder", None), vision.Gemma4VisionTransformer):
        return False
    if not all(isinstance(layer.self_attn, vision.Gemma4VisionAttention) for layer in encoder.encoder.layers):
        return False
    if not packed.padded_batch(pixel_values, pixel_position_ids):
        return False
    k2 = encoder.pooling_kernel_size**2
    return pixel_values.shape[0] > 0 and pixel_values.shape[1] >= k2 and pixel_values.shape[1] % k2 == 0


def packed_encoder_forward(self, pixel_values, pixel_position_ids, *args, **kwargs):
    """SGLang's ``Gemma4VisionEncoder.forward`` through the packed encoder: (pooled, pooler_mask) as stock
    returns them, each item's attention within its real patches whatever the backend."""
    from .sglang import _sglang_vision

    vision = _sglang_vision()
    state = patching.fused_state(self)
    inputs = (pixel_values, pixel_position_ids, *args)
    if state is None or not _takes(vision, self, pixel_values, pixel_position_ids, args, kwargs):
        return patching.stock_method(self, "forward")(*inputs, **kwargs)
    real, lengths, pixels, ids = packed.pack_items(list(pixel_values), list(pixel_position_ids))
    if min(lengths) == 0:  # an item with no real patch: stock's own forward
        return patching.stock_method(self, "forward")(*inputs, **kwargs)
    no_padding = torch.zeros(ids.shape[:2], dtype=torch.bool, device=ids.device)
    inputs_embeds = self.patch_embedder(pixels, ids, no_padding)
    mask = torch.stack(real)
    hidden = packed.scatter_rows(_encode(vision, self.encoder, inputs_embeds, ids, lengths), mask)
    output_length = pixel_values.shape[-2] // self.pooling_kernel_size**2
    pooled, pooler_mask = self.pooler(hidden, pixel_position_ids, ~mask, output_length=output_length)
    if getattr(self, "standardize", False):
        pooled = (pooled - self.std_bias) * self.std_scale
    return pooled, pooler_mask


def encoder_target(encoder_cls: type, state) -> patching.Target:
    """What ``encoder="packed"`` patches: SGLang's ``Gemma4VisionEncoder.forward``."""
    return patching.Target(encoder_cls, {"forward": packed_encoder_forward}, state)
