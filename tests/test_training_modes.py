"""Gradients of the stock, packed and fused encoders in every mode training uses, each against stock's.

A loss on the soft tokens of a tower (``encoder="stock"``, ``"packed"`` or ``"fused"``) is differentiated
in one mode: eval, train, gradient checkpointing (non-reentrant, transformers' default, and reentrant), a
frozen tower with a LoRA-style adapter (alone, and under reentrant checkpointing with its inputs made to
require grads, as adapter trainers run it), torch.compile, autocast. Its gradients (every trainable
parameter's, and the pixels') are held to stock's on the same weights, run eagerly in fp32 without the
mode's machinery: within 1e-4; under autocast, no less accurate than stock's own under autocast. The fused
layers must run fused wherever they can, under checkpointing recomputed fused in backward.
"""

import copy

import pytest
import torch

from fused_vision import apply_fused_vision_to_gemma4, revert_fused_vision_gemma4

from gemma4_towers import (
    ACCURACY_FLOOR,
    GRIDS,
    KINDS,
    SEQ_LEN,
    adapted,
    assert_gradients_match,
    enable_checkpointing,
    float64_twin,
    gradients,
    make_inputs,
    tower_of,
)
from helpers import DEVICE, assert_as_accurate_as_stock, reverting_to_stock

ENCODERS = ["stock", "packed", "fused"]
# mode -> the fused layer calls of a fused tower's forward, and of its forward and backward together
# (two layers; a checkpointed layer runs again in backward; the adapter's layer fuses around its linear)
FUSED_CALLS = {
    "eval": (2, 2),
    "train": (2, 2),
    "checkpointing": (2, 4),
    "reentrant_checkpointing": (2, 4),
    "adapter": (2, 2),
    "adapter_reentrant_checkpointing_input_grads": (2, 4),
    "compile": (2, 2),
}


stock_after_each_test = reverting_to_stock(revert_fused_vision_gemma4, fresh_warnings=True)


def patched(tower, encoder):
    tower = copy.deepcopy(tower)
    if encoder != "stock":
        apply_fused_vision_to_gemma4(tower, encoder=encoder)
    return tower


def set_mode(tower, mode):
    """``tower`` trained as ``mode`` trains it; returns what to call in its place (None: the tower)."""
    tower.train(mode != "eval")
    if "checkpointing" in mode:
        enable_checkpointing(tower, use_reentrant="reentrant" in mode)
    if mode.endswith("input_grads"):  # the patch embedder's output requires grads, as trainers hook it
        tower._input_embed_layer = "patch_embedder"
        tower.enable_input_require_grads()
    if mode == "compile":
        torch._dynamo.reset()
        return torch.compile(tower, backend="aot_eager")
    return None


def case(kind, encoder, mode):
    return pytest.param(kind, encoder, mode, id=f"{kind}-{encoder}-{mode}")


# Checkpointing on both real head sizes; each other mode on one, alternately (the interpreter is slow).
CASES = [
    case(kind, encoder, mode)
    for encoder in ENCODERS
    for index, mode in enumerate(FUSED_CALLS)
    for kind in (KINDS if "checkpointing" in mode else [KINDS[index % 2]])
]


@pytest.mark.parametrize(("kind", "encoder", "mode"), CASES)
def test_gradients_match_stock_in_every_training_mode(fused_layers, kind, encoder, mode):
    stock_tower = tower_of(kind)
    if mode.startswith("adapter"):
        adapted(stock_tower)
    pixels, ids = make_inputs(GRIDS, SEQ_LEN, seed=11)
    pixels_require_grad = not mode.endswith("input_grads")  # the hook alone makes the embeddings require it
    expected = gradients(stock_tower, pixels, ids, pixels_require_grad=pixels_require_grad)

    tower = patched(stock_tower, encoder)
    forward = set_mode(tower, mode)
    got = gradients(tower, pixels, ids, pixels_require_grad=pixels_require_grad, forward=forward)
    torch._dynamo.reset()
    assert_gradients_match(got, expected, what=f"{encoder} tower, {mode}: grad")
    fused_calls = FUSED_CALLS[mode][1] if encoder == "fused" else 0
    assert len(fused_layers) == fused_calls, "fused wherever a layer can be, recomputed fused in backward"


@pytest.mark.parametrize("encoder", ENCODERS)
def test_the_fused_layers_run_fused_in_the_checkpointed_forward(fused_layers, encoder):
    tower = patched(tower_of("31b_like"), encoder)
    set_mode(tower, "checkpointing")
    pixels, ids = make_inputs(GRIDS, SEQ_LEN, seed=11)
    out = tower(pixel_values=pixels, pixel_position_ids=ids).last_hidden_state
    assert len(fused_layers) == (FUSED_CALLS["checkpointing"][0] if encoder == "fused" else 0)
    out.square().mean().backward()
    assert len(fused_layers) == (FUSED_CALLS["checkpointing"][1] if encoder == "fused" else 0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("encoder", ENCODERS)
def test_gradients_under_autocast_are_as_accurate_as_stocks(kind, encoder):
    """Under bf16 autocast every layer runs stock code (the fused ones with one warning); each gradient is
    no less accurate than stock's own under autocast, against a float64 twin's."""
    stock_tower = tower_of(kind)
    pixels, ids = make_inputs(GRIDS, SEQ_LEN, seed=11)
    exact = gradients(float64_twin(stock_tower), pixels.double(), ids)
    tower = patched(stock_tower, encoder)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        stock = gradients(stock_tower.train(), pixels, ids)
        got = gradients(tower.train(), pixels, ids)
    for name, grad in exact.items():
        what = f"{encoder} tower under autocast: grad of {name}"
        assert_as_accurate_as_stock(got[name], stock[name], grad, floor=ACCURACY_FLOOR[torch.bfloat16], what=what)


def _class_patched(tower):
    apply_fused_vision_to_gemma4(encoder="fused")
    return tower


def _moved(tower):
    """A move to another device as ``.to(device)`` makes it: new storage for every parameter."""
    tower = patched(tower, "fused")
    return tower._apply(torch.Tensor.clone)


# A fused tower as each route makes it: the weights are joined at apply, or at the first fused forward.
ROUTES = {
    "class_patch": _class_patched,
    "instance_patch": lambda tower: patched(tower, "fused"),
    "instance_patch_then_to_dtype": lambda tower: patched(tower, "fused").double().float(),
    "instance_patch_then_to_device": _moved,
}


@pytest.mark.parametrize("route", ROUTES)
def test_training_after_an_inference_mode_forward_gets_stocks_gradients(route):
    """A validation pass under inference_mode (Lightning's default), even the forward that joins the q/k/v
    and gate/up weights, leaves every weight trainable: the gradients after it are stock's."""
    stock_tower = tower_of("31b_like")
    pixels, ids = make_inputs(GRIDS, SEQ_LEN, seed=11)
    expected = gradients(copy.deepcopy(stock_tower).train(), pixels, ids)
    tower = ROUTES[route](copy.deepcopy(stock_tower))
    for step in ("inference", "train", "inference", "train"):
        if step == "inference":
            with torch.inference_mode():
                tower.eval()(pixel_values=pixels, pixel_position_ids=ids)
            continue
        tower.zero_grad(set_to_none=True)
        got = gradients(tower.train(), pixels, ids)
        assert_gradients_match(got, expected, what=f"{route}, training after an inference-mode forward: grad")
