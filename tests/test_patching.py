"""fused_vision.patching, once, on stand-in modules: the machinery that fused_vision.integrations.transformers and
fused_vision.integrations.sglang are built on, with none of their numerics in the way.

``Scale`` and ``Bare`` play the model's classes; ``fused_forward`` plays an integration's method: it reads
the module's state and runs stock code when that is None, and adds the state's offset otherwise, so every
output tells which code ran.
"""

import copy
import dataclasses
import pickle
import re

import pytest
import torch
from torch import nn

from fused_vision import patching

from helpers import assert_bit_identical, reverting_to_stock

CALLER = "apply_stand_in"
HINT = "Pass a model holding a Scale or a Bare."
X = torch.arange(4.0)


@dataclasses.dataclass(frozen=True)
class Fused:
    offset: float

    def __str__(self) -> str:
        return f"fused(offset={self.offset:g})"


class Scale(nn.Module):
    def __init__(self, weight: float = 2.0):
        super().__init__()
        self.register_buffer("weight", torch.tensor(weight))

    def forward(self, x):
        return x * self.weight

    def shift(self, x):
        return x + self.weight

    def extra_repr(self) -> str:
        return "scale"


class Bare(nn.Module):
    """No ``shift`` and no ``extra_repr`` of its own."""

    def forward(self, x):
        return x - 1


class Budgeted(nn.Module):
    """A staticmethod as vLLM's ``_encoder_chunk`` is one, which its tests call through the class."""

    @staticmethod
    def chunk(budget):
        return budget // 2

    def forward(self, x):
        return x * self.chunk(8)


SCALE_FORWARD, SCALE_SHIFT, BARE_FORWARD = Scale.forward, Scale.shift, Bare.forward
SCALE_STOCK, SHIFT_STOCK, BARE_STOCK = X * 2, X + 2, X - 1
STOCK_VARS = {cls: dict(vars(cls)) for cls in (Scale, Bare, Budgeted)}


def _fused(name: str):
    def method(self, x):
        stock, state = patching.stock_method(self, name), patching.fused_state(self)
        return stock(x) if state is None else stock(x) + state.offset

    return method


fused_forward, fused_shift = _fused("forward"), _fused("shift")


def scale_target(offset: float = 1.0) -> patching.Target:
    return patching.Target(Scale, {"forward": fused_forward, "shift": fused_shift}, Fused(offset))


def bare_target(offset: float = 1.0) -> patching.Target:
    return patching.Target(Bare, {"forward": fused_forward, "shift": fused_shift}, Fused(offset))


def patch(model=None, *targets) -> int:
    return patching.patch(CALLER, model, targets or (scale_target(),), HINT)


def is_stand_in(cls: type) -> bool:
    return cls in (Scale, Bare, Budgeted)


def revert(model=None, classes=is_stand_in) -> int:
    return patching.revert(model, classes)


def assert_runs(module, expected, what="output"):
    assert_bit_identical(module(X), expected, what)


def assert_class_is_stock(cls):
    assert dict(vars(cls)) == STOCK_VARS[cls], f"{cls.__name__} is not as it was before the patch"


def fused_attributes(module) -> list[str]:
    return [name for name in vars(module) if name.startswith("_fused_vision")]


def revert_and_check_the_classes():
    revert()
    assert_class_is_stock(Scale)
    assert_class_is_stock(Bare)
    assert_class_is_stock(Budgeted)


stock_after_each_test = reverting_to_stock(revert_and_check_the_classes)


# ---- classes and instances -------------------------------------------------------------------------


def test_class_patch_reaches_instances_built_before_and_after():
    before = Scale()
    assert patch() == 1
    assert patch() == 1  # idempotent
    after = Scale()
    for module in (before, after):
        assert_runs(module, SCALE_STOCK + 1, "class-patched forward")
        assert_bit_identical(module.shift(X), SHIFT_STOCK + 1, "class-patched second method")
        assert fused_attributes(module) == [], "a class patch writes nothing into its instances"
    assert Scale.forward is fused_forward and Scale.shift is fused_shift
    assert patching.stock_attribute(Scale, "forward") is SCALE_FORWARD
    assert patching.stock_attribute(Scale, "shift") is SCALE_SHIFT

    assert patch(None, scale_target(5)) == 1  # reconfigures
    assert_runs(before, SCALE_STOCK + 5, "reconfigured class patch")
    assert revert() == 1
    assert_class_is_stock(Scale)
    for module in (before, after):
        assert_runs(module, SCALE_STOCK, "reverted")
        assert_bit_identical(module.shift(X), SHIFT_STOCK, "reverted second method")


