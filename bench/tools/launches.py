"""Every launch the kernels can make on a GPU, captured from the launchers' own calls on small CPU tensors
(B=2, N=63, D=1152, K=768; the pooler's slot pass, whose blocks grow with N, at N=2520 and 10080; the
encoder layers of both towers), so a build's specialisations match a real launch: forward and backward,
every shape class the launchers tell apart, and every autotune candidate of every dtype.
"""

import sys
from collections.abc import Callable
from contextlib import ExitStack
from typing import NamedTuple
from unittest import mock

import torch
import triton

from fused_vision import reference
from fused_vision._device import DeviceLimits
from fused_vision.kernels import gate_up_gelu as gate_up_gelu_kernels
from fused_vision.kernels import gelu_gate as gelu_gate_kernels
from fused_vision.kernels import patch_embed as patch_embed_kernels
from fused_vision.kernels import pool_by_positions as pool_by_positions_kernels
from fused_vision.kernels import position_embeddings as position_embeddings_kernels
from fused_vision.kernels import qkv_norm_rope as qkv_norm_rope_kernels
from fused_vision.kernels import residual_rms_norm as residual_rms_norm_kernels

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BATCH, PATCHES, HIDDEN, FEATURES, POSITIONS = 2, 63, 1152, 768, 64
POOLER_KERNELS = ("_patch_slots_kernel", "_pool_by_positions_kernel")
# The encoder layers' shapes: (hidden, heads, head_dim, intermediate) of the 1152- and 768-wide towers.
LAYER_SHAPES = ((1152, 16, 72, 4304), (768, 12, 64, 3072))


class Launch(NamedTuple):
    kernel: str
    variant: str
    fn: triton.JITFunction
    args: tuple
    kwargs: dict
    # Whether the launcher offers this config on a device with these limits: fixed launches always do.
    offered: Callable[[DeviceLimits], bool] = lambda limits: True


class Capture:
    """Stands in for a kernel or its autotuner: records launches instead of running them."""

    def __init__(self):
        self.launches, self.grids = [], []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((args, kwargs))
            self.grids.append(grid)

        return launch


def programs(grid, meta: dict) -> int:
    """How many programs a launch's grid (a tuple, or a function of the meta-parameters) holds."""
    count = 1
    for size in grid(meta) if callable(grid) else grid:
        count *= size
    return count


def capture_launches(module, attributes: tuple[str, ...], call, grids: list | None = None) -> list[tuple[tuple, dict]]:
    """The (args, kwargs) of the one launch ``call`` makes of each kernel (or autotuner) of ``module``
    named in ``attributes``, in that order, on the GPU's code path; their grids appended to ``grids``."""
    captures = [Capture() for _ in attributes]
    with ExitStack() as stack:
        stack.enter_context(mock.patch.object(module, "interpreting", lambda: False))
        for attribute, capture in zip(attributes, captures):
            stack.enter_context(mock.patch.object(module, attribute, capture))
        call()
    for attribute, capture in zip(attributes, captures):
        if len(capture.launches) != 1:
            raise RuntimeError(f"{module.__name__}.{attribute}: expected one launch, got {len(capture.launches)}")
    if grids is not None:
        grids.extend(capture.grids[0] for capture in captures)
    return [capture.launches[0] for capture in captures]


def with_heuristics(kernel: triton.JITFunction, args: tuple, kwargs: dict) -> dict:
    """``kwargs`` and the meta-parameters its kernel module's ``HEURISTICS`` derive from the call."""
    heuristics = getattr(sys.modules[kernel.fn.__module__], "HEURISTICS", {})
    values = dict(zip(kernel.arg_names, args)) | kwargs
    return kwargs | {name: rule(values) for name, rule in heuristics.items()}


def name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tuned_launches(module, dtype: torch.dtype, dtype_label: str):
    """(variant, launch meta-parameters, offered) of each autotune candidate of ``module`` for ``dtype``,
    blocks named in the config's order."""
    for config in module.gpu_configs(dtype):
        blocks = "x".join(map(str, config.kwargs.values()))
        variant = f"{dtype_label}, {blocks}, {config.num_warps} warps, {config.num_stages} stages"
        meta = dict(config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages)
        yield variant, meta, lambda limits, config=config: config in module.gpu_configs(dtype, limits)


