"""fused_vision inside transformers' Gemma 4 vision tower: a one-line patcher and a batched encoder.

    from fused_vision.gemma4 import apply_fused_vision_to_gemma4, encode_images

    apply_fused_vision_to_gemma4()        # the classes: every Gemma 4 tower built from now on, vLLM's included
    apply_fused_vision_to_gemma4(model)   # the instances inside a model that is already loaded

Both transformers families are supported: 5.5-5.9 (one-hot lookup, the pooler returns the hidden dtype)
and 5.10+ (``F.embedding`` lookup, the pooler returns float32 and the tower standardizes in float32). The
family is told from the stock code itself, never from a version string, and each patched module keeps
its family's semantics: the lookup is bit-identical, the pooler equal up to fp32 summation order.

A patched module runs stock code whenever the fused op cannot take its inputs or would round
differently (float64; a quantized or hooked ``input_proj`` or autocast keep the embedder to the fused
lookup alone; the pooler under autocast is stock). The ops are differentiable, so a patched tower
trains with stock's gradients.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import operator
import os
import types
import weakref
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from ._dispatch import BACKENDS
from ._validation import FLOAT_DTYPES, INDEX_DTYPES
from .ops.patch_embed import patch_embed as _fused_patch_embed
from .ops.pool_by_positions import pool_by_positions as _fused_pool_by_positions
from .ops.position_embeddings import position_embeddings as _fused_position_embeddings

__all__ = ["apply_fused_vision_to_gemma4", "revert_fused_vision_gemma4", "encode_images", "vllm_plugin"]

logger = logging.getLogger("fused_vision")


class _Missing:
    """No attribute there before the patch. Pickled by name, so an unpickled module still reverts."""

    def __reduce__(self):
        return "_MISSING"


_MISSING = _Missing()
_STATE = "_fused_vision"  # the _Fused a module (or a patched class) runs with; None pins a module to stock
_SAVED = "_fused_vision_saved"  # on a patched instance: its own attributes before the patch
# On a class with our methods: its stock ones, for the modules that run stock code. Attributes rather
# than a lookup keyed by class, which torch.compile resolves to the wrong class.
_STOCK_SLOTS = {"forward": "_fused_vision_stock_forward", "_position_embeddings": "_fused_vision_stock_lookup"}
_CLASS_ORIGINALS: dict[type, dict[str, object]] = {}  # patched class -> its attributes before the patch
_PATCHED_INSTANCES: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


@dataclasses.dataclass(frozen=True)
class _Fused:
    op: str  # "patch_embed", "position_embeddings" or "pool_by_positions"
    backend: str
    # The release family, told once at patch time so that forwards (and torch.compile) see constants.
    onehot_lookup: bool = dataclasses.field(default=False, compare=False)
    pooler_float32: bool = dataclasses.field(default=True, compare=False)

    def __str__(self) -> str:
        return f"{self.op}(backend={self.backend})"


# ---- transformers, located lazily ----------------------------------------------------------------


def _modeling():
    """``transformers.models.gemma4.modeling_gemma4``, with a clear error when it is missing."""
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(
            "fused_vision.gemma4 needs transformers>=5.5 with Gemma 4: pip install 'fused-vision[gemma4]'"
        ) from exc
    try:
        modeling_gemma4 = importlib.import_module("transformers.models.gemma4.modeling_gemma4")
    except ImportError as exc:
        raise ImportError(
            f"transformers {getattr(transformers, '__version__', '?')} has no Gemma 4 "
            "(transformers.models.gemma4.modeling_gemma4); Gemma 4 arrived in transformers 5.5"
        ) from exc
    return modeling_gemma4


def _stock_attr(cls: type, name: str):
    """``cls.__dict__[name]`` as transformers defined it, even while the class is patched."""
    saved = _CLASS_ORIGINALS.get(cls)
    if saved is not None and name in saved:
        return saved[name]
    return cls.__dict__.get(name, _MISSING)


def _stock(kind: str, name: str):
    modeling = _modeling()
    cls = modeling.Gemma4VisionPatchEmbedder if kind == "embedder" else modeling.Gemma4VisionPooler
    return _stock_attr(cls, name)


@functools.cache
def _pooler_returns_float32() -> bool:
    """Whether the stock pooler returns float32 (5.10+) rather than the hidden dtype (5.5-5.9).

    Told by running the stock forward once on a 1-element bfloat16 input, on the CPU.
    """
    modeling = _modeling()
    pooler = modeling.Gemma4VisionPooler(modeling.Gemma4VisionConfig(hidden_size=4))
    hidden = torch.ones(1, 1, 4, dtype=torch.bfloat16)
    ids = torch.zeros(1, 1, 2, dtype=torch.long)
    padding = torch.zeros(1, 1, dtype=torch.bool)
    with torch.no_grad():
        pooled, _ = _stock("pooler", "forward")(pooler, hidden, ids, padding, 1)
    return pooled.dtype == torch.float32


def _lookup_is_onehot(embedder_cls: type) -> bool:
    """Whether the class's stock lookup is the one-hot matmul of 5.5-5.9 (else the F.embedding of 5.10+)."""
    lookup = _stock_attr(embedder_cls, "_position_embeddings")
    return lookup is not _MISSING and "one_hot" in lookup.__code__.co_names


