"""vLLM's encoder path timed stock vs packed vs fused: vLLM's calls, on a tower built as vLLM builds it.

    python bench/vllm_encoder.py [--out DIR] [--tiny]

vLLM never calls the tower's forward: per chunk it calls ``vt.patch_embedder``, then ``vt.encoder(
inputs_embeds=, attention_mask=~padding, pixel_position_ids=)`` on the padded batch, then ``vt.pooler``.
This times that encoder call (and the three together) for transformers' tower, its linears swapped for
vLLM's unquantized ``ReplicatedLinear`` where vLLM imports (as vLLM's ``recursive_replace_linear`` swaps
them), else left ``nn.Linear`` (the same ``F.linear`` GEMM), with the encoder stock, ``packed`` and
``fused`` (``apply_fused_vision_to_gemma4(model, encoder=...)``). The towers: 26B/31B and E4B, bf16; the
cases: image 8x280 and video 32x70. Each provider's output error against float64 is reported beside stock's.
Writes ``vllm_encoder.md`` to DIR (default: bench/out/vllm_encoder).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from fused_vision import apply_fused_vision_to_gemma4, revert_fused_vision_gemma4
from fused_vision.bench.tower import build_tower, tower_inputs
from fused_vision.bench.workloads import cases

TOWERS = {"26b_31b": "tower_26b_31b", "e4b": "tower_e2b_e4b"}
CASES = cases("image_8x280", "video_32x70")
TINY_CASES = cases("image_2x4")
PROVIDERS = ("stock", "packed", "fused")


@contextlib.contextmanager
def vllm_context(device: torch.device):
    """vLLM's config and a one-process group, as its ``ReplicatedLinear`` needs; None where vLLM does not import."""
    try:
        from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
        from vllm.distributed import parallel_state
    except ImportError:
        yield None
        return
    rendezvous = f"file://{tempfile.mkdtemp()}/rendezvous"
    backend = "nccl" if device.type == "cuda" else "gloo"
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device.type))):
        parallel_state.init_distributed_environment(1, 0, rendezvous, 0, backend=backend)
        parallel_state.ensure_model_parallel_initialized(1, 1)
        try:
            yield parallel_state
        finally:
            parallel_state.destroy_model_parallel()
            parallel_state.destroy_distributed_environment()


def swap_linears(model: torch.nn.Module, vllm) -> str:
    """Each ``nn.Linear`` of the tower becomes vLLM's ``ReplicatedLinear`` (weights copied); what the tower has."""
    if vllm is None:
        return "nn.Linear (vLLM does not import here; its unquantized ReplicatedLinear runs the same F.linear)"
    from vllm.model_executor.models.transformers.utils import replace_linear_class

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                weight = child.weight
                with torch.device(weight.device):
                    replacement = replace_linear_class(child, "replicate", None, prefix=name).to(weight.dtype)
                replacement.weight.data.copy_(weight)
                setattr(parent, name, replacement)
    return "vLLM's ReplicatedLinear"


@torch.inference_mode()
def vllm_calls(model, pixels, ids, dtype):
    """The encoder's output and the pooled soft tokens, through the calls vLLM makes."""
    padding = (ids == -1).all(dim=-1)
    embedded = model.patch_embedder(pixels, ids, padding).to(dtype)
    hidden = model.encoder(inputs_embeds=embedded, attention_mask=~padding, pixel_position_ids=ids).last_hidden_state
    length = ids.shape[1] // model.config.pooling_kernel_size**2
    pooled = [model.pooler(hidden[i : i + 1], ids[i : i + 1], padding[i : i + 1], length)[0] for i in range(len(ids))]
    return hidden, pooled


def timed(function, device, repeats: int) -> tuple[float, int]:
    """Median milliseconds of ``function()`` and its peak bytes above the start."""
    function()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
        start = time.perf_counter()
        function()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1000)
    peak = torch.cuda.max_memory_allocated() - base if device.type == "cuda" else 0
    return statistics.median(times), peak


def bench_case(model, case, linears, tower_name, dtype, repeats) -> list[str]:
    """One row per provider: the encoder call and vLLM's three calls timed, their peak, and the encoder
    output's relative error (2-norm, real rows) against a float64 twin of the stock tower. A difference
    from stock's own bf16 output says nothing here: a random 16- or 27-layer tower amplifies a rounding
    difference ~1000-fold (fp32, a 1e-6 input change moved the E4B output by 1e-3 of its largest value)."""
    device = model.patch_embedder.position_embedding_table.device
    pixels, ids = tower_inputs(case, device)
    padding = (ids == -1).all(dim=-1)

    @torch.inference_mode()
    def encoder_only():
        embedded = model.patch_embedder(pixels, ids, padding).to(dtype)
        return model.encoder(inputs_embeds=embedded, attention_mask=~padding, pixel_position_ids=ids)

    revert_fused_vision_gemma4()
    exact = vllm_calls(copy.deepcopy(model).double(), pixels.double(), ids, torch.float64)[0][~padding]
    rows, stock_ms = [], None
    for provider in PROVIDERS:
        revert_fused_vision_gemma4()
        if provider != "stock":
            apply_fused_vision_to_gemma4(model, embedder=None, pooler=False, encoder=provider)
        hidden, _ = vllm_calls(model, pixels, ids, dtype)
        error = ((hidden[~padding].double() - exact).norm() / exact.norm()).item()
        encoder_ms, peak = timed(encoder_only, device, repeats)
        calls_ms, _ = timed(lambda: vllm_calls(model, pixels, ids, dtype), device, repeats)
        stock_ms = stock_ms or calls_ms
        rows.append(
            f"| {tower_name} | {case.name} | {linears.split(' (')[0]} | {provider} | {encoder_ms:.2f} | "
            f"{calls_ms:.2f} | {peak / 1e6:.0f} | {stock_ms / calls_ms:.2f}x | {error:.3g} |"
        )
        print(rows[-1], flush=True)
    revert_fused_vision_gemma4()
    return rows


def run(out: Path, tiny: bool) -> str:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16
    columns = "tower | case | linears | provider | encoder ms | vLLM's calls ms | peak MB | / stock | error vs float64"
    rows = [f"| {columns} |"]
    rows.append("|---|---|---|---|--:|--:|--:|--:|--:|")
    notes = []
    with vllm_context(device) as vllm:
        for tower_name, shape in TOWERS.items():
            model = build_tower(shape, device, dtype, tiny=tiny)
            linears = swap_linears(model, vllm)
            notes.append(f"{tower_name}: {linears}")
            for case in TINY_CASES if tiny else CASES:
                rows += bench_case(model, case, linears, tower_name, dtype, repeats=2 if tiny else 5)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    report = "\n".join([f"# vLLM's encoder path, {name}, bf16", "", *rows, "", *notes, ""])
    out.mkdir(parents=True, exist_ok=True)
    (out / "vllm_encoder.md").write_text(report)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("VLLM_ENCODER_OUT", "bench/out/vllm_encoder")))
    parser.add_argument("--tiny", action="store_true", help="toy towers and one toy case, for any device")
    arguments = parser.parse_args()
    print(run(arguments.out, arguments.tiny))


if __name__ == "__main__":
    main()
