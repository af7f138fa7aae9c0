"""``--profile``: one profiled call per tower and encoder row, its time by category."""

from dataclasses import dataclass

import pytest
import torch

from fused_vision.bench import profile

from bench_cli import read_csv, run_cli

CUDA, CPU = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU


@pytest.mark.parametrize(
    "name, category",
    [
        ("nvjet_tst_128x192_64x4_2x1_v_bz_coopB_TNN", "gemm"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
        ("aten::addmm", "gemm"),
        ("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<96, 128, 64, 4>>", "attention"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3", "attention"),
        ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
        ("_residual_rms_norm_kernel", "residual_rms_norm"),
        ("fused_vision::qkv_norm_rope", "qkv_norm_rope"),
        ("_gelu_gate_kernel", "gelu_gate"),
        ("_patch_embed_kernel", "stem"),
        ("_patch_slots_kernel", "pooler"),
        ("void at::native::elementwise_kernel<128, 4, direct_copy_kernel_cuda>", "copies_casts"),
        ("aten::index_select", "copies_casts"),
        ("triton_poi_fused_add_mul_0", "elementwise"),
        ("aten::mul", "elementwise"),
        ("aten::aminmax", None),
    ],
)
def test_names_fall_in_their_category(name, category):
    assert profile.category_of(name) == category


@dataclass
class Span:
    start: float
    end: float


@dataclass
class Event:
    name: str
    device_type: object
    time_range: Span
    id: int = 0
    cpu_parent: object = None
    linked_correlation_id: int = 0
    is_async: bool = False


def test_a_gpu_call_splits_its_kernels_by_launcher_and_counts_the_idle_time_as_host_gaps():
    window = Event(profile.WINDOW, CPU, Span(0, 100), id=1)
    gate = Event("fused_vision::gelu_gate", CPU, Span(5, 10), id=2, cpu_parent=window)
    launch = Event("cuLaunchKernel", CPU, Span(6, 7), id=3, cpu_parent=gate)
    events = [
        window,
        gate,
        launch,
        Event("triton_per_fused_0", CUDA, Span(10, 30), linked_correlation_id=3),  # named by its launcher
        Event("nvjet_tst_64x8", CUDA, Span(20, 50), linked_correlation_id=99),  # no launcher: its own name
        Event("some_kernel", CUDA, Span(60, 110)),  # past the host window: the window reaches its end
    ]
    ms = profile.breakdown(events, on_gpu=True)
    assert ms["gelu_gate"] == pytest.approx(0.020) and ms["gemm"] == pytest.approx(0.030)
    assert ms["other"] == pytest.approx(0.050)
    assert ms["host_gaps"] == pytest.approx((110 - 40 - 50) / 1e3), "0-10 and 50-60 idle: the union, not the sum"


def test_a_cpu_call_splits_its_own_time_and_adds_up_to_the_window():
    layer = torch.nn.Linear(64, 64)
    x = torch.randn(256, 64)

    def call():
        with torch.no_grad():
            return torch.nn.functional.gelu(layer(x)).cumsum(0)

    call()
    ms = profile.profile_call(call, torch.device("cpu"))
    assert set(ms) == set(profile.CATEGORIES)
    assert ms["gemm"] > 0 and ms["elementwise"] > 0 and ms["other"] > 0  # cumsum: no rule names it
    assert min(ms.values()) >= 0 and ms["attention"] == 0


def test_profile_writes_a_table_and_a_csv_beside_the_results(tmp_path):
    out = run_cli(tmp_path, "--ops", "tower_e2b_e4b", "--providers", "embedding", "--profile")
    columns, rows = read_csv(out / "profile.csv")
    assert columns[:3] == ("op", "provider", "case") and set(profile.CATEGORIES) <= set(columns)
    assert [(row["op"], row["provider"], row["case"]) for row in rows] == [("tower_e2b_e4b", "embedding", "image_2x4")]
    assert float(rows[0]["gemm"]) > 0 and float(rows[0]["attention"]) > 0
    table = (out / "profile.md").read_text()
    assert "| op | provider | case | ms |" in table and "| tower_e2b_e4b | embedding | image_2x4 |" in table
    assert "profiled:" in (out / "log.txt").read_text()
    plain = run_cli(tmp_path / "plain", "--ops", "tower_e2b_e4b", "--providers", "embedding")
    assert not (plain / "profile.md").exists(), "written under --profile only"
