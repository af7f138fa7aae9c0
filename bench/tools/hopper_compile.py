"""Compile every Triton kernel for Hopper (sm_90a) with no GPU, at the launch configs a GPU gets, and
report what each costs: shared memory, registers, spills, and the matrix instruction its dots became.

    python bench/tools/hopper_compile.py [--out DIR] [--fp-fusion]

Triton lowers to PTX on any machine and its bundled ptxas assembles it; registers and spills are read
off that ptxas run's own log, so they are the binary's a GPU would load, built with the ptxas and flags
Triton chose (both change between Triton releases). This catches what the CPU interpreter cannot:
kernels that do not compile for the GPU, tiles that overflow shared memory, register spills, and a
half-precision embedder GEMM that misses Hopper's asynchronous tensor cores (wgmma), which would cap
it far below the GEMM floor; with --fp-fusion, also arithmetic whose result depends on fp fusion
(each kernel built again with fusion flipped must hold the same fma count in its PTX: fused, a * b + c
rounds once; Triton 3.10 stops fusing by default). The arguments are the launchers' own, captured from
calls on small CPU tensors (B=2, N=63, D=1152, K=768; the pooler's slot pass, whose blocks grow with
N, at N=2520 and 10080), so the specialisations match a real launch. Exits 1 when a kernel does not
compile, overflows shared memory, spills registers, builds no wgmma (the bf16/fp16 embedder) or, with
--fp-fusion, fma that fusion decides.
Must run without TRITON_INTERPRET (it changes what @triton.jit builds).
"""

import argparse
import csv
import io
import re
import sys
from contextlib import ExitStack, redirect_stdout
from pathlib import Path
from unittest import mock

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fused_vision import reference
from fused_vision.kernels import gelu_gate as gelu_gate_kernels
from fused_vision.kernels import patch_embed as patch_embed_kernels
from fused_vision.kernels import pool_by_positions as pool_by_positions_kernels
from fused_vision.kernels import position_embeddings as position_embeddings_kernels
from fused_vision.kernels import qkv_norm_rope as qkv_norm_rope_kernels
from fused_vision.kernels import residual_rms_norm as residual_rms_norm_kernels
from fused_vision.kernels.common import interpreting

HOPPER = GPUTarget("cuda", 90, 32)
SHARED_MEMORY_PER_BLOCK = 232_448  # bytes one block may use on sm_90
POINTER_TYPES = {
    torch.float32: "*fp32",
    torch.float16: "*fp16",
    torch.bfloat16: "*bf16",
    torch.int64: "*i64",
    torch.int32: "*i32",
    torch.uint8: "*u8",
}
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BATCH, PATCHES, HIDDEN, FEATURES, POSITIONS = 2, 63, 1152, 768, 64
POOLER_KERNELS = ("_patch_slots_kernel", "_pool_by_positions_tuned")
# The encoder layers' shapes: (hidden, heads, head_dim, intermediate) of the 1152- and 768-wide towers.
LAYER_SHAPES = ((1152, 16, 72, 4304), (768, 12, 64, 3072))


class Capture:
    """Stands in for a kernel or its autotuner: records launches instead of running them."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((args, kwargs))


def capture_launches(module, attributes: tuple[str, ...], call) -> list[tuple[tuple, dict]]:
    """The (args, kwargs) of the one launch ``call`` makes of each kernel (or autotuner) of ``module``
    named in ``attributes``, in that order, on the GPU's code path."""
    captures = [Capture() for _ in attributes]
    with ExitStack() as stack:
        stack.enter_context(mock.patch.object(module, "interpreting", lambda: False))
        for attribute, capture in zip(attributes, captures):
            stack.enter_context(mock.patch.object(module, attribute, capture))
        call()
    for attribute, capture in zip(attributes, captures):
        if len(capture.launches) != 1:
            raise RuntimeError(f"{module.__name__}.{attribute}: expected one launch, got {len(capture.launches)}")
    return [capture.launches[0] for capture in captures]


def compile_for_hopper(kernel, args: tuple, kwargs: dict, fp_fusion: bool | None = None):
    """Compile as the JIT would for these arguments: ints equal to 1 become constants, pointers and
    values divisible by 16 are marked so; ``fp_fusion``: Triton's default, or forced on or off. Returns
    the compiled kernel and its ptxas -v log."""
    kwargs = dict(kwargs)
    options = {key: kwargs.pop(key) for key in ("num_warps", "num_stages", "enable_fp_fusion") if key in kwargs}
    if fp_fusion is not None:
        options["enable_fp_fusion"] = fp_fusion
    values = dict(zip(kernel.arg_names, args)) | kwargs
    signature, constants, attrs = {}, {}, {}
    for index, name in enumerate(kernel.arg_names):
        value = values[name]
        if index in kernel.constexprs or (type(value) is int and value == 1):
            signature[name], constants[(index,)] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = POINTER_TYPES[value.dtype]
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
    # Build afresh (a cache hit runs no ptxas) and keep the log Triton's ptxas -v writes.
    log = io.StringIO()
    with triton.knobs.compilation.scope(), triton.knobs.nvidia.scope(), redirect_stdout(log):
        triton.knobs.compilation.always_compile = True
        triton.knobs.nvidia.dump_ptxas_log = True
        compiled = triton.compile(source, target=HOPPER, options=options)
    return compiled, log.getvalue()


