"""The fused Gemma 4 vision encoder layer: two concatenated GEMMs and three kernels, on (T, D) rows.

The rows are the packed sequence (``fused_vision.encoder.packed``, attention within each item) or the
encoder's padded (B, N) batch (``fused_vision.encoder.padded``; attention to each item's valid keys).
Per layer (stock's modules in brackets):

    qkv    = y @ W_qkv.T                          one GEMM       [q_proj, k_proj, v_proj]
    q,k,v  = qkv_norm_rope(qkv, ids)              one pass       [q/k/v norms, the axial 2-D RoPE]
    o      = o_proj(varlen_attention(q, k, v))    per item       [attention, o_proj]
    h, y   = residual_rms_norm(o, h)              one pass       [post-attention norm, add, pre-feed-forward norm]
    gu     = y @ W_gate_up.T                      one GEMM       [gate_proj, up_proj]
    h, y   = residual_rms_norm(down(gelu_gate(gu)), h)           [GELU, product, down_proj, post norm, add,
                                                                  the next layer's input norm]

``y`` is the next norm's output, carried into the next layer, so each layer's input norm is the previous
layer's last pass (the first layer's is its own module). The E2B/E4B clipped linears' output clamps are
folded into ``qkv_norm_rope`` and ``gelu_gate`` (and down_proj's input clamp into ``gelu_gate``); their
input clamps run before the GEMM, which stays one GEMM where q, k and v (gate and up) clamp alike and
becomes one per projection otherwise. With ``FUSED_VISION_GATE_UP_EPILOGUE=1`` the gate/up GEMM and
``gelu_gate`` are one kernel, ``gate_up_gelu`` (``fused_vision.encoder.mlp``).

The concatenated weights are shared with the parameters, not copied (``joined_weights``).

A layer that cannot run fused (``blocker``) runs its own stock code on the same rows, with their
attention, and one warning naming why. A layer transformers checkpoints runs fused through its own
checkpoint function, so that backward recomputes it fused.
"""

from __future__ import annotations

import functools
import sys

import torch
import torch.nn.functional as F
from torch import nn

from .. import _releases
from .._dispatch import warn_once
from .._validation import FLOAT_DTYPES
from ..ops.gate_up_gelu import gate_up_gelu
from ..ops.gelu_gate import gelu_gate
from ..ops.qkv_norm_rope import qkv_norm_rope
from ..ops.residual_rms_norm import residual_rms_norm
from . import linears
from .joined_weights import gemm_weight, group_modules, share_weights
from .mlp import gate_up_epilogue, mlp_block_rows

__all__ = [
    "blocker",
    "may_read_on_host",
    "modeling_of",
    "records_outputs",
    "prepare",
    "run_layers",
]

_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
_LINEARS += ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
_NORMS += ("self_attn.q_norm", "self_attn.k_norm", "self_attn.v_norm")
_ACTIVATION = "gelu_pytorch_tanh"
_CLAMPS_ALIKE = "_fused_vision_clamps_alike"  # the layer's {group: (its bounds' key, alike)}, a plain attribute


def modeling_of(module: nn.Module):
    """The modeling module that defines ``module``'s class (transformers' or SGLang's Gemma 4)."""
    return sys.modules[type(module).__module__]


def _classes(layer: nn.Module) -> dict[str, type]:
    """The stock class each submodule of a fused layer must be exactly (a subclass may compute otherwise)."""
    modeling = modeling_of(layer)
    classes = {name: modeling.Gemma4ClippableLinear for name in _LINEARS}
    classes |= {name: modeling.Gemma4RMSNorm for name in _NORMS}
    return classes | {"self_attn": modeling.Gemma4VisionAttention, "mlp": modeling.Gemma4VisionMLP}


