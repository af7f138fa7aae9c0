"""Why a kernel misses its target: each op's kernel at the bench's headline case, timed beside variants that
each take one cost away, and profiled once under Nsight Compute (bench/gpu_run.sh's profile step).

    python bench/tools/profile_kernels.py [--tiny] [--device cpu]     # the timing table, markdown
    ncu --profile-from-start off ... python bench/tools/profile_kernels.py --profile   # one call of each kernel

The variants beside each op's public call (``fused``) and its launcher (``fused_kernel``):
- patch_embed: the launcher on pixels already in the weight dtype (what the fp32 operand A costs), the
  GEMM alone through F.linear on those (cuBLAS: the matmul's own speed), the other embedder (cuBLAS's GEMM,
  then the lookup kernel adding its rows), and ``torch.compile`` of stock;
- pool_by_positions: the public call with the id checks off (on a GPU now the default: the two should match).
GB/s is the op's byte model (the bench's) over the median time, the same bytes for every variant.
--profile warms every call up (autotuning included), then runs each launcher variant once between
cudaProfilerStart and cudaProfilerStop, so the profiler sees one launch per variant and no autotuning.
"""

import argparse
import os
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from fused_vision import reference
from fused_vision._validation import ENV_CHECK_IDS
from fused_vision.bench.layer_ops import LAYER_OPS
from fused_vision.bench.measure import Budget, copy_ceiling, synchronize, time_call
from fused_vision.bench.ops import STEM_OPS
from fused_vision.bench.workloads import HEADLINE_CASE, TINY_CASES, Case

OPS = ("position_embeddings", "patch_embed", "pool_by_positions", "qkv_norm_rope", "residual_rms_norm", "gelu_gate")
BENCHES = {**STEM_OPS, **LAYER_OPS}
PROFILED = (
    "fused_kernel",
    "pixels pre-cast",
    "F.linear alone",
    "F.linear, then the lookup",
    "compiled",
)  # the kernels, not the op wrappers


def without_id_checks(call: Callable) -> Callable:
    """``call`` with FUSED_VISION_CHECK_IDS=0 around it only (the op reads it on every call)."""

    def unchecked():
        os.environ[ENV_CHECK_IDS] = "0"
        try:
            return call()
        finally:
            del os.environ[ENV_CHECK_IDS]

    return unchecked


def variants(bench) -> dict[str, Callable]:
    calls = {"fused": bench.call("fused"), "fused_kernel": bench.call("fused_kernel")}
    if bench.name == "patch_embed":
        from fused_vision.kernels.patch_embed import patch_embed
        from fused_vision.kernels.position_embeddings import position_embeddings as lookup

        pixels, weight, *rest = bench.args
        pre_cast = pixels.to(weight.dtype)
        calls["pixels pre-cast"] = partial(patch_embed, pre_cast, weight, *rest)
        calls["F.linear alone"] = partial(F.linear, pre_cast, weight)
        # The other embedder: cuBLAS's GEMM, then the lookup kernel adding its rows as the epilogue.
        table, ids, padding = rest
        prescaled = lambda: reference.prescale_pixels(pixels, weight.dtype)
        calls["F.linear, then the lookup"] = lambda: lookup(table, ids, padding, F.linear(prescaled(), weight))
        calls["compiled"] = bench.call("compiled")
    if bench.name == "pool_by_positions":
        calls["fused, ids unchecked"] = without_id_checks(bench.call("fused"))
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="a tiny case at D=64, to check that this runs")
    parser.add_argument("--profile", action="store_true", help="one profiled call of each kernel, no timing")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    case = TINY_CASES[0] if args.tiny else Case.parse(HEADLINE_CASE)
    hidden = 64 if args.tiny else 1152
    budget = Budget(warmup_ms=25, rep_ms=100 if device.type == "cuda" else 20)

    rows, profiled = [], []
    for op in OPS:
        bench = BENCHES[op](case, hidden, dtype, device)
        for name, call in variants(bench).items():
            if args.profile:
                for _ in range(3):  # autotuning and compiling happen here, outside the profiled range
                    call()
                if name in PROFILED:
                    profiled.append((f"{op}: {name}", call))
            else:
                ms = time_call(call, device, budget).p50
                rows.append((op, name, ms, bench.model_bytes / ms / 1e6))
    if args.profile:
        synchronize(device)
        if device.type == "cuda":
            torch.cuda.cudart().cudaProfilerStart()
        for _, call in profiled:  # the kernels' names say which is which; the order is printed below
            call()
            synchronize(device)
        if device.type == "cuda":
            torch.cuda.cudart().cudaProfilerStop()
        print("profiled, in order:", "; ".join(label for label, _ in profiled))
        return

    copy = copy_ceiling(device, 2**28 if device.type == "cuda" else 2**20, budget)
    print(
        f"{device} {torch.cuda.get_device_name() if device.type == 'cuda' else ''}, {dtype}, {case.name}, "
        f"D={hidden}; copy {copy.gbps:,.0f} GB/s"
    )
    print("| op | variant | median ms | GB/s | % of copy |\n|---|---|--:|--:|--:|")
    for op, name, ms, gbps in rows:
        print(f"| {op} | {name} | {ms:.4g} | {gbps:,.0f} | {100 * gbps / copy.gbps:.0f} |")


if __name__ == "__main__":
    main()