def ptxas_resources(ptxas_log: str) -> tuple[int, int]:
    """(registers per thread, spill bytes) as ptxas -v reports them."""
    registers = re.search(r"Used (\d+) registers", ptxas_log)
    if registers is None:
        raise RuntimeError(f"no register count in Triton's ptxas log: {ptxas_log[-500:]!r}")
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", ptxas_log))
    return int(registers.group(1)), spills


def matrix_instructions(ptx: str) -> str:
    """The tensor-core instructions a kernel's dots became, e.g. "wgmma m64n128k16 bf16"; "none" for
    a kernel without dots or with ieee fp32 dots, which run on the FMA units."""
    shapes = sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)\.f32\.(\w+)\.", ptx)))
    if shapes:
        return " ".join(f"wgmma {shape} {dtype}" for shape, dtype in shapes)
    return "mma.sync" if "mma.sync" in ptx else "none"


def fused_multiply_adds(ptx: str) -> int:
    """How many fma instructions the PTX holds: the fp32 ieee dots' own, and any a * b + c that Triton
    fused, which rounds once where the unfused pair rounds twice."""
    return len(re.findall(r"^\s*fma\.", ptx, flags=re.MULTILINE))


def name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tuned_launches(dtype_label: str, configs: list[triton.Config]):
    """(variant, launch meta-parameters) of each autotune candidate; blocks named in the config's order."""
    for config in configs:
        blocks = "x".join(map(str, config.kwargs.values()))
        variant = f"{dtype_label}, {blocks}, {config.num_warps} warps, {config.num_stages} stages"
        yield variant, dict(config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages)


def layer_launches(dtype: torch.dtype):
    """(kernel, variant, jit function, args, kwargs) of the encoder layer's kernels in ``dtype``."""
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
            yield "qkv_norm_rope", label, qkv_norm_rope_kernels._qkv_norm_rope_kernel, args, kwargs

            label = f"{name(dtype)}, I={intermediate}{', clamps' if clipped is not None else ''}"
            call = lambda: gelu_gate_kernels.gelu_gate(gate_up, clipped)
            ((args, kwargs),) = capture_launches(gelu_gate_kernels, ("_gelu_gate_kernel",), call)
            yield "gelu_gate", label, gelu_gate_kernels._gelu_gate_kernel, args, kwargs
        for next_weight in (norm_weight, None):
            label = f"{name(dtype)}, D={hidden}{'' if next_weight is not None else ', last layer'}"
            call = lambda: residual_rms_norm_kernels.residual_rms_norm(x, x, norm_weight, next_weight, 1e-6)
            ((args, kwargs),) = capture_launches(residual_rms_norm_kernels, ("_residual_rms_norm_kernel",), call)
            yield "residual_rms_norm", label, residual_rms_norm_kernels._residual_rms_norm_kernel, args, kwargs


