"""Gemma 4's whole vision tower with random weights, in its one-hot, F.embedding and fused forms, and the
low-memory scenario behind vLLM's encoder chunk planner.

The tower is transformers' ``Gemma4VisionModel`` (the run's dtype, sdpa) from the installed release. Its patch
embedder's ``_position_embeddings`` is swapped for the one-hot (5.5-5.9) or the F.embedding (5.10+)
reference, so both eras run on any transformers 5.5+; the pooler is stock's one-hot in every release.
The fused form is ``fused_vision.apply_fused_vision_to_gemma4(model)``; it runs last, on the
same weights, so that no patch has to be undone.
"""

import math
from contextlib import contextmanager
from functools import partial

import torch

from fused_vision import reference

from .measure import synchronize
from .ops import Unsupported
from .workloads import PATCH_SIZE, POOLING_KERNEL, POSITION_EMBEDDING_SIZE, Case, cases, pixel_values, position_ids

GiB = 2**30

VISION_TOWERS = {
    "tower_e2b_e4b": dict(
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=16,
        num_attention_heads=12,
        num_key_value_heads=12,
        head_dim=64,
        use_clipped_linears=True,
        standardize=False,
    ),
    "tower_26b_31b": dict(
        hidden_size=1152,
        intermediate_size=4304,
        num_hidden_layers=27,
        num_attention_heads=16,
        num_key_value_heads=16,
        head_dim=72,
        use_clipped_linears=False,
        standardize=True,
    ),
}
# --tiny keeps each tower's structure (clipped linears, standardize) at a size the Triton interpreter runs fast.
TINY_TOWER = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=32,
)
TOWER_PROVIDERS = ("onehot", "embedding", "fused")  # fused last: its patch stays on the model

# The low-memory scenario: vLLM's planner on a 22 GiB card with 3 GiB free, emulated on a large GPU.
EMULATED_TOTAL_BYTES = 22 * GiB
EMULATED_FREE_BYTES = 3 * GiB
LOW_MEMORY_TOWER = "tower_26b_31b"
LOW_MEMORY_DTYPE = torch.bfloat16  # the checkpoints' dtype, which vLLM's budget is set for
LOW_MEMORY_WORKLOADS = dict(
    zip(cases("image_64x280", "video_128x70"), ("64 images x 280 tokens", "4 videos x 32 frames x 70 tokens"))
)
LOW_MEMORY_PATHS = ("onehot", "fused")
NOT_RUN = "computed, not run: the emulated card needs a CUDA device"


def tower_shape(name: str, *, tiny: bool) -> dict:
    return {**VISION_TOWERS[name], **(TINY_TOWER if tiny else {})}


def tower_config(name: str, *, tiny: bool, layers: int | None = None):
    """transformers' ``Gemma4VisionConfig`` of the tower; ``layers`` encoder layers where given, else the shape's."""
    from transformers import Gemma4VisionConfig

    return Gemma4VisionConfig(
        **tower_shape(name, tiny=tiny) | ({} if layers is None else dict(num_hidden_layers=layers)),
        patch_size=PATCH_SIZE,
        pooling_kernel_size=POOLING_KERNEL,
        position_embedding_size=POSITION_EMBEDDING_SIZE,
    )