@functools.cache
def _onehot_lookup() -> bool:
    """Whether transformers' stock lookup is the one-hot matmul of 5.5-5.9."""
    return _lookup_is_onehot(_modeling().Gemma4VisionPatchEmbedder)


# ---- the patched methods ---------------------------------------------------------------------------


def _stock_method(module: nn.Module, name: str):
    """The module's stock method ``name``, bound: kept on its class while ours is installed there, else the
    class's own (a forward of ours saved before a revert, e.g. in accelerate's ``_old_forward``, still works)."""
    stock = getattr(module, _STOCK_SLOTS[name], None)
    return stock if stock is not None else types.MethodType(getattr(type(module), name), module)


def _plain_linear(linear: nn.Module) -> bool:
    """An ``nn.Linear`` whose weight the fused embedder may read directly (no bias, hooks or quantization)."""
    if not isinstance(linear, nn.Linear) or linear.bias is not None:
        return False
    if linear._forward_hooks or linear._forward_pre_hooks or hasattr(linear, "_hf_hook"):
        return False
    weight = linear.weight
    return type(weight) in (torch.Tensor, nn.Parameter) and weight.dtype in FLOAT_DTYPES


def _autocast_enabled(device_type: str) -> bool:
    """``torch.is_autocast_enabled``, False on the meta device, where it raises. (Not through
    ``torch.amp.is_autocast_available``: torch 2.11's dynamo breaks the graph on it.)"""
    return device_type != "meta" and torch.is_autocast_enabled(device_type)


def _lookup_runs_stock(embedder: nn.Module, pixel_position_ids) -> bool:
    """Whether the embedder's lookup runs stock code: it is not patched, or a dtype is one the fused op
    does not take (a float64 table, say)."""
    return (
        getattr(embedder, _STATE, None) is None
        or embedder.position_embedding_table.dtype not in FLOAT_DTYPES
        or not isinstance(pixel_position_ids, torch.Tensor)
        or pixel_position_ids.dtype not in INDEX_DTYPES
    )


def _embedder_runs_stock(embedder: nn.Module, pixel_values, pixel_position_ids) -> bool:
    """Whether the embedder hands these inputs to its stock forward: its lookup does, or the pixels are of a
    dtype the fused ops do not take (float64, say)."""
    return (
        _lookup_runs_stock(embedder, pixel_position_ids)
        or not isinstance(pixel_values, torch.Tensor)
        or pixel_values.dtype not in FLOAT_DTYPES
    )


def _lookup_table(embedder: nn.Module, fused: _Fused) -> torch.Tensor:
    """The position table in the dtype whose rows the stock lookup returns."""
    table = embedder.position_embedding_table
    device_type = table.device.type
    if fused.onehot_lookup and _autocast_enabled(device_type):
        # 5.5-5.9's one-hot matmul runs in the autocast dtype: its rows come out rounded to it
        table = table.to(torch.get_autocast_dtype(device_type))
    return table


def _embedder_position_embeddings(self, pixel_position_ids, padding_positions, *args, **kwargs):
    """``Gemma4VisionPatchEmbedder._position_embeddings`` as ``fused_vision.position_embeddings``, bit-identical.

    Our forward never calls it; vLLM 0.34+ does: its ``_embed_patches`` inlines the embedder's forward
    around its own ``input_proj`` and asks the module for the lookup alone.
    """
    if args or kwargs or _lookup_runs_stock(self, pixel_position_ids):
        return _stock_method(self, "_position_embeddings")(pixel_position_ids, padding_positions, *args, **kwargs)
    fused = getattr(self, _STATE)
    return _fused_position_embeddings(
        _lookup_table(self, fused), pixel_position_ids, padding_positions, backend=fused.backend
    )