def launches():
    """(kernel, variant, jit function, args, kwargs) for every kernel and GPU launch config."""
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
        yield (
            "patch_slots",
            f"N={seq_len}, L={output_length}",
            pool_by_positions_kernels._patch_slots_kernel,
            args,
            kwargs,
        )
    for dtype in DTYPES:
        yield from layer_launches(dtype)
        table = torch.randn(2, POSITIONS, HIDDEN).to(dtype)
        for residual in (None, torch.randn(BATCH, PATCHES, HIDDEN).to(dtype)):
            call = lambda: position_embeddings_kernels.position_embeddings(table, ids, padding, residual)
            ((args, kwargs),) = capture_launches(position_embeddings_kernels, ("_position_embeddings_kernel",), call)
            variant = f"{name(dtype)}{' + residual' if residual is not None else ''}"
            yield "position_embeddings", variant, position_embeddings_kernels._position_embeddings_kernel, args, kwargs

        grad = torch.randn(BATCH, PATCHES, HIDDEN).to(dtype)
        call = lambda: position_embeddings_kernels.table_grad(grad, ids, padding, POSITIONS)
        ((args, kwargs),) = capture_launches(position_embeddings_kernels, ("_table_grad_kernel",), call)
        yield "table_grad", name(dtype), position_embeddings_kernels._table_grad_kernel, args, kwargs

        hidden_states = torch.randn(BATCH, PATCHES, HIDDEN).to(dtype)
        call = lambda: pool_by_positions_kernels.pool_by_positions(hidden_states, ids, padding, PATCHES // 9, 3)
        _, (args, kwargs) = capture_launches(pool_by_positions_kernels, POOLER_KERNELS, call)
        # Both roundings of the average: transformers' (rounded to the dtype) and EmbeddingGemma2's (fp32).
        averages = ((True, ""), (False, ", fp32 average"))
        for variant, meta in tuned_launches(name(dtype), pool_by_positions_kernels.gpu_configs(dtype)):
            for rounded, label in averages:
                launch = kwargs | meta | {"ROUND_AVERAGE": rounded}
                yield (
                    "pool_by_positions",
                    variant + label,
                    pool_by_positions_kernels._pool_by_positions_kernel,
                    args,
                    launch,
                )

        grad_pooled = torch.randn(BATCH, PATCHES // 9, HIDDEN)
        call = lambda: pool_by_positions_kernels.hidden_states_grad(grad_pooled, ids, padding, 3, dtype)
        _, (args, kwargs) = capture_launches(
            pool_by_positions_kernels, ("_patch_slots_kernel", "_hidden_states_grad_kernel"), call
        )
        for rounded, label in averages:
            launch = kwargs | {"ROUND_AVERAGE": rounded}
            yield (
                "pool_backward",
                name(dtype) + label,
                pool_by_positions_kernels._hidden_states_grad_kernel,
                args,
                launch,
            )

        weight = torch.randn(HIDDEN, FEATURES).to(dtype)
        # fp16 pixels take a branch of their own in the prologue (the fp16 doubling)
        half_pixels = (torch.float32, torch.bfloat16, torch.float16)
        for pixel_dtype in half_pixels if dtype == torch.bfloat16 else (torch.float32,):
            pixels = torch.rand(BATCH, PATCHES, FEATURES).to(pixel_dtype)
            call = lambda: patch_embed_kernels.patch_embed(pixels, weight, table, ids, padding)
            ((args, kwargs),) = capture_launches(patch_embed_kernels, ("_patch_embed_tuned",), call)
            dtype_label = f"{name(dtype)}, {name(pixel_dtype)} pixels"
            for variant, meta in tuned_launches(dtype_label, patch_embed_kernels.gpu_configs(dtype)):
                yield "patch_embed", variant, patch_embed_kernels._patch_embed_kernel, args, kwargs | meta


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="also write hopper_compile.csv here")
    parser.add_argument(
        "--fp-fusion",
        action="store_true",
        help="also build each kernel with fp fusion flipped and compare (twice the time)",
    )
    args = parser.parse_args()
    if interpreting():
        sys.exit("hopper_compile: unset TRITON_INTERPRET; the interpreter's @triton.jit builds nothing to compile")

    rows, failed = [], False
    for kernel_name, variant, kernel, launch_args, launch_kwargs in launches():
        row = dict(kernel=kernel_name, variant=variant, shared_bytes="", registers="", spill_bytes="", mma="", fmas="")
        try:
            compiled, ptxas_log = compile_for_hopper(kernel, launch_args, launch_kwargs)
            registers, spills = ptxas_resources(ptxas_log)
            fmas = {}
            if args.fp_fusion and "enable_fp_fusion" not in launch_kwargs:  # a launch that sets it is exempt
                # Built again with the other fp-fusion setting (Triton 3.10 turns it off by default): the
                # results may not depend on it, so the fused multiply-adds must be the same.
                fused = compiled.metadata.enable_fp_fusion
                other, _ = compile_for_hopper(kernel, launch_args, launch_kwargs, fp_fusion=not fused)
                fmas = {
                    fused: fused_multiply_adds(compiled.asm["ptx"]),
                    not fused: fused_multiply_adds(other.asm["ptx"]),
                }
        except Exception as exc:  # a kernel that does not compile for the GPU is this script's finding
            row["status"] = f"does not compile: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            failed = True
        else:
            mma = matrix_instructions(compiled.asm["ptx"])
            fits = compiled.metadata.shared <= SHARED_MEMORY_PER_BLOCK and spills == 0
            needs_wgmma = kernel_name == "patch_embed" and not variant.startswith("float32")
            row |= dict(shared_bytes=compiled.metadata.shared, registers=registers, spill_bytes=spills, mma=mma)
            row["fmas"] = f"{fmas[True]}/{fmas[False]}" if fmas else ""
            if not fits:
                row["status"] = "DOES NOT FIT"
            elif needs_wgmma and "wgmma" not in mma:
                row["status"] = "NO WGMMA"
            elif fmas and fmas[True] != fmas[False]:
                row["status"] = "FUSION CHANGES RESULTS"
            else:
                row["status"] = "ok"
            failed |= row["status"] != "ok"
        rows.append(row)
        print(
            f"{kernel_name:18} {variant:50} smem {row['shared_bytes']!s:>7} regs {row['registers']!s:>4} "
            f"spills {row['spill_bytes']!s:>4}  {row['mma'] or '-':24} fma {row['fmas'] or '-':>9} {row['status']}",
            flush=True,
        )
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / "hopper_compile.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