def layer_launches(dtype: torch.dtype):
    """The encoder layer's kernels in ``dtype``, at both towers' shapes, with and without clamps."""
    tokens = BATCH * PATCHES
    clamps = torch.tensor([[-1.0, 1.0]] * 3)
    ids = torch.randint(0, POSITIONS, (tokens, 2))
    for hidden, heads, head_dim, intermediate in LAYER_SHAPES:
        qkv = torch.randn(tokens, 3 * heads * head_dim).to(dtype)
        weight, inv_freq = torch.ones(head_dim).to(dtype), torch.ones(head_dim // 4)
        x = torch.randn(tokens, hidden).to(dtype)
        norm_weight = torch.ones(hidden).to(dtype)
        gate_up = torch.randn(tokens, 2 * intermediate).to(dtype)
        for clipped in (None, clamps):
            label = f"{name(dtype)}, d={head_dim}{', clamps' if clipped is not None else ''}"
            call = lambda: qkv_norm_rope_kernels.qkv_norm_rope(
                qkv, ids, weight, weight, inv_freq, heads, heads, 1e-6, clipped
            )
            ((args, kwargs),) = capture_launches(qkv_norm_rope_kernels, ("_qkv_norm_rope_kernel",), call)
            yield Launch("qkv_norm_rope", label, qkv_norm_rope_kernels._qkv_norm_rope_kernel, args, kwargs)

            label = f"{name(dtype)}, I={intermediate}{', clamps' if clipped is not None else ''}"
            call = lambda: gelu_gate_kernels.gelu_gate(gate_up, clipped)
            ((args, kwargs),) = capture_launches(gelu_gate_kernels, ("_gelu_gate_kernel",), call)
            yield Launch("gelu_gate", label, gelu_gate_kernels._gelu_gate_kernel, args, kwargs)
            # float32 keeps cuBLAS and the gate kernel; the clamps, an epilogue's few loads, on E2B/E4B's shape alone
            if dtype != torch.float32 and (clipped is not None) == (hidden == 768):
                gate_up_weight = torch.randn(2 * intermediate, hidden).to(dtype)
                call = lambda: gate_up_gelu_kernels.gate_up_gelu(x, gate_up_weight, clipped)
                ((args, kwargs),) = capture_launches(gate_up_gelu_kernels, ("_gate_up_gelu_tuned",), call)
                for variant, meta, offered in tuned_launches(gate_up_gelu_kernels, dtype, label):
                    kernel = gate_up_gelu_kernels._gate_up_gelu_kernel
                    yield Launch(
                        "gate_up_gelu", variant, kernel, args, with_heuristics(kernel, args, kwargs | meta), offered
                    )
        for next_weight in (norm_weight, None):
            label = f"{name(dtype)}, D={hidden}{'' if next_weight is not None else ', last layer'}"
            call = lambda: residual_rms_norm_kernels.residual_rms_norm(x, x, norm_weight, next_weight, 1e-6)
            ((args, kwargs),) = capture_launches(residual_rms_norm_kernels, ("_residual_rms_norm_kernel",), call)
            yield Launch("residual_rms_norm", label, residual_rms_norm_kernels._residual_rms_norm_kernel, args, kwargs)


def launches():
    """Every kernel at every launch config a GPU can get."""
    torch.manual_seed(0)
    ids = torch.randint(0, POSITIONS, (BATCH, PATCHES, 2))
    padding = reference.default_padding_positions(ids)
    # The slot pass's blocks grow with N and L, and it never sees the hidden states: real image sizes.
    for seq_len, output_length in ((2520, 280), (10080, 1120)):
        item_ids = torch.randint(0, POSITIONS, (1, seq_len, 2))
        item_padding = reference.default_padding_positions(item_ids)
        hidden_states = torch.randn(1, seq_len, 16)
        call = lambda: pool_by_positions_kernels.pool_by_positions(
            hidden_states, item_ids, item_padding, output_length, 3
        )
        (args, kwargs), _ = capture_launches(pool_by_positions_kernels, POOLER_KERNELS, call)
        variant = f"N={seq_len}, L={output_length}"
        yield Launch("patch_slots", variant, pool_by_positions_kernels._patch_slots_kernel, args, kwargs)
    for dtype in DTYPES:
        yield from layer_launches(dtype)
        table = torch.randn(2, POSITIONS, HIDDEN).to(dtype)
        for residual in (None, torch.randn(BATCH, PATCHES, HIDDEN).to(dtype)):
            call = lambda: position_embeddings_kernels.position_embeddings(table, ids, padding, residual)
            ((args, kwargs),) = capture_launches(position_embeddings_kernels, ("_position_embeddings_kernel",), call)
            variant = f"{name(dtype)}{' + residual' if residual is not None else ''}"
            yield Launch(
                "position_embeddings", variant, position_embeddings_kernels._position_embeddings_kernel, args, kwargs
            )

        grad = torch.randn(BATCH, PATCHES, HIDDEN).to(dtype)
        call = lambda: position_embeddings_kernels.position_embeddings_backward(grad, ids, padding, POSITIONS)
        ((args, kwargs),) = capture_launches(
            position_embeddings_kernels, ("_position_embeddings_backward_kernel",), call
        )
        yield Launch(
            "position_embeddings_backward",
            name(dtype),
            position_embeddings_kernels._position_embeddings_backward_kernel,
            args,
            kwargs,
        )

        hidden_states = torch.randn(BATCH, PATCHES, HIDDEN).to(dtype)
        call = lambda: pool_by_positions_kernels.pool_by_positions(hidden_states, ids, padding, PATCHES // 9, 3)
        _, (args, kwargs) = capture_launches(pool_by_positions_kernels, POOLER_KERNELS, call)
        # Both roundings of the average: transformers' (rounded to the dtype) and EmbeddingGemma2's (fp32).
        averages = ((True, ""), (False, ", fp32 average"))
        for rounded, label in averages:
            launch = kwargs | {"ROUND_AVERAGE": rounded}
            kernel = pool_by_positions_kernels._pool_by_positions_kernel
            yield Launch("pool_by_positions", name(dtype) + label, kernel, args, launch)

        grad_pooled = torch.randn(BATCH, PATCHES // 9, HIDDEN)
        call = lambda: pool_by_positions_kernels.pool_by_positions_backward(grad_pooled, ids, padding, 3, dtype)
        _, (args, kwargs) = capture_launches(
            pool_by_positions_kernels, ("_patch_slots_kernel", "_pool_by_positions_backward_kernel"), call
        )
        for rounded, label in averages:
            launch = kwargs | {"ROUND_AVERAGE": rounded}
            kernel = pool_by_positions_kernels._pool_by_positions_backward_kernel
            yield Launch("pool_by_positions_backward", name(dtype) + label, kernel, args, launch)

        weight = torch.randn(HIDDEN, FEATURES).to(dtype)
        # fp16 pixels take a branch of their own in the prologue (the fp16 doubling)
        half_pixels = (torch.float32, torch.bfloat16, torch.float16)
        for pixel_dtype in half_pixels if dtype == torch.bfloat16 else (torch.float32,):
            pixels = torch.rand(BATCH, PATCHES, FEATURES).to(pixel_dtype)
            call = lambda: patch_embed_kernels.patch_embed(pixels, weight, table, ids, padding)
            ((args, kwargs),) = capture_launches(patch_embed_kernels, ("_patch_embed_tuned",), call)
            dtype_label = f"{name(dtype)}, {name(pixel_dtype)} pixels"
            for variant, meta, offered in tuned_launches(patch_embed_kernels, dtype, dtype_label):
                kernel = patch_embed_kernels._patch_embed_kernel
                meta = with_heuristics(kernel, args, kwargs | meta)
                yield Launch("patch_embed", variant, kernel, args, meta, offered)