def test_instance_patch_again_is_idempotent_and_reconfigures_only_the_classes_named():
    model = nn.Sequential(Scale(), Bare())
    assert patch(model, scale_target(), bare_target()) == 2
    assert patch(model, scale_target(), bare_target()) == 2
    assert [str(patching.fused_state(m)) for m in model] == ["fused(offset=1)", "fused(offset=1)"]
    assert "forward" not in vars(model[0]), "an instance patch binds no method to the instance"

    assert patch(model, scale_target(3)) == 1
    assert_runs(model[0], SCALE_STOCK + 3, "reconfigured")
    assert_runs(model[1], BARE_STOCK + 1, "the class not named keeps its patch")


def test_instance_patch_with_and_without_a_class_patch():
    model, other = nn.Sequential(Scale()), Scale()
    assert patch(model, scale_target(1)) == 1
    assert_runs(model[0], SCALE_STOCK + 1, "instance patch")
    assert_runs(other, SCALE_STOCK, "an instance of the stock class")

    patch(None, scale_target(2))
    assert_runs(model[0], SCALE_STOCK + 1, "a class patch does not override the instance's own")
    assert_runs(other, SCALE_STOCK + 2, "class patch")
    assert revert(model) == 1  # pins the instance to stock under the class patch
    assert_runs(model[0], SCALE_STOCK, "pinned to stock")
    assert "fused_vision" not in repr(model)
    assert_runs(other, SCALE_STOCK + 2, "the class patch holds for others")

    assert patch(model, scale_target(3)) == 1  # on top of the class patch
    assert_runs(model[0], SCALE_STOCK + 3, "patched again")
    assert revert() == 2, "the class and the instance patch"
    for module in (model[0], other):
        assert_runs(module, SCALE_STOCK, "after the global revert")
        assert fused_attributes(module) == []


def test_repr_shows_the_state_beside_the_stock_extra_repr():
    scale, bare, pinned = Scale(), Bare(), Scale()
    patch(None, scale_target(), bare_target())
    revert(pinned)
    assert repr(scale) == "Scale(scale, fused_vision=fused(offset=1))"
    assert repr(bare) == "Bare(fused_vision=fused(offset=1))"
    assert repr(pinned) == "Scale(scale)"
    revert()
    assert (repr(scale), repr(bare)) == ("Scale(scale)", "Bare()")


# ---- copies: pickle, deepcopy, DataParallel replicas ---------------------------------------------------


def test_patched_modules_pickle_deepcopy_and_replicate_as_any_module():
    module = Scale()
    patch(module)
    loaded, twin = pickle.loads(pickle.dumps(module)), copy.deepcopy(module)
    for other in (loaded, twin):
        assert patching.fused_state(other) == Fused(1)
        assert_runs(other, SCALE_STOCK + 1, "a copy of a patched module")

    replica = module._replicate_for_data_parallel()  # what nn.DataParallel makes for each device
    replica.weight = torch.tensor(0.0)
    assert_runs(replica, torch.ones_like(X), "a replica on its own buffer")
    assert_runs(module, SCALE_STOCK + 1, "the original keeps its buffer")

    revert()
    for other in (loaded, twin):
        assert "fused_vision" not in repr(other)
        assert_runs(other, SCALE_STOCK, "a copy after the global revert")


def test_an_unpickled_module_reverts_as_the_original_would():
    module = Scale()
    patch(module)
    loaded = pickle.loads(pickle.dumps(module))
    assert revert(loaded) == 1
    assert fused_attributes(loaded) == [], "its saved attributes (MISSING, pickled by name) are restored"
    assert_runs(loaded, SCALE_STOCK, "reverted copy")
    assert_runs(module, SCALE_STOCK + 1, "the original keeps its patch")


# ---- the global revert ---------------------------------------------------------------------------------


def test_forwards_saved_before_the_global_revert_run_stock_after_it():
    module = Scale()
    patch()
    saved = module.forward  # as accelerate's _old_forward, or any caller, keeps it
    assert_bit_identical(saved(X), SCALE_STOCK + 1, "saved forward")
    assert revert() == 1
    assert_bit_identical(saved(X), SCALE_STOCK, "a saved forward after the revert")

    model = nn.Sequential(Scale(), Scale())
    assert patch(model) == 2
    assert revert() == 2, "two instance patches undone, no class patch"


def test_a_pin_to_stock_never_outlives_the_global_revert():
    module = Scale()
    patch()
    revert(module)  # pinned to stock under the class patch
    patch(module)
    revert(module)  # the pin comes back from what the instance patch saved
    revert()
    patch()
    assert patching.fused_state(module) == Fused(1)
    assert_runs(module, SCALE_STOCK + 1, "class-patched after the global revert")


