"""Tiny random Gemma 4 vision towers and their inputs, for the tests of every Gemma 4 integration."""

import copy

import numpy as np
import pytest
import torch
from torch import nn

from helpers import DEVICE, assert_as_accurate_as_stock, assert_close
from op_cases import grid_ids

transformers = pytest.importorskip("transformers")
modeling = pytest.importorskip("transformers.models.gemma4.modeling_gemma4")
VERSION = tuple(int(part) for part in transformers.__version__.split(".")[:2])

# Soft tokens after the tower (the pooled, scaled, maybe standardized output). Every fused op rounds like
# stock, but a GEMM tile order or a pooling sum order may move a rounding by an ulp, which the encoder
# layer then carries on: so besides fp32's elementwise match with stock, both dtypes are judged against
# a float64 twin of the tower, no less accurate than stock in RMS and in the worst element, or than a
# floor of the dtype's unit roundoff (16 of them for fp32).
FP32_CLOSE = dict(rtol=1e-5, atol=1e-5)
ACCURACY_FLOOR = {torch.float32: 16 * 2**-24, torch.bfloat16: 2**-8, torch.float16: 2**-10}


def vision_config(*, patch_size=2, pooling=2, positions=64, standardize=False, hidden=32):
    config = modeling.Gemma4VisionConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=hidden // 2,
        patch_size=patch_size,
        position_embedding_size=positions,
        pooling_kernel_size=pooling,
        standardize=standardize,
    )
    config._attn_implementation = "sdpa"
    return config


def randomize(module: nn.Module, seed: int) -> nn.Module:
    """Fresh random parameters and buffers (never the init's ones and zeros, nor torch.empty garbage)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
            if not tensor.is_floating_point() or "inv_freq" in name:
                continue
            scale = 1.0 if "position_embedding_table" in name or "std_" in name else 0.2
            tensor.copy_(torch.randn(tensor.shape, generator=generator) * scale + (1.0 if "std_scale" in name else 0.0))
    return module


def make_tower(dtype=torch.float32, seed=0, **config):
    tower = modeling.Gemma4VisionModel(vision_config(**config))
    return randomize(tower, seed).to(DEVICE, dtype).eval()


def make_inputs(grids, seq_len, patch_size=2, seed=1):
    """Random pixels in [0, 1) on real patches, 0 on padding (as the processor pads), and their ids."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.stack([grid_ids(w, h, seq_len) for w, h in grids])
    pixels = torch.rand(len(grids), seq_len, 3 * patch_size**2, generator=generator)
    pixels = pixels.masked_fill((ids == -1).all(-1, keepdim=True), 0.0)
    return pixels.to(DEVICE), ids.to(DEVICE)


GRIDS = [(8, 6), (4, 10), (6, 2)]  # k = 2: 12, 10 and 3 soft tokens of L = 16
SEQ_LEN = 64


def run_tower(tower, pixels, ids):
    with torch.no_grad():
        return tower(pixel_values=pixels, pixel_position_ids=ids).last_hidden_state


def out_of_memory_above(monkeypatch, encoder, limit):
    """The encoder raises torch.OutOfMemoryError on chunks of more than ``limit`` items; returns the
    chunk sizes it was called with."""
    sizes, forward = [], encoder.forward

    def limited(*args, inputs_embeds, **kwargs):
        sizes.append(inputs_embeds.shape[0])
        if inputs_embeds.shape[0] > limit:
            raise torch.OutOfMemoryError(f"injected: {inputs_embeds.shape[0]} items")
        return forward(*args, inputs_embeds=inputs_embeds, **kwargs)

    monkeypatch.setattr(encoder, "forward", limited)
    return sizes


def float64_twin(tower):
    """The same tower in float64, unpatched: the exact result that stock and fused are judged against."""
    return copy.deepcopy(tower).double()


def assert_soft_tokens_match(got, stock, exact, what):
    if stock.dtype == torch.float32:
        assert_close(got, stock, **FP32_CLOSE, what=what)
    floor = ACCURACY_FLOOR[stock.dtype]
    assert_as_accurate_as_stock(got, stock, exact, floor=floor, ords=(2, float("inf")), what=what)