def _embedder_forward(self, pixel_values, pixel_position_ids, padding_positions=None, *args, **kwargs):
    """``Gemma4VisionPatchEmbedder.forward`` with the fused patch embedder, or the fused lookup alone."""
    # args, kwargs: arguments of a newer stock signature; let stock handle them
    if args or kwargs or _embedder_runs_stock(self, pixel_values, pixel_position_ids):
        return _stock_method(self, "forward")(pixel_values, pixel_position_ids, padding_positions, *args, **kwargs)

    fused, table, weight = getattr(self, _STATE), self.position_embedding_table, self.input_proj.weight
    if (
        fused.op == "patch_embed"
        and _plain_linear(self.input_proj)
        and weight.dtype == table.dtype
        and not _autocast_enabled(pixel_values.device.type)
    ):
        return _fused_patch_embed(
            pixel_values, weight, table, pixel_position_ids, padding_positions, backend=fused.backend
        )

    # The lookup alone, fused with the residual add; the projection stays the module's own.
    pixel_values = 2 * (pixel_values - 0.5)
    if weight.dtype.is_floating_point:
        pixel_values = pixel_values.to(weight.dtype)
    hidden_states = self.input_proj(pixel_values)
    table, backend = _lookup_table(self, fused), fused.backend
    if hidden_states.dtype == table.dtype:
        return _fused_position_embeddings(
            table, pixel_position_ids, padding_positions, residual=hidden_states, backend=backend
        )
    # e.g. autocast: keep stock's type promotion of `hidden_states + position_embeddings`
    return hidden_states + _fused_position_embeddings(table, pixel_position_ids, padding_positions, backend=backend)


def _pooler_runs_fused(pooler: nn.Module, hidden_states, pixel_position_ids, padding_positions, output_length) -> bool:
    """Whether the pooler is patched and ``pool_by_positions`` takes these inputs as stock reads them; else
    stock runs, and raises its own errors."""
    return (
        getattr(pooler, _STATE, None) is not None
        and not isinstance(output_length, bool)
        and isinstance(output_length, int)
        and isinstance(hidden_states, torch.Tensor)
        and hidden_states.dim() == 3
        and hidden_states.dtype in FLOAT_DTYPES
        and hidden_states.shape[-1] == pooler.hidden_size
        and 1 <= output_length <= hidden_states.shape[1]
        and isinstance(pixel_position_ids, torch.Tensor)
        and pixel_position_ids.dtype in INDEX_DTYPES
        and isinstance(padding_positions, torch.Tensor)
        and padding_positions.dtype == torch.bool
        and not _autocast_enabled(hidden_states.device.type)  # stock's matmul would run in low precision
    )


def _pooler_forward(self, hidden_states, pixel_position_ids, padding_positions, output_length=None, *args, **kwargs):
    """``Gemma4VisionPooler.forward`` through ``fused_vision.pool_by_positions``, in the release's dtype."""
    inputs = (hidden_states, pixel_position_ids, padding_positions, output_length)
    if args or kwargs or not _pooler_runs_fused(self, *inputs):
        return _stock_method(self, "forward")(*inputs, *args, **kwargs)
    fused = getattr(self, _STATE)
    pooled, mask = _fused_pool_by_positions(*inputs, backend=fused.backend)
    if not fused.pooler_float32:
        pooled = pooled.to(hidden_states.dtype)  # 5.5-5.9 scale in the hidden dtype: the same rounding
    return pooled, mask


def _extra_repr(self) -> str:
    cls = next(base for base in type(self).__mro__ if base in _CLASS_ORIGINALS)  # the class we patched
    stock = _stock_attr(cls, "extra_repr")
    text = stock(self) if stock is not _MISSING else super(cls, self).extra_repr()
    fused = getattr(self, _STATE, None)
    if fused is None:
        return text
    return f"{text}, fused_vision={fused}" if text else f"fused_vision={fused}"


# ---- patching and reverting ---------------------------------------------------------------------