def test_accelerate_style_hooks_are_kept():
    """accelerate (device_map, offload) wraps ``forward`` and keeps the module's own in ``_old_forward``."""
    module, calls = Scale(), []

    def hooked_forward(*args, **kwargs):
        calls.append(1)
        return module._old_forward(*args, **kwargs)

    module._hf_hook, module._old_forward, module.forward = object(), module.forward, hooked_forward
    patch(module)
    assert module.forward is hooked_forward and module._old_forward.__func__ is fused_forward
    assert_runs(module, SCALE_STOCK + 1, "hooked module")
    revert(module)
    assert module.forward is hooked_forward and module._old_forward.__func__ is SCALE_FORWARD
    assert_runs(module, SCALE_STOCK, "reverted hooked module")
    assert len(calls) == 2


def test_a_method_the_class_does_not_define_is_not_installed_and_left_as_found():
    bare = Bare()
    assert patch(None, bare_target()) == 1
    assert Bare.forward is fused_forward
    assert not hasattr(Bare, "shift") and not hasattr(Bare, "_fused_vision_stock_shift")
    assert_runs(bare, BARE_STOCK + 1, "class-patched forward")
    assert revert() == 1
    assert_class_is_stock(Bare)  # no shift, extra_repr or stock slot of ours left behind
    assert_runs(bare, BARE_STOCK, "reverted")


def test_revert_with_a_predicate_leaves_other_classes_patched():
    scale, bare = Scale(), Bare()
    assert patch(None, scale_target(1), bare_target(2)) == 2
    assert revert(None, lambda cls: cls is Bare) == 1
    assert_class_is_stock(Bare)
    assert_runs(bare, BARE_STOCK, "the class selected")
    assert Scale.forward is fused_forward
    assert_runs(scale, SCALE_STOCK + 1, "the class not selected")

    model = nn.Sequential(Scale(), Bare())
    assert patch(model, scale_target(3), bare_target(4)) == 2
    assert revert(model, lambda cls: cls is Bare) == 1
    assert_runs(model[0], SCALE_STOCK + 3, "the module of the class not selected")
    assert_runs(model[1], BARE_STOCK, "the module of the class selected")


def fused_chunk(self, budget):
    stock, state = patching.stock_method(self, "chunk"), patching.fused_state(self)
    return stock(budget) if state is None else budget - state.offset


def test_an_instance_method_reaches_instances_and_leaves_the_class_and_its_copies_stock():
    stock_chunk = Budgeted.__dict__["chunk"]  # the staticmethod object itself
    module = Budgeted()
    methods = {"chunk": patching.InstanceMethod(fused_chunk), "shift": patching.InstanceMethod(fused_shift)}
    assert patch(None, patching.Target(Budgeted, methods, Fused(1))) == 1
    assert module.chunk(8) == 7, "an instance's call runs ours"
    assert_runs(module, X * 7, "stock forward calling the method through self")
    assert Budgeted.chunk(8) == 4 and Budgeted.chunk is stock_chunk.__func__, "a call through the class is stock"

    class Copy(nn.Module):  # vLLM's EmbeddingGemma2Model copies Gemma 4's methods in its class body
        chunk = staticmethod(Budgeted.chunk)

    assert Copy().chunk(8) == 4, "a copy taken from the class is stock"
    assert not hasattr(Budgeted, "shift"), "a method the class does not define is not installed"
    saved = Budgeted().chunk  # ours, bound
    patching.revert(module, is_stand_in)  # pinned to stock while the class stays patched
    assert module.chunk(8) == 4
    assert revert() == 1
    assert Budgeted.__dict__["chunk"] is stock_chunk, "the revert restores the very staticmethod object"
    assert module.chunk(8) == 4
    assert saved(8) == 4, "saved before the revert, it runs the staticmethod after it, with no self"


# ---- errors --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("call", [patch, revert], ids=["patch", "revert"])
def test_a_model_that_is_not_a_module_is_a_type_error_naming_model(call):
    with pytest.raises(TypeError, match=r"^model: expected a torch\.nn\.Module or None, got str$"):
        call("google/gemma-4-e2b-it")


def test_a_model_with_nothing_to_patch_is_a_value_error_naming_the_caller_and_ending_with_the_hint():
    for targets, wanted in (((scale_target(),), "Scale"), ((scale_target(), bare_target()), "Scale or Bare")):
        message = f"{CALLER}: Sequential contains no {wanted}, so there is nothing to fuse. {HINT}"
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            patch(nn.Sequential(nn.Linear(2, 2)), *targets)
    assert_class_is_stock(Scale)  # the failed call installed nothing