def blocker(layer: nn.Module, hidden_states: torch.Tensor) -> str | None:
    """Why ``layer`` cannot run fused on ``hidden_states``, or None: every module stock's own class, linears
    it can call as stock does (``fused_vision.encoder.linears``), no hooks, the tanh GELU, and no autocast."""
    modeling = modeling_of(layer)
    if type(layer) is not getattr(modeling, "Gemma4VisionEncoderLayer", None):
        return f"it is a {type(layer).__name__}, not transformers' Gemma4VisionEncoderLayer"
    for name, cls in _classes(layer).items():
        module = layer.get_submodule(name)
        if type(module) is not cls:
            return f"{name} is a {type(module).__name__}, not transformers' {cls.__name__}"
    device_type = hidden_states.device.type
    if device_type != "meta" and torch.is_autocast_enabled(device_type):  # stock's GEMMs would run in its dtype
        return "autocast"
    for name, module in layer.named_modules():
        hooks = [*module._forward_hooks.values(), *module._forward_pre_hooks.values()]
        if hasattr(module, "_hf_hook") or any(not _output_capture(hook) for hook in hooks):
            return f"{name or 'the layer'} has forward hooks"
        if records_outputs(module):
            return "this forward records hidden states or attentions"
    if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
        return "global module hooks are registered"
    for name in _LINEARS:  # a linear whose weight the layer cannot read keeps its own call
        reason = linears.unusable(layer.get_submodule(name).linear)
        if reason is not None:
            return f"{name}.linear {reason}"
    if hidden_states.dtype not in FLOAT_DTYPES:
        return f"hidden states of dtype {hidden_states.dtype}"
    if layer.self_attn.head_dim % 4:
        return f"head_dim {layer.self_attn.head_dim} is not a multiple of 4"
    if layer.mlp.config.hidden_activation != _ACTIVATION:
        return f"hidden_activation {layer.mlp.config.hidden_activation!r}, not {_ACTIVATION!r}"
    return None


def _output_capture(hook) -> bool:
    """Whether ``hook`` is one of transformers' output-capturing hooks (5.10+: installed on the layers the
    first time a forward records hidden states or attentions, then kept, idle while no forward records)."""
    named = getattr(hook, "__name__", None) == "output_capturing_hook"
    return named and hasattr(_hook_module(hook), "_active_collector")


def records_outputs(module: nn.Module) -> bool:
    """Whether an output-capturing hook on ``module`` records in this forward."""
    hooks = [*module._forward_hooks.values(), *module._forward_pre_hooks.values()]
    return any(_output_capture(hook) and not _idle(hook) for hook in hooks)


def _hook_module(hook):
    return sys.modules.get(getattr(hook, "__module__", None) or "")


def _idle(hook) -> bool:
    """Whether an output-capturing hook records nothing in this forward."""
    try:
        return not _hook_module(hook)._active_collector.get()
    except LookupError:  # never set in this context: nothing records
        return True


def may_read_on_host(tensor: torch.Tensor) -> bool:
    """Whether reading ``tensor``'s values on the host is allowed: not under torch.compile, nor while a CUDA
    graph is captured or torch's sync debug mode is armed."""
    if torch.compiler.is_compiling():
        return False
    return not tensor.is_cuda or not (torch.cuda.is_current_stream_capturing() or torch.cuda.get_sync_debug_mode())


# ---- the concatenated weights ------------------------------------------------------------------------


def prepare(model: nn.Module) -> None:
    """Concatenate the weights of every layer in ``model`` that can run fused, ahead of the first forward."""
    for module in model.modules():
        if hasattr(module, "self_attn") and hasattr(module, "mlp"):
            weight = getattr(getattr(getattr(module.self_attn, "q_proj", None), "linear", None), "weight", None)
            if isinstance(weight, torch.Tensor) and blocker(module, weight) is None:
                share_weights(module)


# ---- the E2B/E4B clipped linears ---------------------------------------------------------------------


def _input_clamps_alike(layer: nn.Module, group: str, clipped: list[nn.Module]) -> bool:
    """Whether the group's input clamps are all alike, so one GEMM takes one clamped input. The bounds are
    compared on the host once per change of them (a sync on a GPU), not per call; where no read is
    allowed and none is cached, False: one GEMM per projection."""
    if torch.compiler.is_compiling():
        return False
    tensors = [bound for m in clipped for bound in (m.input_min, m.input_max)]
    key = tuple((bound.data_ptr(), bound._version) for bound in tensors)  # in-place writes bump _version
    verdicts = layer.__dict__.setdefault(_CLAMPS_ALIKE, {})
    if group in verdicts and verdicts[group][0] == key:
        return verdicts[group][1]
    if not may_read_on_host(tensors[0]):
        return False
    bounds = torch.stack([torch.stack([m.input_min, m.input_max]) for m in clipped])
    alike = bool((bounds == bounds[0]).all())
    verdicts[group] = (key, alike)
    return alike


