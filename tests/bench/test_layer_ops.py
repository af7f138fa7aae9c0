"""The layer ops in the ops section: their shapes, byte models, providers and the copy-bandwidth target."""

import pytest
import torch

from fused_vision.bench import Case, plan
from fused_vision.bench.layer_ops import (
    LAYER_OPS,
    GeluGate,
    QkvNormRope,
    ResidualRmsNorm,
    gelu_gate_bytes,
    layer_shape,
    qkv_norm_rope_bytes,
    residual_rms_norm_bytes,
)
from fused_vision.bench.ops import Unsupported

from bench_cli import read_csv, run_cli
from helpers import DEVICE

PROVIDERS = ("stock", "compiled", "reference", "fused", "fused_kernel")


def test_the_shapes_are_the_towers_of_the_width():
    big = layer_shape(1152)
    assert (big["num_attention_heads"], big["head_dim"], big["intermediate_size"]) == (16, 72, 4304)
    assert layer_shape(768)["use_clipped_linears"] and layer_shape(64)["head_dim"] == 32
    with pytest.raises(Unsupported, match="no Gemma 4 vision tower has width D=100"):
        layer_shape(100)


def test_byte_models_match_hand_counts_at_the_26b_31b_shape():
    """image_8x280: 8 items of 12 x 23 soft tokens, 36 x 69 = 2,484 real patches each, packed: T = 19,872."""
    shape, tokens, bf16 = layer_shape(1152), 8 * 2484, torch.bfloat16
    qkv = tokens * 48 * 72 * 2  # (T, (16 + 2 * 16) * 72) bf16, read and written once each
    small = 2 * 72 * 2 + 18 * 4  # q_norm and k_norm weights, fp32 inverse frequencies
    assert qkv_norm_rope_bytes(tokens, shape, bf16) == 2 * qkv + tokens * 2 * 8 + small == 275_028_840
    assert residual_rms_norm_bytes(tokens, shape, bf16) == 4 * tokens * 1152 * 2 + 2 * 1152 * 2 == 183_144_960
    assert gelu_gate_bytes(tokens, shape, bf16) == tokens * (2 * 4304 + 4304) * 2 == 513_174_528
    clipped = layer_shape(768)
    assert gelu_gate_bytes(10, clipped, bf16) == 10 * 3 * 3072 * 2 + 3 * 2 * 4


def test_the_benches_run_on_the_cases_packed_patches():
    case, cpu = Case.parse("video_1x70"), torch.device("cpu")
    bench = QkvNormRope(case, 1152, torch.bfloat16, cpu)
    assert bench.tokens == 33 * 18 and bench.args[0].shape == (594, 48 * 72) and bench.args[1].shape == (594, 2)
    assert (bench.args[1] >= 0).all(), "no padding among the packed tokens"
    assert bench.model_bytes == qkv_norm_rope_bytes(594, layer_shape(1152), torch.bfloat16)
    assert ResidualRmsNorm(case, 1152, torch.bfloat16, cpu).args[0].shape == (594, 1152)
    assert GeluGate(case, 768, torch.bfloat16, cpu).args[1].shape == (3, 2), "E2B/E4B's clipped linears clamp"


@pytest.mark.parametrize("op", list(LAYER_OPS))
def test_every_provider_computes_the_stock_formulation(op):
    torch.manual_seed(0)
    bench = LAYER_OPS[op](Case.parse("image_2x4"), 64, torch.float32, DEVICE)
    expected = bench.call("stock")()
    for provider in bench.providers[1:]:
        if (op, provider) == ("gate_up_gelu", "fused_kernel"):  # no float32 GEMM kernel: cuBLAS stays
            with pytest.raises(Unsupported, match="takes bf16 and fp16"):
                bench.call(provider)
            continue
        actual = bench.call(provider)()
        for got, want in zip(*(o if isinstance(o, tuple) else (o,) for o in (actual, expected))):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=f"{op} {provider}")


def test_a_tiny_run_reports_the_layer_ops_bandwidth(tmp_path):
    eager = tuple(provider for provider in PROVIDERS if provider != "compiled")  # compiling: minutes of a CPU
    out = run_cli(tmp_path, "--ops", "layer", "--providers", ",".join(eager))
    _, rows = read_csv(out / "results.csv")
    measured = {(row["op"], row["provider"]) for row in rows if row["op"] in LAYER_OPS}
    unsupported = {("gate_up_gelu", "fused_kernel")}  # float32: no GEMM kernel of its own
    assert measured == {(op, provider) for op in LAYER_OPS for provider in eager} - unsupported
    for row in rows:
        if row["op"] in LAYER_OPS:
            assert float(row["model_bytes"]) > 0
            interpreted = DEVICE.type == "cpu" and row["provider"] in ("fused", "fused_kernel")
            assert bool(row["gbps"]) == (not interpreted), "a rate only from a time that is a speed"
    markdown = (out / "results.md").read_text()
    assert "### qkv_norm_rope · D=64 · float32" in markdown
    ratios = "stock / reference |" + (" stock / fused |" if DEVICE.type == "cuda" else "")
    assert f"| stock | reference | fused | fused_kernel | {ratios}" in markdown, "no ratio to an interpreter's time"
    assert "Target (" not in markdown, "the bench measures; bench/goals.py judges the goals"


def test_the_defaults_run_the_layer_ops_with_the_stem_ops(tmp_path):
    def default(device):
        return plan.Plan.of(plan.Options(device=torch.device(device), out=tmp_path))

    cpu, gpu = default("cpu"), default("cuda")
    assert gpu.layer_ops == tuple(LAYER_OPS)
    assert cpu.layer_ops == (), "a CPU runs the layer ops' stock code on either path: nothing of fused_vision to time"
    assert "image_8x280" in [case.name for case in gpu.stem_cases]
    assert plan.OP_GROUPS["layer"] == ("qkv_norm_rope", "residual_rms_norm", "gelu_gate", "gate_up_gelu")