def _set_class_attributes(cls: type, values: dict[str, object]) -> None:
    saved = _CLASS_ORIGINALS.setdefault(cls, {})
    for name, value in values.items():
        if name not in saved:
            saved[name] = cls.__dict__.get(name, _MISSING)
        setattr(cls, name, value)


def _install_methods(cls: type, methods: dict) -> None:
    """The class's repr and ``methods`` (name -> ours; each one the class defines) become ours; they run
    stock code for every instance whose state (its own, else the class's) is None, so other instances see
    no change."""
    values = {"extra_repr": _extra_repr}
    for name, method in methods.items():
        stock = _stock_attr(cls, name)
        if stock is not _MISSING:
            values |= {name: method, _STOCK_SLOTS[name]: stock}
    _set_class_attributes(cls, values)


def _patch_class(cls: type, methods: dict, fused: _Fused) -> None:
    _install_methods(cls, methods)
    _set_class_attributes(cls, {_STATE: fused})


def _revert_class(cls: type) -> bool:
    """Restore the class; True when it had a patch of its own (not only the forward an instance patch
    installed)."""
    saved = _CLASS_ORIGINALS.pop(cls, None)
    if saved is None:
        return False
    for name, value in saved.items():
        if value is _MISSING:
            if name in cls.__dict__:
                delattr(cls, name)
        else:
            setattr(cls, name, value)
    return _STATE in saved


def _forward_slot(module: nn.Module) -> str:
    """Where the module's forward lives: accelerate's hooks keep the real one in ``_old_forward``."""
    return "_old_forward" if hasattr(module, "_hf_hook") and "_old_forward" in module.__dict__ else "forward"


def _patch_instance(module: nn.Module, cls: type, methods: dict, fused: _Fused) -> None:
    """The module's own state, read by its class's methods (installed here if the class is stock): the
    instance holds no bound method of ours, so it pickles, deep-copies and replicates (DataParallel) as
    any module. Only where accelerate's hook already holds the stock forward in ``_old_forward`` does
    the module get a bound forward of ours there."""
    _install_methods(cls, methods)
    attrs = module.__dict__
    if _SAVED not in attrs:
        names = (_STATE, "_old_forward") if _forward_slot(module) == "_old_forward" else (_STATE,)
        attrs[_SAVED] = {name: attrs.get(name, _MISSING) for name in names}
    if "_old_forward" in attrs[_SAVED]:
        attrs["_old_forward"] = types.MethodType(methods["forward"], module)
    attrs[_STATE] = fused
    _PATCHED_INSTANCES.add(module)


def _revert_instance(module: nn.Module, *, pin: bool) -> bool:
    """Undo the module's own patch; True when it was running a fused op (its own or its class's).

    ``pin``: while the class is patched, pin the module to stock code (``_fused_vision = None``);
    without it, also drop such a pin (the global reset). A module keeping a state or a pin stays
    tracked, so that the global reset reaches it.
    """
    attrs = module.__dict__
    was_fused = getattr(module, _STATE, None) is not None
    saved = attrs.pop(_SAVED, None)
    if saved is not None:
        for name, value in saved.items():
            if value is _MISSING:
                attrs.pop(name, None)
            else:
                attrs[name] = value
    if pin and getattr(module, _STATE, None) is not None:
        attrs[_STATE] = None
    elif not pin and attrs.get(_STATE, _MISSING) is None:
        del attrs[_STATE]
    (_PATCHED_INSTANCES.add if _STATE in attrs else _PATCHED_INSTANCES.discard)(module)
    return was_fused


