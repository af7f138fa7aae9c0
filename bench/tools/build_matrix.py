"""Compile every Triton kernel, at every launch config a GPU can get, for every architecture its users have,
with no GPU, and check what each build costs there.

    python bench/tools/build_matrix.py [--targets sm_80,gfx942,...] [--fp-fusion] [--out DIR] [--jobs N]
    python bench/tools/build_matrix.py --markdown DIR     the table of DIR's CSVs, one per Triton

Targets (bench/tools/targets.py), one or more per family: sm_75 (FMA: Triton builds no tensor-core dot there);
sm_80, sm_86, sm_87, sm_89, sm_120 and sm_121 (mma.sync); sm_90a (wgmma); sm_100a, sm_103a and sm_110a
(tcgen05); gfx90a, gfx942 and gfx950 (MFMA); gfx1100 and gfx1201 (WMMA). A target the running Triton's
compilers cannot build for is skipped, saying so (sm_110a before Triton 3.7). Triton lowers to PTX or AMDGCN
on any machine and assembles it with its bundled ptxas or LLVM: registers and spills are read off ptxas -v's
log (NVIDIA) or the code object's metadata (AMD: VGPRs, scratch, SGPR spills), so they are the binary's a GPU
would load, built by the Triton in use (allocation changes between releases). A launch
(bench/tools/launches.py) fails a target when the launcher offers it there and it:
- does not compile;
- spills registers to memory (AMD's SGPR spills into VGPR lanes are reported, not failed);
- takes more shared memory (LDS) than one block may use there;
- leaves fewer warps resident than its kernel's occupancy floor (FLOORS);
- is a bf16/fp16 GEMM and misses the target's tensor cores (wgmma, tcgen05, mma.sync, MFMA or WMMA): that
  would cap it far below the GEMM floor;
- with --fp-fusion, on sm_90a: built again with fp fusion flipped, holds a different fma count in its PTX
  (fused, a * b + c rounds once; Triton 3.10 stops fusing by default).
An autotune candidate the launcher does not offer on a target (kernels/common.py prunes by family, dtype and
shared memory) is listed there unbuilt: no GPU of that target runs it, and its builds (the GEMM tiles, the
slowest) were a quarter of the matrix. Exits 1 on any failure, or where a target whose dots take a dtype is
offered no GEMM candidate for it; one whose dots do not (Turing's bf16 and fp16, which Triton builds on the
FMA units) is listed as the op's fallback. CI (`bash .ci/run build_matrix`) runs every target but RDNA's with
the newest supported Triton (3.9) and one per family, RDNA's among them, with the oldest (3.6): as many builds
as before the eight new targets (docs/install.md). Must run without TRITON_INTERPRET (it changes what
@triton.jit builds).
"""

import argparse
import csv
import io
import multiprocessing
import re
import sys
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from contextlib import redirect_stdout
from pathlib import Path

import torch
import triton
from launches import DTYPES, Launch, launches, name
from targets import KIB, TARGETS, Target, amdgcn_resources, occupancy, ptxas_resources
from triton.compiler import ASTSource

from fused_vision.kernels import gate_up_gelu, patch_embed
from fused_vision.kernels.common import interpreting

POINTER_TYPES = {
    torch.float32: "*fp32",
    torch.float16: "*fp16",
    torch.bfloat16: "*bf16",
    torch.int64: "*i64",
    torch.int32: "*i32",
    torch.uint8: "*u8",
}
# Occupancy floors, resident warps over the SM's most. The gathers and row kernels are bound by memory:
# an eighth of the warps (16-byte loads, several rows per thread) keeps enough loads in flight to near the
# bandwidth. The GEMM tiles pipeline their loads within a block, so one block per SM suffices; so does one
# per item for the slot pass.
STREAMING, TILE, PER_ITEM = 1 / 8, 1 / 16, 1 / 16
FLOORS = {
    "position_embeddings": STREAMING,
    "position_embeddings_backward": STREAMING,
    "pool_by_positions": STREAMING,
    "pool_by_positions_backward": STREAMING,
    "gelu_gate": STREAMING,
    "residual_rms_norm": STREAMING,
    "qkv_norm_rope": STREAMING,
    "patch_embed": TILE,
    "gate_up_gelu": TILE,
    "patch_slots": PER_ITEM,
}
FIELDS = ("triton", "target", "kernel", "variant", "offered", "registers", "spill_bytes", "sgpr_spills")
FIELDS += ("shared_bytes", "occupancy", "mma", "fmas", "status")


