"""Swap methods of model classes, or of single modules, for fused ones, and undo it.

Model-agnostic: an integration (``fused_vision.integrations.transformers``, ``.sglang``) names the classes,
the methods it replaces and the state those methods read; this module installs and removes them.

A patched class holds our methods and, beside each, its stock one. Our methods read a state from the
module (its own, else its class's): a state runs the fused op, ``None`` runs the stock method, so an
instance can be patched while its class is stock, or pinned to stock while its class is patched. An
instance holds no bound method of ours, so it pickles, deep-copies and replicates (``nn.DataParallel``)
as any module; unpickled in a fresh process, it runs stock code until patched there.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import types
import weakref
from collections.abc import Callable, Sequence

from torch import nn

__all__ = [
    "MISSING",
    "InstanceMethod",
    "Target",
    "call_view",
    "check_model",
    "fused_state",
    "install_methods",
    "patch",
    "revert",
    "stock_attribute",
    "stock_method",
]

logger = logging.getLogger("fused_vision")


class _Missing:
    """No attribute there before the patch. Pickled by name, so an unpickled module still reverts."""

    def __reduce__(self):
        return "MISSING"


MISSING = _Missing()
_STATE = "_fused_vision"  # the state a module (or a patched class) runs with; None pins a module to stock
_SAVED = "_fused_vision_saved"  # on a patched instance: its own attributes before the patch
_CLASS_ORIGINALS: dict[type, dict[str, object]] = {}  # patched class -> its attributes before the patch
_PATCHED_INSTANCES: weakref.WeakSet[nn.Module] = weakref.WeakSet()


@dataclasses.dataclass(frozen=True)
class Target:
    """A class to patch: ``methods`` maps a method name (one the class defines) to ours, a function or an
    ``InstanceMethod``; ``state`` is what they read from the module, shown in its repr."""

    cls: type
    methods: dict[str, Callable]
    state: object


@dataclasses.dataclass(frozen=True)
class InstanceMethod:
    """A method of ours that only calls through an instance reach. Looked up on the class itself, it is the
    class's stock attribute: a staticmethod called as ``cls.name(...)`` (a library's own tests) or copied
    from the class into another (``Other.name = cls.name``) stays stock."""

    function: Callable
    stock: object = MISSING  # the class's attribute before the patch, set when installed

    def __get__(self, instance, owner=None):
        if instance is None:
            return self.stock.__get__(None, owner)
        return types.MethodType(self.function, instance)


def _stock_slot(name: str) -> str:
    """Where a patched class keeps its stock method ``name``: an attribute rather than a lookup keyed by
    class, which torch.compile resolves to the wrong class."""
    return f"_fused_vision_stock_{name.lstrip('_')}"


def fused_state(module: nn.Module):
    """The state the module runs with (its own, else its class's), or None for stock code."""
    return getattr(module, _STATE, None)


def stock_attribute(cls: type, name: str):
    """``cls.__dict__[name]`` as its library defined it, even while the class is patched; else MISSING."""
    saved = _CLASS_ORIGINALS.get(cls)
    if saved is not None and name in saved:
        return saved[name]
    return cls.__dict__.get(name, MISSING)


def stock_method(module: nn.Module, name: str):
    """The module's stock method ``name``, bound: kept on its class while ours is installed there, else the
    class's own (a forward of ours saved before a revert, e.g. in accelerate's ``_old_forward``, still works)."""
    stock = getattr(module, _stock_slot(name), None)
    if stock is not None:
        return stock
    # Bound as the class binds it (a staticmethod takes no self), skipping any attribute of the instance's own.
    return inspect.getattr_static(type(module), name).__get__(module, type(module))


def call_view(module: nn.Module, **attributes) -> nn.Module:
    """A view of ``module`` for one call: an instance of its class sharing its submodules, parameters,
    buffers and hooks, that reads ``attributes`` in place of its own. The module itself, and every other
    call of it, sees nothing change."""
    view = object.__new__(type(module))
    view.__dict__.update(module.__dict__, **attributes)
    return view


def _extra_repr(self) -> str:
    cls = next(base for base in type(self).__mro__ if base in _CLASS_ORIGINALS)  # the class we patched
    stock = stock_attribute(cls, "extra_repr")
    text = stock(self) if stock is not MISSING else super(cls, self).extra_repr()
    state = fused_state(self)
    if state is None:
        return text
    return f"{text}, fused_vision={state}" if text else f"fused_vision={state}"


def _set_class_attributes(cls: type, values: dict[str, object]) -> None:
    saved = _CLASS_ORIGINALS.setdefault(cls, {})
    for name, value in values.items():
        if name not in saved:
            saved[name] = cls.__dict__.get(name, MISSING)
        setattr(cls, name, value)


def install_methods(cls: type, methods: dict[str, Callable]) -> None:
    """The class's repr and ``methods`` become ours, each one the class defines; they run stock code for
    every instance whose state is None, so other instances see no change. A revert of the class's
    library restores them."""
    values: dict[str, object] = {"extra_repr": _extra_repr}
    for name, method in methods.items():
        stock = stock_attribute(cls, name)
        if stock is not MISSING:
            if isinstance(method, InstanceMethod):
                method = dataclasses.replace(method, stock=stock)
            values |= {name: method, _stock_slot(name): stock}
    _set_class_attributes(cls, values)


def _revert_class(cls: type) -> bool:
    """Restore the class; True when it had a patch of its own (not only the methods an instance patch
    installed)."""
    saved = _CLASS_ORIGINALS.pop(cls, None)
    if saved is None:
        return False
    for name, value in saved.items():
        if value is MISSING:
            if name in cls.__dict__:
                delattr(cls, name)
        else:
            setattr(cls, name, value)
    return _STATE in saved


def _forward_slot(module: nn.Module) -> str:
    """Where the module's forward lives: accelerate's hooks keep the real one in ``_old_forward``."""
    return "_old_forward" if hasattr(module, "_hf_hook") and "_old_forward" in module.__dict__ else "forward"


def _patch_instance(module: nn.Module, target: Target) -> None:
    """The module's own state, read by its class's methods (installed here if the class is stock). Only
    where accelerate's hook already holds the stock forward in ``_old_forward`` does the module get a
    bound forward of ours there."""
    install_methods(target.cls, target.methods)
    attrs = module.__dict__
    if _SAVED not in attrs:
        names = (_STATE, "_old_forward") if _forward_slot(module) == "_old_forward" else (_STATE,)
        attrs[_SAVED] = {name: attrs.get(name, MISSING) for name in names}
    if "_old_forward" in attrs[_SAVED]:
        attrs["_old_forward"] = types.MethodType(target.methods["forward"], module)
    attrs[_STATE] = target.state
    _PATCHED_INSTANCES.add(module)


def _revert_instance(module: nn.Module, *, pin: bool) -> bool:
    """Undo the module's own patch; True when it was running a fused op (its own or its class's).

    ``pin``: while the class is patched, pin the module to stock code (state None); without it, also drop
    such a pin (the global revert). A module keeping a state or a pin stays tracked, so that the global
    revert reaches it.
    """
    attrs = module.__dict__
    was_fused = fused_state(module) is not None
    saved = attrs.pop(_SAVED, None)
    if saved is not None:
        for name, value in saved.items():
            if value is MISSING:
                attrs.pop(name, None)
            else:
                attrs[name] = value
    if pin and fused_state(module) is not None:
        attrs[_STATE] = None
    elif not pin and attrs.get(_STATE, MISSING) is None:
        del attrs[_STATE]
    (_PATCHED_INSTANCES.add if _STATE in attrs else _PATCHED_INSTANCES.discard)(module)
    return was_fused


def check_model(model) -> None:
    """Raises TypeError unless ``model`` is None (the classes) or an ``nn.Module`` (its instances)."""
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module or None, got {type(model).__name__}")


def patch(caller: str, model: nn.Module | None, targets: Sequence[Target], hint: str) -> int:
    """Patch the targets' classes (``model=None``: every instance without a patch of its own), or their
    instances inside ``model``. Returns the number of classes or modules set to a fused state.

    Raises:
        TypeError: ``model`` is neither None nor an ``nn.Module``.
        ValueError: ``model`` holds no instance of any target class; the message ends with ``hint``.
    """
    if model is None:
        for target in targets:
            install_methods(target.cls, target.methods)
            _set_class_attributes(target.cls, {_STATE: target.state})
        logger.info("fused_vision: patched %s", ", ".join(f"{t.cls.__name__} -> {t.state}" for t in targets))
        return len(targets)

    check_model(model)
    matches = [(module, t) for module in model.modules() for t in targets if isinstance(module, t.cls)]
    if not matches:
        *others, last = [target.cls.__name__ for target in targets]
        wanted = f"{', '.join(others)} or {last}" if others else last
        raise ValueError(f"{caller}: {type(model).__name__} contains no {wanted}, so there is nothing to fuse. {hint}")
    for module, target in matches:
        _patch_instance(module, target)
    logger.info("fused_vision: patched %d module(s) of %s", len(matches), type(model).__name__)
    return len(matches)


def revert(model: nn.Module | None, classes: Callable[[type], bool]) -> int:
    """Undo the patches of the patched classes that ``classes`` (a predicate) selects.

    With ``model=None``: restore those classes and every instance of them patched (or pinned) with
    ``model=``; returns the number of classes and instance patches undone. With a model: its modules of
    those classes run stock code, even while the classes stay patched; returns how many were fused.
    """
    check_model(model)
    selected = tuple(cls for cls in _CLASS_ORIGINALS if classes(cls))
    if model is not None:
        return sum(_revert_instance(module, pin=True) for module in model.modules() if isinstance(module, selected))
    instances = [module for module in list(_PATCHED_INSTANCES) if isinstance(module, selected)]
    undone = sum(_revert_class(cls) for cls in selected)
    return undone + sum(_revert_instance(module, pin=False) for module in instances)
