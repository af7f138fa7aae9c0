"""The fused encoder at the 26B/31B tower's real layer shapes (hidden 1152, 16 heads of 72, intermediate 4304),
two layers, against stock item by item and a float64 twin: no less accurate than stock in any dtype."""

import copy

import pytest
import torch

from fused_vision import apply_fused_vision_to_gemma4, encode_images

from .conftest import SMOKE, image_ids
from conftest import DEVICE, assert_as_accurate_as_stock, assert_bit_identical, assert_close, dtype_id, relative_error
from gemma4_towers import ACCURACY_FLOOR, alone, modeling, randomize

pytestmark = pytest.mark.gpu

# (hidden, heads, intermediate, patch size, items, soft tokens per item)
LAYER_SHAPE = (48, 2, 96, 4, 2, 12) if SMOKE else (1152, 16, 4304, 16, 8, 280)


def real_shape_tower(dtype, **overrides):
    hidden, heads, intermediate, patch_size, _, _ = LAYER_SHAPE
    config = modeling.Gemma4VisionConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=72,
        patch_size=patch_size,
        position_embedding_size=10240,
        pooling_kernel_size=3,
        standardize=True,
        **overrides,
    )
    config._attn_implementation = "sdpa"
    tower = randomize(modeling.Gemma4VisionModel(config), seed=0)
    with torch.no_grad():  # weights of unit-variance outputs, as trained towers have
        for name, weight in tower.named_parameters():
            if name.endswith("linear.weight"):
                weight.mul_(5.0 / weight.shape[1] ** 0.5)
    return tower.to(DEVICE, dtype).eval()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=dtype_id)
def test_fused_encoder_as_accurate_as_stock_at_real_layer_shapes(record_property, dtype):
    _, _, _, patch_size, items, soft_tokens = LAYER_SHAPE
    ids = list(image_ids(items, soft_tokens))
    pixels = [torch.rand(i.shape[0], 3 * patch_size**2, device=DEVICE) for i in ids]
    tower = real_shape_tower(dtype)
    stock = alone(tower, pixels, ids)
    exact = alone(copy.deepcopy(tower).double(), [p.double() for p in pixels], ids)
    apply_fused_vision_to_gemma4(tower, encoder="fused")
    with torch.no_grad():
        fused = encode_images(tower, pixels, ids)
    record_property("fused_error", max(relative_error(f, x) for f, x in zip(fused, exact)))
    record_property("stock_error", max(relative_error(s, x) for s, x in zip(stock, exact)))
    for index, (f, s, x) in enumerate(zip(fused, stock, exact, strict=True)):
        floor = ACCURACY_FLOOR[dtype]
        assert_as_accurate_as_stock(f, s, x, floor=floor, ords=(2, float("inf")), what=f"item {index}")


@pytest.mark.parametrize("clipped", [False, True], ids=["26b_31b", "e2b_e4b_clamps"])
def test_the_fused_encoder_captured_in_a_cuda_graph_replays_as_eager(clipped):
    """The encoder's own forward, fused on its padded batch, as an engine capturing the tower calls it:
    nothing may sync (clipped linears: one GEMM per projection while capturing)."""
    hidden, _, _, _, items, soft_tokens = LAYER_SHAPE
    tower = real_shape_tower(torch.bfloat16, use_clipped_linears=clipped)
    apply_fused_vision_to_gemma4(tower, encoder="fused")

    def batch(seed):
        generator = torch.Generator().manual_seed(seed)
        ids = image_ids(items, soft_tokens, generator=generator)
        valid = ~(ids == -1).all(-1)
        embeds = torch.randn(*ids.shape[:2], hidden, generator=generator).to(DEVICE, torch.bfloat16)
        return dict(inputs_embeds=embeds, attention_mask=valid, pixel_position_ids=ids)

    static, new = batch(1), batch(2)
    with torch.no_grad():
        tower.encoder(**batch(0))  # kernels compile and tune outside the capture
        if DEVICE.type == "cuda":
            torch.cuda.synchronize(DEVICE)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = tower.encoder(**static).last_hidden_state
        for name, value in new.items():
            static[name].copy_(value)
        if DEVICE.type == "cuda":
            graph.replay()
        else:
            captured = tower.encoder(**static).last_hidden_state
        expected = tower.encoder(**new).last_hidden_state
    valid = new["attention_mask"]
    if clipped:  # eager compares the bounds and makes one GEMM of three: another cuBLAS order
        assert_close(captured[valid], expected[valid], atol=2**-6, rtol=2**-6, what="real rows")
    else:
        assert_bit_identical(captured[valid], expected[valid], "real rows")