def compile_for(target: Target, launch: Launch, fp_fusion: bool | None = None):
    """Compile as the JIT would for these arguments: ints equal to 1 become constants, pointers and
    values divisible by 16 are marked so; ``fp_fusion``: Triton's default, or forced on or off. Returns
    the compiled kernel and, on NVIDIA, its ptxas -v log."""
    kernel, kwargs = launch.fn, dict(launch.kwargs)
    # Constants a launcher derives from the device's vendor, as it would on this target.
    for constant, rule in getattr(sys.modules[kernel.fn.__module__], "BACKEND_CONSTANTS", {}).items():
        kwargs[constant] = rule(target.target.backend)
    options = {key: kwargs.pop(key) for key in ("num_warps", "num_stages", "enable_fp_fusion") if key in kwargs}
    if fp_fusion is not None:
        options["enable_fp_fusion"] = fp_fusion
    values = dict(zip(kernel.arg_names, launch.args)) | kwargs
    signature, constants, attrs = {}, {}, {}
    for index, arg in enumerate(kernel.arg_names):
        value = values[arg]
        if index in kernel.constexprs or (type(value) is int and value == 1):
            signature[arg], constants[(index,)] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[arg] = POINTER_TYPES[value.dtype]
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[arg] = "fp32"
        else:
            signature[arg] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
    # Build afresh (a cache hit runs no ptxas) and keep the log Triton's ptxas -v writes.
    log = io.StringIO()
    with triton.knobs.compilation.scope(), triton.knobs.nvidia.scope(), redirect_stdout(log):
        triton.knobs.compilation.always_compile = True
        triton.knobs.nvidia.dump_ptxas_log = True
        compiled = triton.compile(source, target=target.target, options=options)
    return compiled, log.getvalue()


def assembly(target: Target, compiled) -> str:
    return compiled.asm["amdgcn" if target.amd else "ptx"]


def matrix_instructions(target: Target, code: str) -> str:
    """The tensor-core instructions a kernel's dots became, e.g. "wgmma m64n128k16 bf16"; "none" for a
    kernel without dots or with ieee fp32 dots, which run on the FMA units."""
    shapes = sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)\.f32\.(\w+)\.", code)))
    if shapes:
        return " ".join(f"wgmma {shape} {dtype}" for shape, dtype in shapes)
    found = re.search(target.tensor_core, code) or re.search(r"mma\.sync\.aligned|tcgen05\.mma|v_mfma_\w+", code)
    return found.group(0).rstrip("._") if found else "none"


def fused_multiply_adds(ptx: str) -> int:
    """How many fma instructions the PTX holds: the fp32 ieee dots' own, and any a * b + c that Triton
    fused, which rounds once where the unfused pair rounds twice."""
    return len(re.findall(r"^\s*fma\.", ptx, flags=re.MULTILINE))


def build(target: Target, launch: Launch, fp_fusion: bool) -> dict:
    """One launch built for one target, checked: a row of the matrix."""
    offered = launch.offered(target.limits)
    row = dict.fromkeys(FIELDS, "") | dict(
        triton=triton.__version__, target=target.name, kernel=launch.kernel, variant=launch.variant, offered=offered
    )
    if not offered:
        row["status"] = "not built"
        return row
    try:
        compiled, log = compile_for(target, launch)
        shared = compiled.metadata.shared
        code = assembly(target, compiled)
        used = amdgcn_resources(code, shared) if target.amd else ptxas_resources(log, shared)
        fmas = None
        # Built again with the other fp-fusion setting, unless the launch sets it itself.
        if fp_fusion and target.name == "sm_90a" and "enable_fp_fusion" not in launch.kwargs:
            fused = compiled.metadata.enable_fp_fusion
            other, _ = compile_for(target, launch, fp_fusion=not fused)
            fmas = {fused: fused_multiply_adds(code), not fused: fused_multiply_adds(other.asm["ptx"])}
    except Exception as exc:  # a kernel that does not compile for a target is this tool's finding
        row["status"] = f"does not compile: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        return row
    warps = compiled.metadata.num_warps
    occupied = occupancy(target, used, warps)
    mma = matrix_instructions(target, code)
    needs_tensor_core = launch.kernel in ("patch_embed", "gate_up_gelu") and not launch.variant.startswith("float32")
    row |= dict(
        registers=used.registers,
        spill_bytes=used.spill_bytes,
        sgpr_spills=used.scalar_spills,
        shared_bytes=used.shared,
        occupancy=f"{occupied:.3f}",
        mma=mma,
        fmas=f"{fmas[True]}/{fmas[False]}" if fmas else "",
    )
    if used.spill_bytes:
        row["status"] = "SPILLS"
    elif used.shared > target.shared_per_block:
        row["status"] = "DOES NOT FIT"
    elif occupied < FLOORS[launch.kernel]:
        row["status"] = "LOW OCCUPANCY"
    elif needs_tensor_core and not re.search(target.tensor_core, code):
        row["status"] = "NO TENSOR CORES"
    elif fmas and fmas[True] != fmas[False]:
        row["status"] = "FUSION CHANGES RESULTS"
    else:
        row["status"] = "ok"
    return row


_TASKS: list[tuple[Target, Launch, bool]] = []  # set before the worker processes fork


def _build_task(index: int) -> dict:
    return build(*_TASKS[index])


def failed(row: dict) -> bool:
    return row["offered"] and row["status"] != "ok"