def _apply(
    caller: str,
    model: nn.Module | None,
    embedder_cls: type,
    poolers: Sequence[tuple[type, object]],
    release: dict,
    hint: str,
    *,
    patch_embedder: bool,
    position_embeddings: bool,
    pooler: bool,
    backend: str,
) -> int:
    """The body of an ``apply_…`` call: patch a tower's embedder class (its forward and its lookup) and its
    pooler classes (each with its forward: ``poolers`` pairs) with the ops the keywords select, or with
    ``model`` their instances inside it. Returns the number of classes or modules set to a fused op."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    embedder_op = "patch_embed" if patch_embedder else "position_embeddings" if position_embeddings else None
    if embedder_op is None and not pooler:
        raise ValueError(f"{caller}: nothing selected (patch_embedder, position_embeddings and pooler are all False)")
    embedder_methods = {"forward": _embedder_forward, "_position_embeddings": _embedder_position_embeddings}
    targets = [(embedder_cls, embedder_op, embedder_methods)] if embedder_op else []
    if pooler:
        targets += [(cls, "pool_by_positions", {"forward": forward}) for cls, forward in poolers]
    if model is None:
        for cls, op, methods in targets:
            _patch_class(cls, methods, _Fused(op, backend, **release))
        logger.info("fused_vision: patched %s", ", ".join(f"{cls.__name__} -> {op}" for cls, op, _ in targets))
        return len(targets)

    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module or None, got {type(model).__name__}")
    matches = [
        (module, cls, op, methods)
        for module in model.modules()
        for cls, op, methods in targets
        if isinstance(module, cls)
    ]
    if not matches:
        *others, last = [cls.__name__ for cls, _, _ in targets]
        wanted = f"{', '.join(others)} or {last}" if others else last
        raise ValueError(f"{caller}: {type(model).__name__} contains no {wanted}, so there is nothing to fuse. {hint}")
    for module, cls, op, methods in matches:
        _patch_instance(module, cls, methods, _Fused(op, backend, **release))
    logger.info("fused_vision: patched %d module(s) of %s", len(matches), type(model).__name__)
    return len(matches)


def apply_fused_vision_to_gemma4(
    model: nn.Module | None = None,
    *,
    position_embeddings: bool = True,
    patch_embedder: bool = True,
    pooler: bool = True,
    backend: str = "auto",
) -> int:
    """Put fused_vision's ops into transformers' Gemma 4 vision tower.

    Args:
        model: None to patch transformers' classes (``Gemma4VisionPatchEmbedder``, ``Gemma4VisionPooler``):
            every instance without a patch of its own uses the fused ops from then on, including towers
            built later by ``from_pretrained`` or by vLLM's ``AutoModel.from_config``. Or a module
            (``Gemma4ForConditionalGeneration``, ``Gemma4Model``, ``Gemma4VisionModel``, or anything
            containing those two classes, such as ``EmbeddingGemma2Model`` and DiffusionGemma's models,
            which build the same tower) whose instances to patch, whether the class is patched or not.
            SGLang builds a tower of its own: ``fused_vision.sglang.apply_fused_vision_to_sglang_gemma4``.
        patch_embedder: the whole patch embedder as ``fused_vision.patch_embed`` (prescale, projection,
            lookup and add in one kernel). Where that cannot run (a quantized or hooked ``input_proj``,
            autocast) the module falls back to the lookup alone.
        position_embeddings: when ``patch_embedder`` is False, swap only the lookup inside the stock
            embedder (``fused_vision.position_embeddings``, fused with the residual add); the projection
            stays the module's own. Ignored when ``patch_embedder`` is True, which includes it. Either
            also makes the embedder's ``_position_embeddings`` method the fused lookup, bit-identical:
            vLLM 0.34+ runs its own projection and calls that method alone.
        pooler: the pooler as ``fused_vision.pool_by_positions``.
        backend: "auto", "triton" or "reference", for every patched op.

    Returns:
        The number of modules (with ``model``) or classes (without) this call set to a fused op. Calling
        again with the same arguments changes nothing and returns the same number; calling with other
        arguments reconfigures the selected modules and leaves the unselected ones as they were.

    Raises:
        ValueError: nothing selected, an unknown backend, or ``model`` holds no module to patch (e.g.
            ``gemma4_unified`` checkpoints, which have no vision tower).
        ImportError: transformers or its Gemma 4 is missing.
    """
    modeling = _modeling()
    poolers = [(modeling.Gemma4VisionPooler, _pooler_forward)]
    release = dict(onehot_lookup=_onehot_lookup(), pooler_float32=_pooler_returns_float32())
    hint = (
        "Pass a Gemma4ForConditionalGeneration, Gemma4Model or Gemma4VisionModel (gemma4_unified checkpoints "
        "have no vision tower), or call it with model=None before the model is built."
    )
    if isinstance(model, nn.Module) and any(type(m).__module__.startswith("sglang.") for m in model.modules()):
        hint = "It is an SGLang model, whose tower is SGLang's own: use apply_fused_vision_to_sglang_gemma4."
    return _apply(
        "apply_fused_vision_to_gemma4", model, modeling.Gemma4VisionPatchEmbedder, poolers, release, hint,
        patch_embedder=patch_embedder, position_embeddings=position_embeddings, pooler=pooler, backend=backend,
    )


def revert_fused_vision_gemma4(model: nn.Module | None = None) -> int:
    """Undo ``apply_fused_vision_to_gemma4`` (and ``fused_vision.sglang.apply_fused_vision_to_sglang_gemma4``).

    With ``model=None``: restore every patched class (transformers', SGLang's) and every instance
    patched (or pinned) with ``model=``, so all of Gemma 4 runs stock code again; returns the number of
    classes and instance patches undone. With a model: its modules run stock code, even while the
    classes stay patched; returns the number of its modules that were running a fused op.
    """
    if model is None:
        classes = sum(_revert_class(cls) for cls in list(_CLASS_ORIGINALS))
        modules = sum(_revert_instance(module, pin=False) for module in list(_PATCHED_INSTANCES))
        return classes + modules
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module or None, got {type(model).__name__}")
    patched = tuple(_CLASS_ORIGINALS)  # every class a patch of ours has touched, SGLang's included
    return sum(_revert_instance(module, pin=True) for module in model.modules() if isinstance(module, patched))


ENV_VLLM = "FUSED_VISION_VLLM"


def vllm_plugin() -> None:
    """vLLM's general-plugin hook (entry point group ``vllm.general_plugins``), which vLLM runs in every
    process it starts, its model workers included, where a class patch made in the launching script
    does not reach. Opt-in: patches transformers' Gemma 4 classes only when FUSED_VISION_VLLM=1."""
    if os.environ.get(ENV_VLLM) != "1":
        return
    try:
        apply_fused_vision_to_gemma4()
    except ImportError as exc:  # vLLM runs its plugins unguarded: a raise here would stop every process
        logger.warning("fused_vision: %s=1 but Gemma 4 cannot be patched here (%s)", ENV_VLLM, exc)


