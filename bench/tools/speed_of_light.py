"""How near each kernel can come to its speed of light, read off its machine code on a CPU.

    python bench/tools/speed_of_light.py [--targets sm_90a,sm_100a,sm_80] [--kernels ...]

Each kernel is built as its launcher launches it at the bench's headline shapes (image 32x280: 80,640
patches; the layer ops on as many tokens, at both towers' widths), bf16, and disassembled with the
nvdisasm Triton ships. From the SASS:

- streaming kernels: warp-instructions issued per element produced = instructions a program executes
  x warps x programs / elements, against the issue budget at copy bandwidth = bytes the kernel must move
  per element x WARP_INSTRUCTION_RATE / COPY_RATE (the H200's, docs/speed-of-light.md). A kernel above its budget
  cannot reach copy speed on any GPU; above half of it, it will not.
- the embedder: instructions per tensor-core instruction (HGMMA on sm_90a) in its main loop, which must
  leave the tensor cores fed; each autotune candidate on the targets its launcher offers it on.

A program's count is every instruction of the kernel once, loops times their trip count (each kernel
declares its loops' trips; a loop it does not declare fails the tool), branches counted on both sides:
an upper bound. Also reported: the widest and narrowest global load and store, and whether a bf16
rounding is emulated in integer ops (a 0x7fff immediate). Exits 1 where a gated kernel misses its bound
on sm_90a: a streaming kernel above GATE_FRACTION of its budget, the embedder above HGMMA_GATE.
Must run without TRITON_INTERPRET (it changes what @triton.jit builds).
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
from build_matrix import compile_for
from launches import Launch, capture_launches, programs, with_heuristics
from targets import TARGETS, Target

from fused_vision.kernels import (
    gate_up_gelu,
    gelu_gate,
    patch_embed,
    pool_by_positions,
    position_embeddings,
    qkv_norm_rope,
    residual_rms_norm,
)
from fused_vision.kernels.common import interpreting

# The H200's, as docs/speed-of-light.md derives them: 132 SMs x 4 schedulers x 1.98 GHz, one
# warp-instruction per scheduler per cycle; the copy bandwidth fused_vision's bench measured (read + write).
WARP_INSTRUCTION_RATE = 132 * 4 * 1.98e9
COPY_RATE = 4.246e12
GATE_FRACTION = 0.5
HGMMA_GATE = 48
DEFAULT_TARGETS = ("sm_90a", "sm_100a", "sm_80")
GATED_TARGET = "sm_90a"
# The SASS of each tensor-core family: HGMMA (wgmma), UTC*MMA (tcgen05), HMMA (mma.sync).
TCGEN05_SASS = "UTCHMMA|UTCQMMA|UTCMMA"
TENSOR_CORE = {"sm_90a": "HGMMA", "sm_100a": TCGEN05_SASS, "sm_103a": TCGEN05_SASS, "sm_110a": TCGEN05_SASS}
TENSOR_CORE |= dict.fromkeys(("sm_75", "sm_80", "sm_86", "sm_87", "sm_89", "sm_120", "sm_121"), "HMMA")

ROWS = 32 * 2520  # image 32x280
POSITIONS = 10240
# The layer ops' towers: (label, hidden, heads, head_dim, intermediate, clipped linears).
TOWERS = (("26B/31B", 1152, 16, 72, 4304, False), ("E2B/E4B", 768, 12, 64, 3072, True))


@dataclass
class Headline:
    """One launch at the headline shape: what it produces and what it must move per element produced
    (None: a GEMM, judged per tensor-core instruction), and its loops' trip counts, outermost first."""

    kernel: str
    variant: str
    launch: Launch
    programs: int
    elements: int
    bytes_per_element: int | None
    trips: tuple[int, ...] = ()
    offered: Callable[[Target], bool] = lambda target: True  # whether the launcher offers it on a target
    gated: bool = True


def captured(module, attribute: str, call: Callable, meta: dict | None = None):
    """(fn, args, kwargs, programs) of the one launch ``call`` makes of ``module.attribute``."""
    grids = []
    ((args, kwargs),) = capture_launches(module, (attribute,), call, grids)
    kwargs = kwargs | (meta or {})
    return args, kwargs, programs(grids[0], kwargs)


META = dict(device="meta", dtype=torch.bfloat16)  # nothing is allocated
IDS = torch.empty(32, 2520, 2, dtype=torch.int64, device="meta")
PADDING = torch.empty(32, 2520, dtype=torch.bool, device="meta")