def unserved(targets: list[Target]) -> tuple[list[str], list[str]]:
    """Each (target, dtype) for which an autotuned GEMM (the embedder; the gate/up GEMM in bf16 and fp16)
    would be offered no candidate: failures where the target's dots take the dtype, and the ops' fallbacks
    (``fused_vision._dispatch.untiled``) where they do not."""
    gemms = [(patch_embed, DTYPES), (gate_up_gelu, (torch.bfloat16, torch.float16))]
    failures, fallbacks = [], []
    for module, dtypes in gemms:
        for target in targets:
            for dtype in dtypes:
                if not module.gpu_configs(dtype, target.limits):
                    line = f"{target.name}: {module.__name__} offers no {name(dtype)} candidate"
                    (failures if target.limits.multiplies(dtype) else fallbacks).append(line)
    return failures, fallbacks


def markdown(folder: Path) -> str:
    """One row per kernel x target and a column per Triton: the worst launch the launcher offers there
    (the least occupancy among those that fail first), as registers / shared memory / occupancy."""
    cells, versions = defaultdict(dict), set()
    for path in sorted(folder.glob("build_matrix-*.csv")):
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                if row["offered"] != "True":
                    continue
                versions.add(row["triton"])
                key, cell = (row["kernel"], row["target"]), cells[row["kernel"], row["target"]]
                worst = cell.get(row["triton"])
                rank = (row["status"] == "ok", float(row["occupancy"] or 0))
                if worst is None or rank < (worst["status"] == "ok", float(worst["occupancy"] or 0)):
                    cells[key][row["triton"]] = row
    versions = sorted(versions, key=lambda v: tuple(map(int, v.split("."))))
    lines = [
        "| kernel | target | " + " | ".join(f"Triton {v}" for v in versions) + " |",
        "|---|---|" + "---|" * len(versions),
    ]
    order = {name: index for index, name in enumerate(TARGETS)}
    for kernel, target in sorted(cells, key=lambda key: (list(FLOORS).index(key[0]), order[key[1]])):
        row = [kernel, target]
        for version in versions:
            worst = cells[kernel, target].get(version)
            if worst is None:
                row.append("-")
                continue
            text = f"{worst['registers']} r, {int(worst['shared_bytes'] or 0) / KIB:.0f} KiB, "
            text += f"{100 * float(worst['occupancy'] or 0):.0f} %"
            if int(worst["spill_bytes"] or 0):
                text += f", {worst['spill_bytes']} B spilled"
            row.append(text if worst["status"] == "ok" else f"**{worst['status']}** ({text})")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", default=",".join(TARGETS), help="comma-separated, of: " + ", ".join(TARGETS))
    parser.add_argument("--kernels", help="comma-separated kernel names (default: all)")
    parser.add_argument("--out", type=Path, help="also write build_matrix-<triton version>.csv here")
    parser.add_argument("--markdown", type=Path, metavar="DIR", help="print the table of DIR's CSVs; build nothing")
    parser.add_argument("--jobs", type=int, default=multiprocessing.cpu_count(), help="builds in parallel")
    parser.add_argument(
        "--fp-fusion", action="store_true", help="on sm_90a, also build with fp fusion flipped and compare"
    )
    args = parser.parse_args()
    if args.markdown:
        print(markdown(args.markdown))
        return 0
    if interpreting():
        sys.exit("build_matrix: unset TRITON_INTERPRET; the interpreter's @triton.jit builds nothing to compile")
    targets = [TARGETS[name] for name in args.targets.split(",")]
    version = tuple(int(part) for part in triton.__version__.split(".")[:2])
    for target in [target for target in targets if version < target.oldest_triton]:
        print(f"build_matrix: Triton {triton.__version__} cannot build for {target.name}: skipped")
        targets.remove(target)
    chosen = [launch for launch in launches() if not args.kernels or launch.kernel in args.kernels.split(",")]
    _TASKS[:] = [(target, launch, args.fp_fusion) for target in targets for launch in chosen]
    rows = []
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("fork")) as pool:
        for row in pool.map(_build_task, range(len(_TASKS))):
            rows.append(row)
            offered = "" if row["offered"] else " (not offered)"
            print(
                f"{row['target']:8} {row['kernel']:18} {row['variant']:50} smem {row['shared_bytes']!s:>6} "
                f"regs {row['registers']!s:>3} spills {row['spill_bytes']!s:>4} occ {row['occupancy'] or '-':>5} "
                f"{row['mma'] or '-':24} fma {row['fmas'] or '-':>9} {row['status']}{offered}",
                flush=True,
            )
    problems = [f"{r['target']} {r['kernel']} {r['variant']}: {r['status']}" for r in rows if failed(r)]
    failures, fallbacks = unserved(targets)
    problems += failures
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / f"build_matrix-{triton.__version__}.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=FIELDS)
            writer.writeheader()
            writer.writerows(rows)
    print("\n".join(f"{line}: no tensor-core dot takes it there, the op falls back" for line in fallbacks))
    print(f"build_matrix: Triton {triton.__version__}, {len(rows)} builds, {len(problems)} failures")
    print("\n".join(problems))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