TINY_TEXT = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,  # 5.5 cannot validate its rope parameters for a single layer
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    vocab_size=128,
    hidden_size_per_layer_input=0,
    layer_types=["sliding_attention", "full_attention"],
)


def gemma4_config(vision=None):
    """A tiny Gemma4Config: TINY_TEXT's language model, ``vision`` (default ``vision_config()``), no audio."""
    text = dict(TINY_TEXT, vocab_size_per_layer_input=128, num_global_key_value_heads=1, global_head_dim=16)
    vision = (vision or vision_config()).to_dict()
    return modeling.Gemma4Config(text_config=text, vision_config=vision, audio_config=None)


def tiny_conditional_generation():
    return modeling.Gemma4ForConditionalGeneration(gemma4_config()).eval()


def fused_ops(model):
    return sorted(str(m._fused_vision) for m in model.modules() if getattr(m, "_fused_vision", None) is not None)


def processor_batch(sizes, max_soft_tokens, seed):
    from PIL import Image

    image_processing = pytest.importorskip("transformers.models.gemma4.image_processing_pil_gemma4")
    processor = image_processing.Gemma4ImageProcessorPil(
        patch_size=4, max_soft_tokens=max_soft_tokens, pooling_kernel_size=2
    )
    rng = np.random.default_rng(seed)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]
    batch = processor(images, return_tensors="pt")
    tokens = list(batch["num_soft_tokens_per_image"])
    return batch["pixel_values"].to(DEVICE), batch["image_position_ids"].to(DEVICE), tokens


SIZES = [(48, 80), (100, 36), (61, 61)]  # landscape, portrait, square-ish odd


# ---- towers of the two real head sizes, for the packed and fused encoders ----------------------------

KINDS = ["e2b_like", "31b_like"]  # the two real head sizes, clipped linears and standardization


def tower_of(
    kind, dtype=torch.float32, *, patch_size=2, positions=64, seed=0, attention_implementation="sdpa", **overrides
):
    """A tiny tower of the kind: 2 layers, hidden 32, two heads of the real head_dim (``overrides``: other
    config fields)."""
    clipped = kind == "e2b_like"
    fields = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64 if clipped else 72,
        patch_size=patch_size,
        position_embedding_size=positions,
        pooling_kernel_size=2,
        standardize=not clipped,
        use_clipped_linears=clipped,
    )
    config = modeling.Gemma4VisionConfig(**fields | overrides)
    config._attn_implementation = attention_implementation
    tower = randomize(modeling.Gemma4VisionModel(config), seed)
    with torch.no_grad():
        for name, buffer in tower.named_buffers():  # bounds that clip some values, never all
            if name.endswith(("input_min", "output_min")):
                buffer.fill_(-0.6)
            elif name.endswith(("input_max", "output_max")):
                buffer.fill_(0.6)
    return tower.to(DEVICE, dtype).eval()


def mixed_items(seed=5):
    """Items of two padded lengths (64 and 16 patches), interleaved."""
    large_pixels, large_ids = make_inputs(GRIDS, SEQ_LEN, seed=seed)
    small_pixels, small_ids = make_inputs([(4, 4), (2, 6)], 16, seed=seed + 1)
    pixels = [large_pixels[0], small_pixels[0], large_pixels[1], small_pixels[1], large_pixels[2]]
    ids = [large_ids[0], small_ids[0], large_ids[1], small_ids[1], large_ids[2]]
    return pixels, ids


def alone(tower, pixels, ids):
    """Stock's soft tokens of each item run alone through the (stock) tower."""
    return [run_tower(tower, p[None].to(tower.dtype), i[None]) for p, i in zip(pixels, ids)]


def alone_in_float64(tower, pixels, ids):
    """``alone`` on a float64 twin of the tower: the exact answers each dtype is judged against."""
    return alone(float64_twin(tower), [p.double() for p in pixels], ids)


