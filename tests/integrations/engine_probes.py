"""Functions that tests/integrations/test_vllm_engine.py runs inside vLLM's worker process, on the model it serves
(``LLM.apply_model``): what is patched there, the vision embeddings it computed, and an injected
out-of-memory error. The worker imports this module by name: the test puts tests/ on its PYTHONPATH.
"""

import os

import torch

RECORDED = "_fused_vision_test_embeddings"
CALLS = "_fused_vision_test_encoder_calls"


def patch_states(model) -> dict:
    """What runs in this process: the state of each tower module, vLLM's patched methods, the report's lines."""
    from fused_vision import patching
    from fused_vision.integrations import report

    tower = model.vision_tower
    modules = {"embedder": tower.patch_embedder, "pooler": tower.pooler, "encoder": tower.encoder}
    methods = vars(type(model))
    device = tower.patch_embedder.position_embedding_table.device
    embedder, pooler = patching.fused_state(tower.patch_embedder), patching.fused_state(tower.pooler)
    return {
        "pid": os.getpid(),
        **{name: str(patching.fused_state(module)) for name, module in modules.items()},
        "vllm": sorted(name for name, value in methods.items() if isinstance(value, patching.InstanceMethod)),
        "reported": sorted(report._LOGGED),
        # vLLM's own projection: the embedder runs the lookup alone
        "backends": [report.backend_on(embedder, device, "position_embeddings"), report.backend_on(pooler, device)],
        "fallbacks": report.fallbacks(),
    }


def record_embeddings(model) -> None:
    """From now on, keep every output of the model's vision projection (the soft tokens it embeds)."""
    recorded = []
    object.__setattr__(model, RECORDED, recorded)
    model.embed_vision.register_forward_hook(lambda module, args, output: recorded.append(output.detach().clone()))


def recorded_embeddings(model) -> list:
    """The outputs kept since the last call, in order; the record starts empty again."""
    recorded = getattr(model, RECORDED)
    taken = list(recorded)
    recorded.clear()
    return taken


def fail_once_out_of_memory(model) -> None:
    """The tower's encoder raises ``torch.OutOfMemoryError`` once, on its first call of more than one item;
    each call is kept as (items, whether it raised)."""
    encoder = model.vision_tower.encoder
    calls, forward = [], encoder.forward
    object.__setattr__(model, CALLS, calls)

    def failing_once(*args, inputs_embeds, **kwargs):
        items = inputs_embeds.shape[0]
        raises = items > 1 and not any(raised for _, raised in calls)
        calls.append((items, raises))
        if raises:
            raise torch.OutOfMemoryError(f"injected: {items} items")
        return forward(*args, inputs_embeds=inputs_embeds, **kwargs)

    encoder.forward = failing_once


def encoder_calls(model) -> list[tuple[int, bool]]:
    return list(getattr(model, CALLS))
