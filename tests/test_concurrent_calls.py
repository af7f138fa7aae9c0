"""Calls that share patched modules or kernels: threads at once, and a layer run again after its call returned.

The packed encoder hands each layer its packing with the call, and vLLM's guard keeps its cap to its own
thread, so a second thread's forward (packed or stock) through the same modules, or a replay of a layer (a
forward hook's, gradient checkpointing's), computes what a single-threaded first run computes. The kernels'
launchers take turns inside Triton's interpreter, whose global state two threads would corrupt.
"""

import sys
import threading

import pytest
import torch
from torch import nn

import fused_vision.integrations.vllm as fv
from fused_vision import apply_fused_vision_to_gemma4, encode_images, patching, revert_fused_vision_gemma4
from fused_vision.encoder import attention

from gemma4_towers import FP32_CLOSE, GRIDS, SEQ_LEN, make_inputs, run_tower, tower_of
from helpers import DEVICE, MEETING_TIMEOUT_S, assert_bit_identical, assert_close, reverting_to_stock, run_together
from op_cases import FORWARD_OPS, outputs

stock_after_each_test = reverting_to_stock(revert_fused_vision_gemma4, before=True)


def packed_forward(tower, pixels, ids):
    return lambda: run_tower(tower, pixels, ids)


def stock_padded(tower, pixels, ids):
    return lambda: torch.cat(encode_images(tower, pixels, ids, packed=False))