# ---- the batched encoder --------------------------------------------------------------------------


_TOWER_SUBMODULES = ("patch_embedder", "encoder", "pooler")
# Where the tower sits in the models that build one (Gemma4ForConditionalGeneration, Gemma4Model,
# EmbeddingGemma2Model, DiffusionGemma's models): looked up before walking every module of the LLM.
_TOWER_PATHS = ("vision_tower", "model.vision_tower", "encoder.vision_tower", "model.encoder.vision_tower")


def _is_tower(module) -> bool:
    return (
        isinstance(module, nn.Module)
        and all(name in module._modules for name in _TOWER_SUBMODULES)
        and hasattr(module, "config")
    )


def _resolve_tower(model: nn.Module) -> nn.Module:
    """The Gemma4VisionModel itself, or the first one inside ``model``."""
    if _is_tower(model):
        return model
    for path in _TOWER_PATHS:
        candidate = functools.reduce(lambda module, name: getattr(module, name, None), path.split("."), model)
        if _is_tower(candidate):
            return candidate
    if isinstance(model, nn.Module):
        tower = next((module for module in model.modules() if _is_tower(module)), None)
        if tower is not None:
            return tower
    raise TypeError(
        f"vision_tower: expected a Gemma4VisionModel (with patch_embedder, encoder, pooler and config) "
        f"or a model containing one, got {type(model).__name__}"
    )