def lookup_headlines():
    for hidden in (1152, 768):
        table = torch.empty(2, POSITIONS, hidden, **META)
        for residual in (None, torch.empty(32, 2520, hidden, **META)):
            args, kwargs, count = captured(
                position_embeddings,
                "_position_embeddings_kernel",
                lambda: position_embeddings.position_embeddings(table, IDS, PADDING, residual),
            )
            launch = Launch("position_embeddings", "", position_embeddings._position_embeddings_kernel, args, kwargs)
            label = f"D={hidden}" + (" + residual" if residual is not None else "")
            moved = 2 if residual is None else 4
            yield Headline("position_embeddings", label, launch, count, ROWS * hidden, moved)


def embedder_headlines():
    pixels = torch.empty(32, 2520, 768, dtype=torch.float32, device="meta")
    for hidden in (1152, 768):
        table, weight = torch.empty(2, POSITIONS, hidden, **META), torch.empty(hidden, 768, **META)
        for config in patch_embed.gpu_configs(torch.bfloat16):
            tile = dict(config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages)
            args, kwargs, count = captured(
                patch_embed,
                "_patch_embed_tuned",
                lambda: patch_embed.patch_embed(pixels, weight, table, IDS, PADDING),
                tile,
            )
            kernel = patch_embed._patch_embed_kernel
            launch = Launch("patch_embed", "", kernel, args, with_heuristics(kernel, args, kwargs))
            blocks = "x".join(map(str, config.kwargs.values()))
            label = f"D={hidden}, {blocks}, {config.num_warps} warps, {config.num_stages} stages"
            trips = (768 // tile["BLOCK_K"],)

            def offered(target, config=config):
                return config in patch_embed.gpu_configs(torch.bfloat16, target.limits)

            yield Headline("patch_embed", label, launch, count, ROWS * hidden, None, trips, offered)


def gate_up_headlines():
    """The gate/up GEMM with the gate in its epilogue: each bf16 candidate at both towers' widths."""
    clamps = torch.empty(3, 2, dtype=torch.float32, device="meta")
    for _, hidden, _, _, intermediate, clipped in TOWERS:
        y, weight = torch.empty(ROWS, hidden, **META), torch.empty(2 * intermediate, hidden, **META)
        for config in gate_up_gelu.gpu_configs(torch.bfloat16):
            tile = dict(config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages)
            args, kwargs, count = captured(
                gate_up_gelu,
                "_gate_up_gelu_tuned",
                lambda: gate_up_gelu.gate_up_gelu(y, weight, clamps if clipped else None),
                tile,
            )
            kernel = gate_up_gelu._gate_up_gelu_kernel
            launch = Launch("gate_up_gelu", "", kernel, args, with_heuristics(kernel, args, kwargs))
            blocks = "x".join(map(str, config.kwargs.values()))
            label = f"D={hidden}, I={intermediate}, {blocks}, {config.num_warps} warps, {config.num_stages} stages"

            def offered(target, config=config):
                return config in gate_up_gelu.gpu_configs(torch.bfloat16, target.limits)

            # D is a compile-time size: the compiler unrolls its 12 or 18 K blocks, so no loop is left.
            yield Headline("gate_up_gelu", label, launch, count, ROWS * intermediate, None, (), offered)


def pooler_headlines():
    for hidden in (1152, 768):
        hidden_states = torch.empty(32, 2520, hidden, **META)
        grids = []
        _, (args, kwargs) = capture_launches(
            pool_by_positions,
            ("_patch_slots_kernel", "_pool_by_positions_kernel"),
            lambda: pool_by_positions.pool_by_positions(hidden_states, IDS, PADDING, 280, 3),
            grids,
        )
        launch = Launch("pool_by_positions", "", pool_by_positions._pool_by_positions_kernel, args, kwargs)
        # Each pooled fp32 value reads its slot's k * k = 9 bf16 rows. The one loop walks an item whose
        # ids repeat a position, which the headline's grid never does: counted once, an upper bound.
        yield Headline(
            "pool_by_positions", f"D={hidden}", launch, programs(grids[1], kwargs), 32 * 280 * hidden, 9 * 2 + 4, (1,)
        )


def layer_headlines():
    for label, hidden, heads, head_dim, intermediate, clipped in TOWERS:
        clamps = torch.empty(3, 2, device="meta") if clipped else None
        width = 3 * heads * head_dim
        qkv = torch.empty(ROWS, width, **META)
        token_ids = torch.empty(ROWS, 2, dtype=torch.int64, device="meta")
        norm = torch.empty(head_dim, **META)
        inv_freq = torch.empty(head_dim // 4, device="meta")
        args, kwargs, count = captured(
            qkv_norm_rope,
            "_qkv_norm_rope_kernel",
            lambda: qkv_norm_rope.qkv_norm_rope(qkv, token_ids, norm, norm, inv_freq, heads, heads, 1e-6, clamps),
        )
        launch = Launch("qkv_norm_rope", "", qkv_norm_rope._qkv_norm_rope_kernel, args, kwargs)
        yield Headline("qkv_norm_rope", label, launch, count, ROWS * width, 4)

        x, weight = torch.empty(ROWS, hidden, **META), torch.empty(hidden, **META)
        args, kwargs, count = captured(
            residual_rms_norm,
            "_residual_rms_norm_kernel",
            lambda: residual_rms_norm.residual_rms_norm(x, x, weight, weight, 1e-6),
        )
        launch = Launch("residual_rms_norm", "", residual_rms_norm._residual_rms_norm_kernel, args, kwargs)
        yield Headline("residual_rms_norm", label, launch, count, ROWS * hidden, 8)

        gate_up = torch.empty(ROWS, 2 * intermediate, **META)
        args, kwargs, count = captured(gelu_gate, "_gelu_gate_kernel", lambda: gelu_gate.gelu_gate(gate_up, clamps))
        launch = Launch("gelu_gate", "", gelu_gate._gelu_gate_kernel, args, kwargs)
        yield Headline("gelu_gate", label, launch, count, ROWS * intermediate, 6)


HEADLINES = {
    "position_embeddings": lookup_headlines,
    "patch_embed": embedder_headlines,
    "pool_by_positions": pooler_headlines,
    "qkv_norm_rope": layer_headlines,
    "residual_rms_norm": layer_headlines,
    "gelu_gate": layer_headlines,
    "gate_up_gelu": gate_up_headlines,
}


def headline_launches(kernels: list[str]) -> list[Headline]:
    """Every gated launch of ``kernels`` at the headline shapes."""
    found = []
    for source in dict.fromkeys(HEADLINES[kernel] for kernel in kernels):
        found += [headline for headline in source() if headline.kernel in kernels]
    return found


INSTRUCTION = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
LABEL = re.compile(r"^(\.L_x_\d+):")
BRANCH = re.compile(r"\bBRA\b.*`\((\.L_x_\d+)\)")


def disassemble(cubin: bytes) -> str:
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout


def instructions(sass: str) -> tuple[list[tuple[int, str]], dict[str, int]]:
    """(address, text) of each instruction, without the padding after the last EXIT (its self-branch and
    NOPs), and the address of each label."""
    found, labels, pending = [], {}, []
    for line in sass.splitlines():
        if label := LABEL.match(line):
            pending.append(label.group(1))
        elif match := INSTRUCTION.match(line):
            address = int(match.group(1), 16)
            labels.update((name, address) for name in pending)
            pending = []
            found.append((address, match.group(2)))
    while found and (found[-1][1].startswith("NOP") or re.fullmatch(r"BRA `\(\.L_x_\d+\)", found[-1][1])):
        found.pop()
    return found, labels


WAIT = re.compile(r"\b(NANOSLEEP|TRYWAIT)\b")
WORK = re.compile(r"\b(LD|ST)[GSL]\b|\b(LD|ST)[GSL]\.|MMA")


def loops(found: list[tuple[int, str]], labels: dict[str, int]) -> list[tuple[int, int]]:
    """Each loop as (first, last) index into ``found``: a branch back to an earlier address, outermost first.
    Spin loops that wait on a barrier (a TRYWAIT or NANOSLEEP, no load, store or MMA) do no work: left out."""
    index = {address: i for i, (address, _) in enumerate(found)}
    spans = []
    for i, (address, text) in enumerate(found):
        branch = BRANCH.search(text)
        if branch and labels[branch.group(1)] <= address:
            first = index[labels[branch.group(1)]]
            body = [text for _, text in found[first : i + 1]]
            if not (any(WAIT.search(text) for text in body) and not any(WORK.search(text) for text in body)):
                spans.append((first, i))
    return sorted(spans, key=lambda span: (span[0], -span[1]))


def executed(found, spans, trips: tuple[int, ...]) -> int | None:
    """Instructions a program executes: each once, each loop's body ``trips`` times (nested: multiplied);
    None where the SASS has other loops than those declared (a pipelined loop the compiler rotated)."""
    if len(spans) != len(trips):
        return None
    weights = [1] * len(found)
    for (first, last), count in zip(spans, trips):
        for i in range(first, last + 1):
            weights[i] *= count
    return sum(weights)


def widths(found, kind: str) -> str:
    """The narrowest and widest global accesses of one kind (LDG or STG), e.g. "32-128" bits."""
    accesses = [text for _, text in found if re.search(rf"\b{kind}\.E\b", text)]
    bits = [int(m.group(1)) if (m := re.search(r"\.(64|128)\b", text)) else 32 for text in accesses]
    return f"{min(bits)}-{max(bits)}" if bits else "-"


def measure(target: str, headline: Headline) -> dict:
    compiled, _ = compile_for(TARGETS[target], headline.launch)
    found, labels = instructions(disassemble(compiled.asm["cubin"]))
    spans = loops(found, labels)
    per_program = executed(found, spans, headline.trips)
    if per_program is None and target == GATED_TARGET:
        raise RuntimeError(f"{headline.kernel}: {len(spans)} loops in the SASS, {len(headline.trips)} declared")
    row = dict(
        target=target,
        kernel=headline.kernel,
        variant=headline.variant,
        per_program=per_program,
        warps=compiled.metadata.num_warps,
        programs=headline.programs,
        loads=widths(found, "LDG"),
        stores=widths(found, "STG"),
        gated=headline.gated,
        emulated_rounding=any(re.search(r"\b0x7fff\b", text.lower()) for _, text in found),
    )
    if headline.bytes_per_element is None:
        pattern = TENSOR_CORE[target]
        mma = re.compile(rf"\b({pattern})\b")
        # The main loop: the one with the most tensor-core instructions (the whole kernel, if none loops).
        bodies = [found[first : last + 1] for first, last in spans] or [found]
        counts = [sum(1 for _, text in body if mma.search(text)) for body in bodies]
        body, count = max(zip(bodies, counts), key=lambda pair: pair[1])
        row |= dict(per_mma=(len(body) / count) if count else None, bound=HGMMA_GATE)
    elif per_program is None:
        row |= dict(per_element=None, budget=None, fraction=None)
    else:
        budget = headline.bytes_per_element * WARP_INSTRUCTION_RATE / COPY_RATE
        per_element = row["per_program"] * row["warps"] * row["programs"] / headline.elements
        row |= dict(per_element=per_element, budget=budget, fraction=per_element / budget)
    return row


def passes(row: dict) -> bool:
    if row["target"] != GATED_TARGET or not row["gated"]:
        return True
    if "per_mma" in row:
        return row["per_mma"] is not None and row["per_mma"] <= HGMMA_GATE
    return row["fraction"] <= GATE_FRACTION


def figure(row: dict) -> str:
    if "per_mma" in row:
        return f"{row['per_mma']:.1f} per MMA (bound {HGMMA_GATE})" if row["per_mma"] else "no MMA in its loop"
    if row["per_element"] is None:
        return "loops not as declared: not counted"
    return f"{row['per_element']:.3f} per element, budget {row['budget']:.2f}: {row['fraction']:.0%}"


def line(row: dict, ok: bool) -> str:
    count = f"{row['per_program'] or '-':>6} x {row['warps']} warps x {row['programs']:7} programs"
    rounding = "  integer rounding" if row["emulated_rounding"] else ""
    verdict = ("ok" if ok else "OVER") if row["gated"] else "not gated"
    return (
        f"{row['target']:8} {row['kernel']:20} {row['variant']:38} {count}  {figure(row):42} "
        f"LDG {row['loads']:7} STG {row['stores']:7}{rounding}  {verdict}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    targets = ", ".join(TENSOR_CORE)
    parser.add_argument("--targets", default=",".join(DEFAULT_TARGETS), help=f"comma-separated: {targets}")
    parser.add_argument("--kernels", help="comma-separated kernel names (default: all)")
    args = parser.parse_args()
    if interpreting():
        sys.exit("speed_of_light: unset TRITON_INTERPRET; the interpreter's @triton.jit builds nothing to compile")
    chosen = headline_launches(args.kernels.split(",") if args.kernels else list(HEADLINES))
    failures = []
    print(
        f"Triton {triton.__version__}; gate on {GATED_TARGET}: streaming <= {GATE_FRACTION:.0%} of budget, "
        f"embedder <= {HGMMA_GATE} per tensor-core instruction"
    )
    for target in args.targets.split(","):
        for headline in (headline for headline in chosen if headline.offered(TARGETS[target])):
            row = measure(target, headline)
            ok = passes(row)
            print(line(row, ok), flush=True)
            if not ok:
                failures.append(f"{target} {row['kernel']} {row['variant']}: {figure(row)}")
    print(f"speed_of_light: {len(failures)} over their bound")
    print("\n".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
