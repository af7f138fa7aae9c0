"""Whole encoder calls on processor mixes: the packed and fused encoders against the stock tower, in items/s,
FLOP rate and peak memory.

The providers (``stock``, ``compiled``, ``padded``, ``packed``, ``fused``: ``encode_images`` on a deep copy
of the tower under ``encoder="fused"``) share one unpatched tower and its weights; a FLOP rate counts the
useful FLOPs alone, those on real patches (``encoder_flops``); repetitions interleave across providers,
within the run's time budget. The providers, the mixes, the rounds and the budget's rules, and why a CPU
run builds one layer: docs/benchmark.md, "The encoder section".
"""

import copy
import itertools
import time
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

import fused_vision
from fused_vision.encoder.attention import attention_path

from .measure import Peak, call_peak, interleaved_times, synchronize, tensor_bytes
from .ops import Unsupported, compile_static
from .rows import timing_row
from .tower import VISION_TOWERS, build_tower, tower_shape
from .workloads import PATCH_FEATURES, PATCH_SIZE, POOLING_KERNEL, Case

ENCODER_TOWERS = {"encoder_e2b_e4b": "tower_e2b_e4b", "encoder_26b_31b": "tower_26b_31b"}
ENCODER_PROVIDERS = ("stock", "compiled", "padded", "packed", "fused", "graphed")
GRAPH_BUCKET_ROWS = 1024  # ``graphed``: one bucket, the mix's real patches rounded up to a multiple of this
ASPECT_RATIOS = ((4, 3), (3, 4), (16, 9), (9, 16), (1, 1), (3, 1), (1, 3))  # (width, height)
VIDEO_ASPECT_RATIO = (16, 9)
SIDE_UNIT_PX = 80  # a (w, h) image is w·80 x h·80 pixels (16:9: 1280x720); the processor resizes it to its budget
CPU_LAYERS = 1
REPS = {"cpu": 3, "cuda": 10}
QUICK_REPS = {"cpu": 1, "cuda": 3}


@dataclass(frozen=True)
class Mix:
    """A case's items as transformers' Gemma 4 image processor hands them to the tower."""

    case: Case

    @property
    def name(self) -> str:
        case = self.case
        return f"image_mix_{case.items}x{case.soft_tokens}" if case.kind == "image" else case.name

    @property
    def aspect_ratios(self) -> list[tuple[int, int]]:
        if self.case.kind == "video":
            return [VIDEO_ASPECT_RATIO] * self.case.items
        return list(itertools.islice(itertools.cycle(ASPECT_RATIOS), self.case.items))

    def inputs(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, N, 768) float32 pixels and (B, N, 2) int64 ids from the processor, on ``device``."""
        try:
            from PIL import Image
            from transformers import Gemma4ImageProcessorPil
        except ImportError as exc:
            raise Unsupported(f"needs transformers' Gemma4ImageProcessorPil and Pillow ({exc})") from exc
        rng = np.random.default_rng(0)
        images = [
            Image.fromarray(rng.integers(0, 256, (h * SIDE_UNIT_PX, w * SIDE_UNIT_PX, 3), dtype=np.uint8))
            for w, h in self.aspect_ratios
        ]
        processor = Gemma4ImageProcessorPil(patch_size=PATCH_SIZE, pooling_kernel_size=POOLING_KERNEL)
        batch = processor(images, max_soft_tokens=self.case.soft_tokens, return_tensors="pt")
        return batch["pixel_values"].to(device), batch["image_position_ids"].to(device)


def encoder_shape(op: str, device: torch.device, tiny: bool) -> dict:
    """The tower's shape as this run builds it: its layers cut to ``CPU_LAYERS`` on a CPU."""
    shape = tower_shape(ENCODER_TOWERS[op], tiny=tiny)
    if device.type == "cpu":
        shape["num_hidden_layers"] = min(shape["num_hidden_layers"], CPU_LAYERS)
    return shape


def layer_note(op: str, layers: int, tiny: bool) -> str:
    """The layers a run built, and why where fewer than the tower's."""
    full = VISION_TOWERS[ENCODER_TOWERS[op]]["num_hidden_layers"]
    if layers == full:
        return f"all {full} layers"
    if tiny:
        return f"{layers} of its {full} layers (--tiny)"
    cost = "each layer costs the same, so the ratios hold up to the embedder's and pooler's share of a call"
    return f"{layers} of its {full} layers (a CPU run: {cost})"