def _items(pixel_values, pixel_position_ids) -> tuple[list[torch.Tensor], list[torch.Tensor], bool]:
    """Per-item (N_i, K) pixels and (N_i, 2) ids, and whether the input was one stacked tensor."""
    stacked = isinstance(pixel_values, torch.Tensor)
    if stacked:
        if not isinstance(pixel_position_ids, torch.Tensor):
            raise TypeError("pixel_position_ids: expected a tensor like pixel_values")
        if pixel_values.dim() != 3 or pixel_position_ids.dim() != 3:
            raise ValueError(
                f"pixel_values (B, N, K) and pixel_position_ids (B, N, 2) expected, got shapes "
                f"{tuple(pixel_values.shape)} and {tuple(pixel_position_ids.shape)}"
            )
    elif not isinstance(pixel_values, Sequence) or not isinstance(pixel_position_ids, Sequence):
        raise TypeError("pixel_values, pixel_position_ids: expected two tensors or two lists of per-item tensors")
    if len(pixel_position_ids) != len(pixel_values):  # zip would drop the extra items silently
        raise ValueError(
            f"pixel_position_ids: expected {len(pixel_values)} items like pixel_values, got {len(pixel_position_ids)}"
        )
    pixels, ids = [], []
    for i, (p, q) in enumerate(zip(pixel_values, pixel_position_ids)):
        if not isinstance(p, torch.Tensor) or not isinstance(q, torch.Tensor):
            raise TypeError(
                f"pixel_values, pixel_position_ids: item {i} is {type(p).__name__} and {type(q).__name__}, "
                "expected tensors"
            )
        p, q = (t[0] if t.dim() == 3 and t.shape[0] == 1 else t for t in (p, q))  # a listed item's batch of one
        if p.dim() != 2 or q.dim() != 2 or q.shape[-1] != 2 or p.shape[0] != q.shape[0] or p.shape[0] == 0:
            raise ValueError(
                f"item {i}: expected pixels (N, K) and position ids (N, 2) with the same N >= 1, got "
                f"{tuple(p.shape)} and {tuple(q.shape)}"
            )
        if q.dtype not in (torch.int32, torch.int64):  # the fused ops' (5.5-5.9's one-hot takes only int64)
            raise TypeError(f"pixel_position_ids: item {i}: expected dtype int32 or int64, got {q.dtype}")
        if pixels and p.shape[1] != pixels[0].shape[1]:  # one tower, one patch size: items of a bucket are stacked
            raise ValueError(f"pixel_values: item {i}: expected {pixels[0].shape[1]} features like item 0, got {p.shape[1]}")
        pixels.append(p)
        ids.append(q)
    return pixels, ids, stacked