def build_tower(
    name: str, device: torch.device, dtype: torch.dtype, *, tiny: bool, layers: int | None = None
) -> torch.nn.Module:
    """An sdpa ``Gemma4VisionModel`` in ``dtype`` with random weights, built on ``device``, without autograd;
    ``layers`` encoder layers where given, else the shape's."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4VisionModel

    config = tower_config(name, tiny=tiny, layers=layers)
    with torch.device(device):
        model = Gemma4VisionModel._from_config(config, dtype=dtype, attn_implementation="sdpa")
    # Stock initialises the table to ones; random rows keep the lookup's output honest.
    torch.nn.init.normal_(model.patch_embedder.position_embedding_table)
    return model.eval().requires_grad_(False)


def use_provider(model: torch.nn.Module, provider: str) -> None:
    """Make the tower compute its stem as ``provider`` does."""
    embedder = model.patch_embedder
    if provider == "fused":
        vars(embedder).pop("_position_embeddings", None)  # back to the installed release's own code
        try:
            from fused_vision.integrations.transformers import apply_fused_vision_to_gemma4
        except ImportError as exc:
            raise Unsupported(f"fused_vision.integrations.transformers is not available ({exc})") from exc
        # backend="triton": a kernel that fails raises, rather than have "auto" time the reference as fused.
        if apply_fused_vision_to_gemma4(model, backend="triton") == 0:
            raise Unsupported("apply_fused_vision_to_gemma4 patched no module of this tower")
        return
    if not hasattr(type(embedder), "_position_embeddings"):
        raise Unsupported("this transformers' patch embedder has no _position_embeddings to swap")
    lookup = reference.onehot_position_embeddings if provider == "onehot" else reference.position_embeddings
    # An instance attribute shadows the method; partial binds the table as the method would.
    embedder._position_embeddings = partial(lookup, embedder.position_embedding_table)


@torch.inference_mode()
def encode(model: torch.nn.Module, pixels: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return model(pixel_values=pixels, pixel_position_ids=ids).last_hidden_state


def tower_inputs(case: Case, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    ids = position_ids(case, device)
    return pixel_values(ids), ids


def bench_tower(session, name: str, providers: tuple[str, ...], tower_cases: tuple[Case, ...]) -> None:
    """Time every provider of one tower at every case; log each provider's output against the first one's."""
    device, tiny = session.options.device, session.options.tiny
    hidden = tower_shape(name, tiny=tiny)["hidden_size"]
    providers = tuple(p for p in TOWER_PROVIDERS if p in providers)

    def skip_all(providers, reason):
        for provider in providers:
            for case in tower_cases:
                session.skip(name, provider, case, hidden, reason)

    if session.out_of_time():  # before building it: a 26B/31B tower takes seconds to initialise
        return skip_all(providers, session.time_budget_reason())
    session.log(f"{name}: building the tower (random weights, {session.dtype_name}, sdpa)")
    try:
        model = build_tower(name, device, session.dtype, tiny=tiny)
    except Exception as exc:
        return skip_all(providers, exc)
    inputs = {case: tower_inputs(case, device) for case in tower_cases}
    first_outputs: dict[Case, tuple[str, torch.Tensor]] = {}
    for provider in providers:
        try:
            use_provider(model, provider)
        except Exception as exc:
            skip_all((provider,), exc)
            continue
        for case in tower_cases:
            call = partial(encode, model, *inputs[case])
            output = session.run(name, provider, case, hidden, lambda: call, budget=session.tower_budget)
            if output is None:
                continue
            session.profile(name, provider, case, call)
            baseline, expected = first_outputs.setdefault(case, (provider, output))
            if baseline != provider:
                difference = (output.float() - expected.float()).abs().max().item()
                scale = expected.float().abs().max().item()
                session.log(
                    f"    {name} {case.name}: {provider} vs {baseline} output: "
                    f"max |diff| {difference:.3g} (max |value| {scale:.3g})"
                )
    del model, inputs, first_outputs
    if device.type == "cuda":
        torch.cuda.empty_cache()


@contextmanager
def emulated_card(device: torch.device, total_bytes: int, free_bytes: int):
    """Make this process see a card of ``total_bytes`` with ``free_bytes`` free; yields the free bytes it got.

    A memory fraction caps the caching allocator at ``total_bytes``, and a ballast takes all of that
    but ``free_bytes`` beyond what is reserved already (weights, inputs). ``torch.cuda.mem_get_info``
    does not see the fraction, so the planner is handed the emulated numbers.
    """
    torch.cuda.empty_cache()
    device_bytes = torch.cuda.get_device_properties(device).total_memory
    if total_bytes > device_bytes:
        raise Unsupported(f"the device's {device_bytes / GiB:.1f} GiB are less than {total_bytes / GiB:.0f} GiB")
    ballast_bytes = total_bytes - free_bytes - torch.cuda.memory_reserved(device)
    # By index: unlike the other memory functions, this one rejects a bare torch.device("cuda").
    torch.cuda.set_per_process_memory_fraction(total_bytes / device_bytes, device.index)
    ballast = None
    try:
        ballast = torch.empty(ballast_bytes, dtype=torch.uint8, device=device)
        yield total_bytes - torch.cuda.memory_reserved(device)
    finally:
        del ballast
        torch.cuda.set_per_process_memory_fraction(1.0, device.index)
        torch.cuda.empty_cache()


def encode_in_chunks(model, pixels, ids, chunk: int, device: torch.device) -> dict:
    """Encode all items ``chunk`` at a time, as vLLM's encoder loop does: seconds, items/s and peak bytes.

    The first and the last (possibly shorter) chunk run once untimed, so no compile or autotune is timed.
    """
    items = pixels.shape[0]
    starts = range(0, items, chunk)
    for start in dict.fromkeys((starts[0], starts[-1])):
        encode(model, pixels[start : start + chunk], ids[start : start + chunk])
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for start in starts:
        encode(model, pixels[start : start + chunk], ids[start : start + chunk])
    end.record()
    synchronize(device)
    seconds = begin.elapsed_time(end) / 1e3
    peak = torch.cuda.max_memory_allocated(device) - before
    return dict(seconds=seconds, items_per_s=items / seconds, peak_bytes=peak)


def encode_on_emulated_card(model, pixels, ids, chunk: int, device: torch.device) -> dict:
    """``encode_in_chunks`` on the emulated card. An out-of-memory error, the failure the planner exists to
    prevent, becomes the row's status rather than a crash."""
    measured = dict(calls=math.ceil(pixels.shape[0] / chunk), emulated_total_bytes=EMULATED_TOTAL_BYTES)
    try:
        with emulated_card(device, EMULATED_TOTAL_BYTES, EMULATED_FREE_BYTES) as free_bytes:
            measured["free_bytes"] = free_bytes
            measured |= encode_in_chunks(model, pixels, ids, chunk, device)
    except torch.cuda.OutOfMemoryError as exc:
        return measured | dict(status=f"out of memory: {str(exc).splitlines()[0]}")
    return measured | dict(status="ok")