def _clamp_table(clipped: list[nn.Module], sides: list[str]) -> torch.Tensor | None:
    """The (rows, 2) fp32 (min, max) table of the ops' ``clamps``: one row per (linear, "input"|"output")."""
    if not clipped[0].use_clipped_linears:
        return None
    rows = [torch.stack([getattr(m, f"{side}_min"), getattr(m, f"{side}_max")]) for m, side in zip(clipped, sides)]
    return torch.stack(rows).float()


def _one_gemm_input(y: torch.Tensor, layer: nn.Module, group: str) -> torch.Tensor | None:
    """y after the group's input clamp where one GEMM computes the group's projections (every weight can be
    read, the clamps alike or absent); None where each projection needs its own."""
    clipped = group_modules(layer, group)
    if not all(linears.reads_weight(m.linear, y) for m in clipped):
        return None
    if not clipped[0].use_clipped_linears:
        return y
    if _input_clamps_alike(layer, group, clipped):
        return torch.clamp(y, clipped[0].input_min, clipped[0].input_max)
    return None


def _project(y: torch.Tensor, layer: nn.Module, group: str) -> torch.Tensor:
    """The group's projections of y side by side, each after its own input clamp: one GEMM where
    ``_one_gemm_input`` allows, one per projection otherwise."""
    if (x := _one_gemm_input(y, layer, group)) is not None:
        return F.linear(x, gemm_weight(layer, group))
    clipped = group_modules(layer, group)
    inputs = (torch.clamp(y, m.input_min, m.input_max) if m.use_clipped_linears else y for m in clipped)
    return torch.cat([linears.project(m.linear, x) for m, x in zip(clipped, inputs)], dim=-1)


def _gated(y: torch.Tensor, layer: nn.Module, clamps, backend) -> torch.Tensor:
    """``gelu_tanh(gate_proj(y)) * up_proj(y)``, the input of down_proj."""
    if gate_up_epilogue() and (x := _one_gemm_input(y, layer, "gate_up")) is not None:
        return gate_up_gelu(x, gemm_weight(layer, "gate_up"), clamps, backend=backend)
    return gelu_gate(_project(y, layer, "gate_up"), clamps, backend=backend)


# ---- the layer and the loop ----------------------------------------------------------------------------


def _fused_layer(layer, h, y, position_ids, inv_freq, attend, next_weight, backend):
    """One fused layer on (T, D) hidden states ``h`` and their input norm ``y``: the new (h, next norm of h)."""
    attn, eps = layer.self_attn, _releases.norm_epsilon(layer.input_layernorm)
    heads, kv_heads = attn.config.num_attention_heads, attn.config.num_key_value_heads
    qkv_clamps = _clamp_table([attn.q_proj, attn.k_proj, attn.v_proj], ["output"] * 3)
    q, k, v = qkv_norm_rope(
        _project(y, layer, "qkv"),
        position_ids,
        attn.q_norm.weight,
        attn.k_norm.weight,
        inv_freq,
        heads,
        kv_heads,
        eps=eps,
        clamps=qkv_clamps,
        backend=backend,
    )
    if kv_heads != heads:  # grouped heads, as transformers' repeat_kv lays them out
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    dropout = attn.attention_dropout if attn.training else 0.0
    attended = attend(q, k, v, scale=attn.scaling, dropout=dropout)
    h, y = residual_rms_norm(
        attn.o_proj(attended.flatten(1)),
        h,
        layer.post_attention_layernorm.weight,
        layer.pre_feedforward_layernorm.weight,
        eps=eps,
        backend=backend,
    )
    post_weight = layer.post_feedforward_layernorm.weight
    return residual_rms_norm(_mlp(layer, y, backend), h, post_weight, next_weight, eps=eps, backend=backend)