@pytest.mark.parametrize("case", FORWARD_OPS, ids=str)
def test_threads_calling_one_kernel_at_once_each_get_their_own_result(case):
    """Four threads call one op's kernel on inputs of their own, released together, five times each: every
    result is the one that call gives alone, bit for bit (under the interpreter they take turns; on a GPU
    the compiled launches run as they come)."""
    inputs = [case.inputs(scale=1 + index % 2) for index in range(4)]
    alone = [outputs(case.public(**arguments, backend="triton")) for arguments in inputs]
    start = threading.Barrier(len(inputs), timeout=MEETING_TIMEOUT_S)
    results, errors = [[] for _ in inputs], []

    def run(index):
        try:
            start.wait()
            for _ in range(5):
                results[index].append(outputs(case.public(**inputs[index], backend="triton")))
        except BaseException as exc:  # handed to the test's thread
            errors.append(exc)
            start.abort()

    threads = [threading.Thread(target=run, args=(index,)) for index in range(len(inputs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    for index, (got, expected) in enumerate(zip(results, alone, strict=True)):
        for call in got:
            for a, e in zip(call, expected, strict=True):
                assert_bit_identical(a, e, f"thread {index}")


@pytest.mark.parametrize("second", ["stock", "packed"])
@pytest.mark.parametrize("encoder", ["packed", "fused"])
def test_two_threads_through_one_patched_tower_get_their_own_results(encoder, second):
    """While one thread's packed forward is inside the encoder, another's forward of other items (the
    padded stock encoder, or packed too) runs through the same layers."""
    tower = tower_of("31b_like")
    apply_fused_vision_to_gemma4(tower, encoder=encoder)
    first_inputs = make_inputs(GRIDS, SEQ_LEN, seed=31)
    second_inputs = make_inputs([(4, 4), (2, 6), (6, 2)], 16, seed=32)
    calls = [
        packed_forward(tower, *first_inputs),
        (packed_forward if second == "packed" else stock_padded)(tower, *second_inputs),
    ]
    meeting_point = tower.encoder.layers[-1]
    alone = [run_together(meeting_point, call)[0] for call in calls]
    together = run_together(meeting_point, *calls)
    for index, (got, expected) in enumerate(zip(together, alone, strict=True)):
        assert_close(got, expected, **FP32_CLOSE, what=f"thread {index}")


@pytest.mark.parametrize("encoder", ["packed", "fused"])
def test_a_layer_run_again_after_the_forward_computes_what_it_first_did(encoder):
    """A forward hook keeps a layer's call; run again once the tower's forward has returned, with the same
    arguments, the layer returns the same rows."""
    tower = tower_of("31b_like")
    apply_fused_vision_to_gemma4(tower, encoder=encoder)
    layer, kept = tower.encoder.layers[0], []
    layer.register_forward_hook(
        lambda module, args, kwargs, output: kept.append((args, kwargs, output)), with_kwargs=True
    )
    pixels, ids = make_inputs(GRIDS, SEQ_LEN, seed=33)
    with torch.no_grad():
        run_tower(tower, pixels, ids)
        ((args, kwargs, output),) = kept
        again = layer(*args, **kwargs)
    assert_bit_identical(again, output, "the layer's rows, run again")


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_a_packing_never_reaches_stock_attention_silently(implementation):
    """Handed a packing as its mask, the attention attends within each item once ``attention.install``
    patched it; stock's own attention functions raise on it, rather than attend across items."""
    tower = tower_of("31b_like", attention_implementation=implementation)
    lengths = [10, 6]
    hidden = torch.randn(1, sum(lengths), 32, device=DEVICE)
    ids = torch.cat([make_inputs([(5, 2)], 10)[1][0], make_inputs([(3, 2)], 6)[1][0]])[None]
    cos_sin = tower.encoder.rotary_emb(hidden, ids)
    packing = attention.Packing.of(lengths, DEVICE)
    attn = tower.encoder.layers[0].self_attn
    with torch.no_grad(), pytest.raises((TypeError, AttributeError)):
        attn(hidden_states=hidden, position_embeddings=cos_sin, attention_mask=packing, position_ids=ids)
    attention.install()
    with torch.no_grad():
        packed, _ = attn(hidden_states=hidden, position_embeddings=cos_sin, attention_mask=packing, position_ids=ids)
        items = zip(hidden.split(lengths, 1), ids.split(lengths, 1), strict=True)
        alone = [
            attn(hidden_states=h, position_embeddings=tower.encoder.rotary_emb(h, i), position_ids=i)[0]
            for h, i in items
        ]
    assert_close(packed, torch.cat(alone, dim=1), **FP32_CLOSE, what="attention within each item")


class VllmModel(nn.Module):
    """What vLLM's guard reads of its ``Gemma4ForConditionalGeneration``: the tower, the model dtype and a
    ``_process_image_input`` that sizes its chunk with ``_encoder_chunk`` (here: out of memory above
    ``inputs["fits"]`` items), after a call of ``entered`` (where threads meet)."""

    def __init__(self, tower):
        super().__init__()
        self.vision_tower, self.model_dtype, self.entered = tower, torch.float32, nn.Identity()

    def _encoder_chunk(self, patches_per_item, free_bytes, total_bytes, position_embedding_size):
        return 1

    def _process_image_input(self, inputs):
        self.entered(inputs["fits"])
        chunk = self._encoder_chunk(SEQ_LEN, 2**40, 2**40, 64)
        if chunk > inputs["fits"]:
            raise torch.OutOfMemoryError(f"injected: {chunk} items")
        return chunk


@pytest.mark.filterwarnings("ignore:fused_vision. vLLM's _process_image_input ran out of memory:RuntimeWarning")
def test_vllms_guard_keeps_each_threads_cap_to_itself():
    """Two threads' guarded calls of one model at once: one runs out of memory and re-runs at half the
    chunk, the other keeps the planner's chunk, each as it does alone."""
    model = VllmModel(tower_of("31b_like"))
    methods = {name: method for name, method in fv._methods(VllmModel).items() if name in vars(VllmModel)}
    assert set(methods) == {"_encoder_chunk", "_process_image_input"}
    patching.patch("test", None, [patching.Target(VllmModel, methods, fv._PLANNER_STATE)], "")
    try:
        images = [torch.zeros(SEQ_LEN, 12)] * 20
        calls = [
            lambda fits=fits: model._process_image_input({"pixel_values": images, "fits": fits})
            for fits in (4, sys.maxsize)
        ]
        meeting_point = model.entered  # inside both guarded calls, before either asks for its chunk
        alone = [run_together(meeting_point, call)[0] for call in calls]
        assert alone[0] == 2 and alone[1] > 4, alone
        assert run_together(meeting_point, *calls) == alone
    finally:
        patching.revert(None, lambda cls: cls is VllmModel)