def encoder_flops(shape: dict, patches: list[int]) -> int:
    """FLOPs of one tower call of ``shape`` on items of ``patches`` tokens each, every item attending over its
    own tokens: the embedder's projection, then per layer the q/k/v, o, gate/up and down GEMMs and the
    attention's two matmuls (the norms, RoPE, GELU and pooler are a rounding error)."""
    hidden, intermediate, head_dim = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    tokens = sum(patches)
    gemms = 2 * tokens * hidden * ((heads + 2 * kv_heads) * head_dim + heads * head_dim + 3 * intermediate)
    attention = 4 * sum(n * n for n in patches) * heads * head_dim
    return 2 * tokens * PATCH_FEATURES * hidden + shape["num_hidden_layers"] * (gemms + attention)


def fused_backend(device: torch.device) -> str:
    # Triton, so that a failing kernel raises rather than time the reference as fused; a CPU's is an interpreter.
    return "reference" if device.type == "cpu" else "triton"


def fused_tower(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """A deep copy of ``model`` running the fused encoder (default embedder and pooler too): the other
    providers keep the stock tower, and the copy's concatenated weights share no storage with it."""
    from fused_vision.integrations.transformers import apply_fused_vision_to_gemma4

    fused = copy.deepcopy(model)
    apply_fused_vision_to_gemma4(fused, encoder="fused", backend=fused_backend(device))
    return fused


def provider_call(provider: str, towers: dict, pixels: torch.Tensor, ids: torch.Tensor):
    """The call ``provider`` times, on ``towers[provider]`` (the stock tower where it has none of its own):
    every one without autograd, as ``encode_images`` runs."""
    model = towers.get(provider, towers["stock"])
    if provider == "graphed":  # the fused tower's layers replayed from a CUDA graph; each call counts its items
        real = int((ids != -1).any(dim=-1).sum())
        rows = -(-real // GRAPH_BUCKET_ROWS) * GRAPH_BUCKET_ROWS
        graphed = fused_vision.GraphedEncoder(towers["fused"], token_buckets=(rows,), max_items=ids.shape[0])
        return partial(graphed, list(pixels), list(ids))
    if provider in ("padded", "packed", "fused"):
        return partial(fused_vision.encode_images, model, pixels, ids, packed=provider != "padded")
    if provider == "compiled":
        torch._dynamo.reset()  # a fresh compile per mix: its time is the mix's own
    forward = compile_static(model) if provider == "compiled" else model

    @torch.no_grad()
    def call():
        return forward(pixel_values=pixels, pixel_position_ids=ids).last_hidden_state

    return call


def attention_taken(provider: str, tower: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> str:
    """The attention ``provider``'s calls run: the packed providers' varlen path, or the tower's own on the padded
    batch with its mask."""
    config = tower.config
    if provider in ("packed", "fused", "graphed"):
        heads = torch.empty(0, config.num_attention_heads, config.head_dim, dtype=dtype, device=device)
        return attention_path(heads)
    return f"{config._attn_implementation} (padded, masked)"


def flat(output) -> torch.Tensor:
    """Soft tokens as one (sum T_i, D) tensor: stock's ``last_hidden_state``, or encode_images' list joined."""
    return torch.cat(output) if isinstance(output, list) else output


def bench_encoder(session, op: str, providers: tuple[str, ...], encoder_cases: tuple[Case, ...]) -> None:
    """Every chosen provider of one encoder at every mix, repetitions interleaved across the providers."""
    device, tiny = session.options.device, session.options.tiny
    providers = tuple(p for p in ENCODER_PROVIDERS if p in providers)
    if not providers:
        return
    shape = encoder_shape(op, device, tiny)
    hidden, layers = shape["hidden_size"], shape["num_hidden_layers"]

    def skip_all(mixes, reason):
        for mix in mixes:
            for provider in providers:
                session.skip(op, provider, mix, hidden, reason)

    inputs = {}
    for mix in map(Mix, encoder_cases):
        try:
            inputs[mix] = mix.inputs(device)
        except Exception as exc:  # no processor or Pillow, a soft-token budget it does not take: a logged skip
            skip_all((mix,), exc)
    if not inputs:
        return
    if session.out_of_time():  # before building it: a 26B/31B tower takes seconds to initialise
        return skip_all(inputs, session.time_budget_reason())
    note = layer_note(op, layers, tiny)
    session.log(f"{op}: building {ENCODER_TOWERS[op]} with {note}; random weights, {session.dtype_name}, sdpa")
    torch.manual_seed(0)  # the compiled section builds it again: the same weights
    try:
        towers = {"stock": build_tower(ENCODER_TOWERS[op], device, session.dtype, tiny=tiny, layers=layers)}
    except Exception as exc:
        return skip_all(inputs, exc)
    if {"fused", "graphed"} & set(providers):
        try:
            towers["fused"] = fused_tower(towers["stock"], device)
            session.log(
                f"  fused: a copy of it under apply_fused_vision_to_gemma4(encoder='fused'), "
                f"backend {fused_backend(device)!r}"
            )
        except Exception as exc:  # no fused tower on this transformers: the other providers still run
            for mix in inputs:
                for provider in {"fused", "graphed"} & set(providers):
                    session.skip(op, provider, mix, hidden, exc)
            providers = tuple(p for p in providers if p not in ("fused", "graphed"))
    for mix, (pixels, ids) in inputs.items():
        if session.out_of_time():
            skip_all((mix,), session.time_budget_reason())
            continue
        items, patches = ids.shape[:2]
        real = (ids != -1).any(dim=-1).sum(dim=1).tolist()
        useful, executed = encoder_flops(shape, real), encoder_flops(shape, [patches] * items)
        session.log(
            f"  {op} {mix.name}: {items} items of N={patches} patches, "
            f"{100 * sum(real) / (items * patches):.1f}% real; aspect ratios "
            f"{', '.join(f'{w}:{h}' for w, h in dict.fromkeys(mix.aspect_ratios))}; "
            f"{useful / 1e9:.3g} GFLOP on real patches, {executed / useful:.2f}× that padded"
        )
        fields = dict(D=hidden, layers=layers, real_patches=sum(real))
        measure_mix(session, op, providers, mix, towers, pixels, ids, fields, useful)
    del towers, inputs
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure_mix(session, op, providers, mix, towers: dict, pixels, ids, fields: dict, flops: int) -> None:
    """Each provider's untimed first calls (a warm-up on a GPU, then its peak), then the interleaved repetitions;
    ``flops``, the call's useful FLOPs, give every provider's FLOP rate."""
    device = session.options.device
    calls: dict[str, object] = {}
    measured: dict[str, tuple[Peak, int, float]] = {}
    attention: dict[str, str] = {}
    first: tuple[str, torch.Tensor] | None = None
    for index, provider in enumerate(providers):
        longest = max((first_call_s for _, _, first_call_s in measured.values()), default=0.0)
        # This first call, the others left and one round, each call as long as the longest first call so far.
        if session.out_of_time(ahead_s=longest * (2 * len(providers) - index)):
            for skipped in providers:
                session.skip(op, skipped, mix, fields["D"], session.time_budget_reason())
            return
        failure = None
        try:
            call = provider_call(provider, towers, pixels, ids)
            start = time.perf_counter()
            if device.type == "cuda":  # compiles and cuBLAS's workspace stay out of the peak
                call()
            peak, output = call_peak(call, device)  # on a CPU, the first call warms up too
            synchronize(device)
            first_call_s = time.perf_counter() - start
        except Exception as exc:  # an out-of-memory error, a compile this stack fails: a logged skip
            failure = exc
        if failure is not None:  # skipped outside the handler, whose traceback holds the call's tensors
            session.skip(op, provider, mix, fields["D"], failure)
            continue
        calls[provider] = call
        measured[provider] = (peak, tensor_bytes(output), first_call_s)
        attention[provider] = attention_taken(provider, towers["stock"], session.dtype, device)
        session.log(f"    {provider}: attention {attention[provider]}, first call {first_call_s:.2f} s")
        first = first or (provider, flat(output))
        if first[0] != provider:
            difference = (flat(output).float() - first[1].float()).abs().max().item()
            scale = first[1].float().abs().max().item()
            session.log(f"    {provider} vs {first[0]} output: max |diff| {difference:.3g} (max |value| {scale:.3g})")
        del output
    if not calls:
        return
    if session.out_of_time(ahead_s=sum(first_call_s for _, _, first_call_s in measured.values())):
        for provider in calls:  # a first round as long as the first calls would end past the budget
            session.skip(op, provider, mix, fields["D"], session.time_budget_reason())
        return
    reps = (QUICK_REPS if session.options.quick else REPS)[device.type]
    failure = None
    try:
        times = interleaved_times(calls, device, reps, session.deadline)
    except Exception as exc:  # one provider's failure stops the rounds of all: none has its reps
        failure = exc
    if failure is not None:
        for provider in calls:
            session.skip(op, provider, mix, fields["D"], failure)
        return
    items = ids.shape[0]
    for provider, (peak, output_bytes, first_call_s) in measured.items():
        ms = times[provider]
        rates = session.rates(ms.p50, 0, flops, floor=False)  # the tables show a share of matmul, not a floor
        row = timing_row(
            op,
            provider,
            mix.name,
            session.dtype_name,
            ms,
            peak=peak,
            B=items,
            N=ids.shape[1],
            output_bytes=output_bytes,
            items_per_s=items / ms.p50 * 1e3,
            attention=attention[provider],
            **fields,
            **rates,
        )
        session.record(row, first_call_s)
    for provider, call in calls.items():
        session.profile(op, provider, mix, call)