def assert_items_close(got, expected, what="item"):
    """Each item within fp32's tolerance of its expected soft tokens."""
    for index, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert_close(g, e, **FP32_CLOSE, what=f"{what} {index}")


def assert_items_match(got, stock, exact, dtype):
    assert len(got) == len(stock)
    for index, (g, s, x) in enumerate(zip(got, stock, exact, strict=True)):
        assert g.shape == s.shape and g.dtype == s.dtype, f"item {index}"
        if dtype == torch.float32:
            assert_close(g, s, **FP32_CLOSE, what=f"item {index}")
        floor = ACCURACY_FLOOR[dtype]
        assert_as_accurate_as_stock(g, s, x, floor=floor, ords=(2, float("inf")), what=f"item {index}")


def gradients(model, pixels, ids, *, pixels_require_grad=True, forward=None):
    """The gradients of a loss on ``model``'s soft tokens: of each parameter that requires one, and of the
    pixels where they do. ``forward``: what to call in place of ``model`` (a compiled model, say)."""
    inputs = pixels.clone().requires_grad_(pixels_require_grad)
    out = (model if forward is None else forward)(pixel_values=inputs, pixel_position_ids=ids).last_hidden_state
    out.float().square().mean().backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
    return grads | ({"pixels": inputs.grad} if pixels_require_grad else {})


def assert_gradients_match(got, expected, what="grad"):
    """Each gradient of ``got`` within 1e-4 (relative) of ``expected``'s, none missing."""
    assert got.keys() == expected.keys(), what
    for name, grad in expected.items():
        assert got[name] is not None and grad is not None, f"{what} of {name}: none"
        assert_close(got[name], grad, rtol=1e-4, atol=1e-6, what=f"{what} of {name}")


def assert_gradients_match_stock(stock_tower, tower, pixels, ids):
    """Every parameter's and the pixels' gradient of a loss on ``tower``'s soft tokens within 1e-4 of
    ``stock_tower``'s (the same weights)."""
    expected = gradients(stock_tower, pixels, ids)
    assert_gradients_match(gradients(tower, pixels, ids), expected)
    assert expected["pixels"].abs().sum() > 0


def enable_checkpointing(tower, use_reentrant):
    """transformers' gradient checkpointing on ``tower``'s layers, as its trainers turn it on."""
    options = {"use_reentrant": use_reentrant}
    enable = getattr(tower, "activation_checkpointing_enable", None)  # 5.24+; older: gradient_checkpointing_...
    if enable is not None:
        enable(activation_checkpointing_kwargs=options)
    else:
        tower.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)


class LoRALinear(nn.Module):
    """A low-rank adapter around a frozen linear, as adapter libraries wrap one."""

    def __init__(self, base: nn.Linear, rank: int = 2):
        super().__init__()
        self.base, self.weight = base, base.weight
        self.down = nn.Parameter(torch.randn(rank, base.in_features, device=base.weight.device) * 0.1)
        self.up = nn.Parameter(torch.randn(base.out_features, rank, device=base.weight.device) * 0.1)

    def forward(self, x):
        return self.base(x) + x @ self.down.T @ self.up.T


def adapted(tower, layer=1):
    """``tower`` frozen but for a LoRA adapter on ``layer``'s q_proj, as adapter training leaves it."""
    for param in tower.parameters():
        param.requires_grad_(False)
    attn = tower.encoder.layers[layer].self_attn
    attn.q_proj.linear = LoRALinear(attn.q_proj.linear)
    return tower


def compiled_fullgraph_soft_tokens(tower, pixels, ids):
    """``tower``'s soft tokens through ``torch.compile(fullgraph=True)``, stock's one break (the boolean-mask
    strip of padding) captured as a dynamic-shape op, after a backward through the compiled graph."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        compiled_tower = torch.compile(tower, fullgraph=True, backend="aot_eager")
        compiled = compiled_tower(pixel_values=pixels, pixel_position_ids=ids).last_hidden_state
        compiled.square().mean().backward()
    torch._dynamo.reset()
    return compiled.detach()