def _mlp(layer, y: torch.Tensor, backend) -> torch.Tensor:
    """The MLP on (T, D) ``y``. Where no graph is kept, on blocks of rows whose (rows, 2I) gate/up
    activations hold at most ``MLP_BLOCK_BYTES``: the (T, 2I) and (T, I) transients, the layer's
    largest, shrink to a block's, and each block's output goes straight into the (T, D) result."""
    mlp = layer.mlp
    down = mlp.down_proj
    gelu_clamps = _clamp_table([mlp.gate_proj, mlp.up_proj, down], ["output", "output", "input"])

    def rows_out(rows: torch.Tensor) -> torch.Tensor:
        output = linears.project(down.linear, _gated(rows, layer, gelu_clamps, backend))
        return torch.clamp(output, down.output_min, down.output_max) if down.use_clipped_linears else output

    # from the config: vLLM's and quantized linears name their sizes otherwise, or not at all
    block = mlp_block_rows(layer.self_attn.config.intermediate_size, y.element_size())
    if y.shape[0] <= block or torch.is_grad_enabled() or torch.compiler.is_compiling():
        return rows_out(y)
    output = torch.empty_like(y)  # down maps back to the hidden size
    for start in range(0, y.shape[0], block):
        output[start : start + block] = rows_out(y[start : start + block])
    return output


def _checkpointing(layer: nn.Module) -> bool:
    """Whether transformers checkpoints this layer's calls: its gradient checkpointing on, training, with
    autograd recording."""
    return bool(getattr(layer, "gradient_checkpointing", False)) and layer.training and torch.is_grad_enabled()


def run_layers(encoder: nn.Module, hidden_states, position_ids, attend, shape, stock_kwargs, backend=None):
    """The encoder's layers on (T, D) ``hidden_states`` with (T, 2) ``position_ids``; ``attend(q, k, v, *,
    scale, dropout)`` is their attention on (T, H, d) heads. With ``backend``, each layer that ``blocker``
    lets through runs fused (under gradient checkpointing, through the layer's own checkpoint function,
    so that backward recomputes it fused). The others, and every layer without ``backend``, run their
    stock code on the rows viewed as ``shape`` ((1, T) packed, (B, N) padded), with the rotary
    embedding's cos and sin and the keywords ``stock_kwargs()`` returns (their attention's mask)."""
    layers = list(encoder.layers[: encoder.config.num_hidden_layers])
    if backend is None:  # the packed encoder's layers: stock code, each one
        reasons = ["not fused"] * len(layers)
    else:
        reasons = [blocker(layer, hidden_states) for layer in layers]
        for reason in dict.fromkeys(r for r in reasons if r is not None):
            where = ", ".join(str(i) for i, r in enumerate(reasons) if r == reason)
            warn_once(f"fused encoder: layer(s) {where} run stock code: {reason}", 4)
    rotary, batched_ids = encoder.rotary_emb, position_ids.view(*shape, 2)
    fallback = any(reason is not None for reason in reasons)
    cos_sin = rotary(hidden_states.view(*shape, -1), batched_ids) if fallback else None
    fallback_kwargs = stock_kwargs() if fallback else {}
    inv_freq = rotary.inv_freq.float()  # stock's rotary reads its buffer (cast with the model) as float32
    h, y = hidden_states, None
    for index, (layer, reason) in enumerate(zip(layers, reasons)):
        if reason is not None:
            rows = layer(h.view(*shape, -1), position_embeddings=cos_sin, position_ids=batched_ids, **fallback_kwargs)
            h, y = rows.flatten(0, 1), None
            continue
        if y is None:
            y = layer.input_layernorm(h)
        following = index + 1 < len(layers) and reasons[index + 1] is None
        next_weight = layers[index + 1].input_layernorm.weight if following else None
        fused_call = functools.partial(
            _fused_layer,
            layer,
            position_ids=position_ids,
            inv_freq=inv_freq,
            attend=attend,
            next_weight=next_weight,
            backend=backend,
        )
        h, y = layer._gradient_checkpointing_func(fused_call, h, y) if _checkpointing(layer) else fused_call(h, y)
    return h