def planned_chunk(path: str, case: Case, vision_config) -> int:
    """Items per tower call on the emulated card: vLLM's rule for the one-hot, fused_vision's plan otherwise."""
    from fused_vision.pipeline.planner import encoder_chunk, plan

    if path == "onehot":  # vLLM prices an item at 4 * N * P int64: the one-hot's (N, 2, P), twice over
        return encoder_chunk(case.patches_per_item, EMULATED_FREE_BYTES, EMULATED_TOTAL_BYTES, POSITION_EMBEDDING_SIZE)
    return plan(
        case.items,
        case.patches_per_item,
        vision_config,
        path="fused",
        free_bytes=EMULATED_FREE_BYTES,
        total_bytes=EMULATED_TOTAL_BYTES,
        dtype=LOW_MEMORY_DTYPE,
    )


def record_planned_chunks(session) -> None:
    """Where no CUDA device emulates the card: each path's chunk for the 26B/31B tower, computed, as rows."""
    config = tower_config(LOW_MEMORY_TOWER, tiny=False)  # nothing is built: the real tower's shape
    for path in LOW_MEMORY_PATHS:
        for case, workload in LOW_MEMORY_WORKLOADS.items():
            chunk = planned_chunk(path, case, config)
            row = dict(workload=workload, case=case.name, path=path, chunk=chunk, items=case.items)
            row |= dict(calls=math.ceil(case.items / chunk), status=NOT_RUN, emulated_total_bytes=EMULATED_TOTAL_BYTES)
            session.record_low_memory(row | dict(free_bytes=EMULATED_FREE_BYTES))


def run_low_memory(session) -> None:
    """Both paths through the 26B/31B tower, each at its planned chunk, on the emulated 22 GiB card; without a
    CUDA device, the chunks alone."""
    device, tiny = session.options.device, session.options.tiny
    hidden = tower_shape(LOW_MEMORY_TOWER, tiny=tiny)["hidden_size"]

    def skip_all(paths, reason):
        for path in paths:
            for case in LOW_MEMORY_WORKLOADS:
                session.skip("low_memory", path, case, hidden, reason)

    if device.type != "cuda":
        try:
            return record_planned_chunks(session)
        except Exception as exc:  # no transformers' Gemma 4 config, or no planner: a logged skip
            return skip_all(LOW_MEMORY_PATHS, exc)
    if session.out_of_time():
        return skip_all(LOW_MEMORY_PATHS, session.time_budget_reason())
    try:
        import fused_vision.pipeline.planner  # noqa: F401
    except ImportError as exc:
        return skip_all(LOW_MEMORY_PATHS, f"fused_vision.pipeline.planner is not available ({exc})")
    session.log(
        f"low_memory: {LOW_MEMORY_TOWER} on an emulated {EMULATED_TOTAL_BYTES / GiB:.0f} GiB card "
        f"with {EMULATED_FREE_BYTES / GiB:.0f} GiB free"
    )
    try:
        model = build_tower(LOW_MEMORY_TOWER, device, LOW_MEMORY_DTYPE, tiny=tiny)
    except Exception as exc:
        return skip_all(LOW_MEMORY_PATHS, exc)
    # On the device before the ballast: the planner budgets the tower's working memory, not its inputs.
    inputs = {case: tower_inputs(case, device) for case in LOW_MEMORY_WORKLOADS}
    for index, path in enumerate(LOW_MEMORY_PATHS):
        if session.out_of_time():
            return skip_all(LOW_MEMORY_PATHS[index:], session.time_budget_reason())
        try:
            use_provider(model, path)
        except Exception as exc:
            skip_all((path,), exc)
            continue
        for case, workload in LOW_MEMORY_WORKLOADS.items():
            try:
                chunk = planned_chunk(path, case, model.config)
                measured = encode_on_emulated_card(model, *inputs[case], chunk, device)
            except Exception as exc:
                session.skip("low_memory", path, case, hidden, exc)
                continue
            row = dict(workload=workload, case=case.name, path=path, chunk=chunk, items=case.items)
            session.record_low_memory(row | measured)
    del model, inputs
    torch.cuda.empty_cache()