def _planner_path(tower: nn.Module, items: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> str:
    """The planner's path for ``tower`` on ``items``, (pixels, position ids) pairs: "onehot" where a 5.5-5.9
    embedder runs its stock one-hot lookup on any of them (unpatched, or given a dtype the fused ops do
    not take: one float64 item makes a stacked chunk float64), "fused" otherwise."""
    if not _onehot_lookup():
        return "fused"
    embedder = tower.patch_embedder
    return "onehot" if any(_embedder_runs_stock(embedder, p, i) for p, i in items) else "fused"


def _plan_chunk(
    num_items: int,
    patches_per_item: int,
    tower: nn.Module,
    path: str,
    device: torch.device,
    dtype: torch.dtype,
    input_bytes_per_item: int,
) -> int:
    """Items per encoder call, from ``fused_vision.planner`` (looked up at call time)."""
    from . import planner

    options = {}
    attention = getattr(tower.config, "_attn_implementation", None)
    if isinstance(attention, str):
        # The planner prices sdpa and eager. transformers' paged variants compute as their base kernels
        # do (paged eager holds eager's (N, N) scores); the flash-style kernels hold none: priced as sdpa.
        attention = attention.removeprefix("paged|")
        options["attn_implementation"] = attention if attention in planner.ATTENTION_IMPLEMENTATIONS else "sdpa"
    return planner.plan(
        num_items,
        patches_per_item,
        tower.config,
        path=path,
        device=device,
        dtype=dtype,
        extra_bytes_per_item=input_bytes_per_item,
        **options,
    )


def _encode_chunk(tower: nn.Module, pixel_values: torch.Tensor, position_ids: torch.Tensor) -> list[torch.Tensor]:
    """``Gemma4VisionModel.forward`` on one chunk, with the padding stripped per item instead of flattened."""
    k = tower.config.pooling_kernel_size
    output_length = pixel_values.shape[-2] // (k * k)
    padding = (position_ids == -1).all(dim=-1)
    inputs_embeds = tower.patch_embedder(pixel_values, position_ids, padding)
    hidden_states = tower.encoder(
        inputs_embeds=inputs_embeds, attention_mask=~padding, pixel_position_ids=position_ids
    ).last_hidden_state
    pooled, mask = tower.pooler(
        hidden_states=hidden_states,
        pixel_position_ids=position_ids,
        padding_positions=padding,
        output_length=output_length,
    )
    tokens = pooled[mask]
    if _pooler_returns_float32():  # 5.10+: standardize in float32, then back to the working dtype
        if tower.config.standardize:
            tokens = (tokens - tower.std_bias.float()) * tower.std_scale.float()
        tokens = tokens.to(inputs_embeds.dtype)
    elif tower.config.standardize:  # 5.5-5.9: in the pooled dtype
        tokens = (tokens - tower.std_bias) * tower.std_scale
    return list(torch.split(tokens, mask.sum(dim=1).tolist()))


def encode_images(
    vision_tower: nn.Module,
    pixel_values: torch.Tensor | Sequence[torch.Tensor],
    pixel_position_ids: torch.Tensor | Sequence[torch.Tensor],
    *,
    max_batch: int | None = None,
) -> list[torch.Tensor]:
    """Encode many images (or video frames) in memory-safe batches, as vLLM does; one tensor per item.

    Items are bucketed by patch count; each bucket runs in chunks of ``fused_vision.planner.plan(...)``
    items (at most ``max_batch``) through the tower's own patch embedder, encoder and pooler, so a
    patched and a stock tower both work. Each item's pooled tokens are stripped of padding and
    standardized as the release's ``Gemma4VisionModel.forward`` does.

    Args:
        vision_tower: a ``Gemma4VisionModel``, or a model that contains one (``Gemma4Model``,
            ``Gemma4ForConditionalGeneration``, ``EmbeddingGemma2Model``, DiffusionGemma's models, ...).
        pixel_values: (B, N, K) as the image processor returns it, or a list of (N_i, K) / (1, N_i, K).
        pixel_position_ids: (B, N, 2) int32 or int64 (int64 where a 5.5-5.9 tower runs its stock one-hot),
            or a list of (N_i, 2) / (1, N_i, 2); (-1, -1) marks padding.
        max_batch: cap on the items per encoder call.

    Returns:
        A list of (T_i, D) soft tokens in the input order, equal (within floating-point tolerance) to
        running the tower on each item alone. Inputs are moved to the tower's device. Inference only:
        it runs without autograd, whose saved activations the planner's chunks do not budget for.
    """
    with torch.no_grad():
        return _encode_images(_resolve_tower(vision_tower), pixel_values, pixel_position_ids, max_batch)


def _max_batch(value) -> int | None:
    """``max_batch`` as an int (numpy integers too), or None."""
    if value is None:
        return None
    try:
        count = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        count = None
    if count is None or count < 1:
        raise ValueError(f"max_batch: expected a positive int or None, got {value!r}")
    return count


def _encode_images(tower, pixel_values, pixel_position_ids, max_batch) -> list[torch.Tensor]:
    max_batch = _max_batch(max_batch)
    pixels, ids, stacked = _items(pixel_values, pixel_position_ids)
    table = tower.patch_embedder.position_embedding_table
    device, dtype = table.device, table.dtype

    buckets: dict[int, list[int]] = {}
    for index, item in enumerate(pixels):
        buckets.setdefault(item.shape[0], []).append(index)
    outputs: list[torch.Tensor | None] = [None] * len(pixels)
    # Each chunk's inputs are copied (stacked, or moved to the device) unless they are slices of one
    # stacked tensor already there: the copy is the chunk's too.
    copies_inputs = not (stacked and pixel_values.device == device)
    for patches, indices in buckets.items():
        first = indices[0]
        input_bytes = patches * (pixels[first][0].nbytes + ids[first][0].nbytes) if copies_inputs else 0
        path = _planner_path(tower, [(pixels[i], ids[i]) for i in indices])
        not_int64 = [i for i in indices if ids[i].dtype != torch.int64] if path == "onehot" else []
        if not_int64:
            raise TypeError(
                f"pixel_position_ids: item {not_int64[0]}: the tower runs transformers 5.5-5.9's stock one-hot "
                "lookup, which takes int64 ids only"
            )
        chunk = int(_plan_chunk(len(indices), patches, tower, path, device, dtype, input_bytes))
        if max_batch is not None:
            chunk = min(chunk, max_batch)
        chunk = max(1, min(chunk, len(indices)))
        for start in range(0, len(indices), chunk):
            selected = indices[start : start + chunk]
            if stacked:  # one bucket holding every item in order: slice, do not copy
                chunk_pixels = pixel_values[selected[0] : selected[-1] + 1]
                chunk_ids = pixel_position_ids[selected[0] : selected[-1] + 1]
            else:
                chunk_pixels = torch.stack([pixels[i] for i in selected])
                chunk_ids = torch.stack([ids[i] for i in selected])
            encoded = _encode_chunk(tower, chunk_pixels.to(device), chunk_ids.to(device))
            for index, tokens in zip(selected, encoded):
                outputs[index] = tokens
    return outputs  # type: ignore[return-value]
