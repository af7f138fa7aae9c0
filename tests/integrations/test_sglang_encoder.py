"""fused_vision.integrations.sglang inside SGLang's own ``Gemma4VisionEncoder``, built as its model builds it: its
tensor-parallel layers at world size 1 and the attention backend SGLang picks on a CPU (SDPA).

Also what SGLang's attention does with padding patches, which the patch does not touch: the backends
that drop the padding mask (Triton here, under Triton's interpreter) attend padding keys.
"""

import inspect
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fused_vision.integrations.sglang as fs
from fused_vision.integrations.sglang import apply_fused_vision_to_sglang_gemma4, revert_fused_vision_sglang_gemma4
from fused_vision.integrations.transformers import apply_fused_vision_to_gemma4

from helpers import (
    assert_as_accurate_as_stock,
    assert_bit_identical,
    assert_close,
    dtype_id,
    reverting_to_stock,
    run_together,
)
from sglang_towers import (
    embedding_gemma2,
    float64_twin,
    forbid_one_hot,
    inputs,
    make_encoder,
    runtime,
    single_process_world,
    vision,
)

attention_backends = vision.QKV_BACKEND_IMPL  # what Gemma4VisionAttention builds its backend from


@pytest.fixture(scope="module", autouse=True)
def sglang_world(tmp_path_factory):
    with single_process_world(tmp_path_factory.mktemp("sglang") / "process_group"):
        yield


stock_after_each_test = reverting_to_stock(revert_fused_vision_sglang_gemma4)


def test_the_encoder_under_test_is_sglangs_real_tower():
    encoder = make_encoder(torch.float32)
    assert runtime.get_parallel().attn_tp_size == runtime.get_parallel().tp_size == 1
    (layer,) = encoder.encoder.layers
    assert type(layer.self_attn) is vision.Gemma4VisionAttention
    assert type(layer.self_attn.qkv_backend) is attention_backends["sdpa"]  # SGLang's choice off CUDA and ROCm
    linears = [m for m in encoder.modules() if type(m).__module__ == "sglang.srt.layers.linear"]
    assert len(linears) == 4 and all(m.tp_group is runtime.get_parallel().tp_group for m in linears)
    assert runtime.get_parallel().tp_group.world_size == 1


def assert_soft_tokens_match_stock(fused, mask, stock, stock_mask, exact, what):
    """An encoder's (soft tokens, mask) against stock's: the mask bit for bit, the tokens stock's in fp32
    and no less accurate than stock's against the float64 twin's."""
    assert_bit_identical(mask, stock_mask, f"{what}: pooler mask")
    if stock.dtype == torch.float32:
        assert_close(fused, stock, rtol=1e-5, atol=1e-5, what=what)
    floor = 16 * 2**-24 if stock.dtype == torch.float32 else 2**-8
    assert_as_accurate_as_stock(fused, stock, exact, floor=floor, ords=(2, float("inf")), what=what)


@pytest.mark.parametrize("standardize", [False, True], ids=["plain", "standardize"])
@pytest.mark.parametrize("mask_first", [False, True], ids=["gemma4_mm", "mask_pad_before_pool"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_encoder_forward_matches_stock_without_a_one_hot(monkeypatch, dtype, mask_first, standardize, poisoned):
    """SGLang's own ``Gemma4VisionEncoder.forward`` with both modules patched at the class: no F.one_hot
    runs, and the soft tokens are stock's (fp32) and no less accurate than stock's against float64."""
    encoder = make_encoder(dtype, mask_first=mask_first, standardize=standardize)
    pixels, ids, _ = inputs(dtype)
    with torch.no_grad():
        stock, stock_mask = encoder(pixels, ids)
        exact, _ = float64_twin(encoder)(pixels.double(), ids)
        assert apply_fused_vision_to_sglang_gemma4() == 3
        assert "fused_vision=patch_embed(backend=auto)" in repr(encoder.patch_embedder)
        forbid_one_hot(monkeypatch)
        fused, mask = encoder(pixels, ids)
    assert_soft_tokens_match_stock(fused, mask, stock, stock_mask, exact, "SGLang soft tokens")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_embedding_gemma2_encoder_matches_stock_without_a_one_hot(monkeypatch, dtype, poisoned):
    """SGLang's EmbeddingGemma2Model builds Gemma4VisionEncoder and swaps in its own pooler: patched at
    the class, and then at the instance, its tower runs no F.one_hot and gives stock's soft tokens."""
    encoder = make_encoder(dtype)
    encoder.pooler = embedding_gemma2.EmbeddingGemma2VisionPooler(encoder.config)  # as EmbeddingGemma2Model does
    pixels, ids, _ = inputs(dtype)
    with torch.no_grad():
        stock, stock_mask = encoder(pixels, ids)
        exact, _ = float64_twin(encoder)(pixels.double(), ids)
        results = {}
        assert apply_fused_vision_to_sglang_gemma4() == 3
        with monkeypatch.context() as patch:
            forbid_one_hot(patch)
            results["class patch"] = encoder(pixels, ids)
        revert_fused_vision_sglang_gemma4()
        assert apply_fused_vision_to_sglang_gemma4(encoder) == 2
        assert "fused_vision=pool_by_positions(backend=auto)" in repr(encoder.pooler)
        forbid_one_hot(monkeypatch)
        results["instance patch"] = encoder(pixels, ids)
    for how, (fused, mask) in results.items():
        assert_soft_tokens_match_stock(fused, mask, stock, stock_mask, exact, f"{how}: EmbeddingGemma2 soft tokens")


# ---- patching: instances, revert, errors -------------------------------------------------------------------


def test_instance_patch_and_revert():
    encoder = make_encoder(torch.float32)
    pixels, ids, _ = inputs()
    with torch.no_grad():
        stock, _ = encoder(pixels, ids)
    assert apply_fused_vision_to_sglang_gemma4(encoder, backend="reference") == 2
    assert apply_fused_vision_to_sglang_gemma4(encoder, backend="reference") == 2  # idempotent
    assert "fused_vision=pool_by_positions(backend=reference)" in repr(encoder.pooler)
    other = make_encoder(torch.float32)
    assert getattr(other.patch_embedder, "_fused_vision", None) is None  # the instance patch stays its own
    assert revert_fused_vision_sglang_gemma4(encoder) == 2
    assert "fused_vision" not in repr(encoder)
    with torch.no_grad():
        assert_bit_identical(encoder(pixels, ids)[0], stock, "reverted encoder")


def test_apply_errors_name_the_problem(monkeypatch):
    encoder = make_encoder(torch.float32)
    with pytest.raises(ValueError, match="nothing selected"):
        apply_fused_vision_to_sglang_gemma4(embedder=None, pooler=False)
    with pytest.raises(ValueError, match="backend"):
        apply_fused_vision_to_sglang_gemma4(backend="cuda")
    with pytest.raises(TypeError, match="Module"):
        apply_fused_vision_to_sglang_gemma4("encoder")
    wanted = "Gemma4VisionPatchEmbedder, Gemma4VisionPooler or EmbeddingGemma2VisionPooler"
    with pytest.raises(ValueError, match=f"contains no {wanted}, so .*for transformers"):
        apply_fused_vision_to_sglang_gemma4(nn.Linear(2, 2))
    # transformers' patch, handed SGLang's tower, points to this one
    with pytest.raises(ValueError, match="SGLang model.*apply_fused_vision_to_sglang_gemma4"):
        apply_fused_vision_to_gemma4(encoder)
    monkeypatch.setitem(sys.modules, fs.SGLANG_MODULE, None)
    with pytest.raises(ImportError, match="needs SGLang with Gemma 4"):
        apply_fused_vision_to_sglang_gemma4()


# ---- SGLang's attention and padding keys (SGLang's behaviour, not the patch's) -----------------------------


def test_only_the_sdpa_and_ascend_backends_take_the_padding_mask():
    """``Gemma4VisionAttention.forward`` hands every backend cu_seqlens=None (each item one sequence of
    the padded length) and the mask as a keyword: FA3, FA4, Triton, aiter and XPU take it into **kwargs."""
    source = inspect.getsource(vision.Gemma4VisionAttention.forward)
    assert "cu_seqlens=None" in source and "attention_mask=attn_mask_4d" in source
    takes_mask = {
        name
        for name, cls in attention_backends.items()
        if "attention_mask" in inspect.signature(cls.forward).parameters
    }
    assert takes_mask == {"sdpa", "ascend_attn"}


def real_patch_states(backend, pixels, ids):
    """The hidden states SGLang's own encoder, built with this attention backend, hands its pooler."""
    with runtime.get_mm().override(mm_attention_backend=backend):
        encoder = make_encoder(torch.float32)
    assert type(encoder.encoder.layers[0].self_attn.qkv_backend) is attention_backends[backend]
    captured = []
    encoder.encoder.register_forward_hook(lambda module, args, output: captured.append(output))
    with torch.no_grad():
        encoder(pixels, ids)
    return captured[0]


def test_padding_keys_are_attended_where_the_backend_drops_the_mask():
    """Two runs that differ only in the padding patches' pixels. Under SGLang's SDPA backend no real
    patch's hidden state moves; under its Triton backend (its kernel under Triton's interpreter) every
    padded item's real patches do: they attend its padding keys. The unpadded item is the control, on
    which the two backends agree."""
    pixels, ids, padding = inputs(grids=[(9, 9), (9, 6), (6, 3), (3, 12)])
    assert not padding[0].any() and padding[1:].any(-1).all()
    runs = {"original": pixels, "repainted": pixels.masked_fill(padding.unsqueeze(-1), 0.7)}
    states = {(b, run): real_patch_states(b, p, ids) for b in ("sdpa", "triton_attn") for run, p in runs.items()}

    def largest(difference):  # per item, over its real patches
        return difference.abs().masked_fill(padding.unsqueeze(-1), 0).amax(dim=(1, 2))

    sdpa_moved = largest(states["sdpa", "repainted"] - states["sdpa", "original"])
    triton_moved = largest(states["triton_attn", "repainted"] - states["triton_attn", "original"])
    apart = largest(states["triton_attn", "original"] - states["sdpa", "original"])
    assert_bit_identical(sdpa_moved, torch.zeros(4), "real patches under SDPA, padding repainted")
    assert triton_moved[0] == 0 and (triton_moved[1:] > 1e-2).all(), triton_moved
    assert apart[0] < 1e-5 and (apart[1:] > 1e-2).all(), apart


# ---- the packed encoder (encoder="packed") -----------------------------------------------------------------


def masked_reference(encoder, pixels, ids):
    """Stock's forward with the padding masked throughout, as transformers' tower masks it: SGLang's sdpa
    attention (which applies the mask) and the padding zeroed before pooling. Returns it and its float64 twin's."""
    assert type(encoder.encoder.layers[0].self_attn.qkv_backend) is attention_backends["sdpa"]
    mask_first, encoder.pooler.mask_pad_before_pool = encoder.pooler.mask_pad_before_pool, True
    try:
        with torch.no_grad():
            return encoder(pixels, ids), float64_twin(encoder)(pixels.double(), ids)[0]
    finally:
        encoder.pooler.mask_pad_before_pool = mask_first


def backend_calls(monkeypatch, backend):
    """What each call of SGLang's ``backend`` attention is handed: (rows of q, cu_seqlens, attention_mask)."""
    calls, forward = [], attention_backends[backend].forward

    def spy(self, **kwargs):
        cu_seqlens = kwargs.get("cu_seqlens")
        calls.append(
            (kwargs["q"].shape[0], None if cu_seqlens is None else cu_seqlens.tolist(), kwargs["attention_mask"])
        )
        return forward(self, **kwargs)

    monkeypatch.setattr(attention_backends[backend], "forward", spy)
    return calls


@pytest.mark.parametrize("ops", [False, True], ids=["encoder_only", "with_ops"])
@pytest.mark.parametrize("mask_first", [False, True], ids=["gemma4_mm", "mask_pad_before_pool"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_packed_encoder_matches_the_masked_forward_under_sdpa(monkeypatch, dtype, mask_first, ops):
    """SGLang's sdpa backend takes no per-item cu_seqlens, so each item runs alone, unpadded and unmasked:
    the soft tokens are the masked forward's (fp32 within 1e-5, bf16 as accurate as it), where padding
    adds nothing to slot 0 even if the pooler does not mask it (stock adds it there)."""
    encoder = make_encoder(dtype, mask_first=mask_first, standardize=True)
    pixels, ids, padding = inputs(dtype)
    (stock, stock_mask), exact = masked_reference(encoder, pixels, ids)
    options = {} if ops else dict(embedder=None, pooler=False)
    assert apply_fused_vision_to_sglang_gemma4(encoder="packed", **options) == (4 if ops else 1)
    assert "fused_vision=packed_encoder(backend=auto)" in repr(encoder)
    calls = backend_calls(monkeypatch, "sdpa")
    with torch.no_grad():
        packed, mask = encoder(pixels, ids)
    real = (~padding).sum(1).tolist()
    assert [(rows, cu, m) for rows, cu, m in calls] == [(n, None, None) for n in real] * len(encoder.encoder.layers)
    assert packed.dtype == stock.dtype and packed.shape == stock.shape
    assert_soft_tokens_match_stock(packed, mask, stock, stock_mask, exact, "packed soft tokens (sdpa)")


def test_packed_encoder_ignores_padding_where_the_backend_drops_the_mask(monkeypatch):
    """Under SGLang's Triton backend (its kernel under Triton's interpreter), which drops stock's mask, the
    packed forward hands the kernel the items' cu_seqlens over one sequence: its soft tokens do not move
    when the padding pixels do, and they are the masked forward's, which stock's are not."""
    pixels, ids, padding = inputs(grids=[(9, 9), (9, 6), (6, 3), (3, 12)])
    repainted = pixels.masked_fill(padding.unsqueeze(-1), 0.7)
    (reference, reference_mask), _ = masked_reference(make_encoder(torch.float32), pixels, ids)
    with runtime.get_mm().override(mm_attention_backend="triton_attn"):
        encoder = make_encoder(torch.float32)  # the same weights: the same seed
    with torch.no_grad():
        stock, _ = encoder(pixels, ids)
        assert apply_fused_vision_to_sglang_gemma4(encoder, embedder=None, pooler=False, encoder="packed") == 1
        calls = backend_calls(monkeypatch, "triton_attn")
        packed, mask = encoder(pixels, ids)
        moved, _ = encoder(repainted, ids)
    lengths = (~padding).sum(1).tolist()
    offsets = [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    assert calls == [(offsets[-1], offsets, None)] * 2 * len(encoder.encoder.layers)  # two packed forwards
    assert_bit_identical(moved, packed, "packed soft tokens, padding repainted (Triton)")
    assert_bit_identical(mask, reference_mask, "packed pooler mask (Triton)")
    assert_close(packed, reference, rtol=1e-5, atol=1e-5, what="packed soft tokens (Triton) vs the masked forward")
    apart = (stock - reference).abs().amax(dim=(1, 2))
    assert apart[0] < 1e-5 and (apart[1:] > 1e-2).all(), apart  # stock's padded items attend their padding


def test_packed_forwards_in_two_threads_attend_within_their_own_items(monkeypatch):
    """Two threads' packed forwards of other items through one encoder, both inside its layer at once, each
    return what they return alone. Triton's backend with its kernel in sdpa per cu_seqlens segment (the
    interpreter runs one thread at a time); it checks that the boundaries it is handed are its call's."""

    def per_segment(self, q, k, v, cu_seqlens, **kwargs):
        assert cu_seqlens is not None and int(cu_seqlens[-1]) == q.shape[0], "another call's boundaries"
        bounds = cu_seqlens.tolist()
        heads = [[t[start:end].transpose(0, 1) for t in (q, k, v)] for start, end in zip(bounds, bounds[1:])]
        return torch.cat([F.scaled_dot_product_attention(*h, scale=1.0).transpose(0, 1) for h in heads])

    monkeypatch.setattr(attention_backends["triton_attn"], "forward", per_segment)
    with runtime.get_mm().override(mm_attention_backend="triton_attn"):
        encoder = make_encoder(torch.float32)
    apply_fused_vision_to_sglang_gemma4(encoder, embedder=None, pooler=False, encoder="packed")
    batches = [inputs()[:2], inputs(grids=[(3, 3), (9, 9)])[:2]]
    calls = [lambda pixels=pixels, ids=ids: encoder(pixels, ids)[0] for pixels, ids in batches]
    meeting_point = encoder.encoder.layers[0]
    with torch.no_grad():
        alone = [run_together(meeting_point, call)[0] for call in calls]
        together = run_together(meeting_point, *calls)
    for index, (got, expected) in enumerate(zip(together, alone, strict=True)):
        assert_bit_identical(got, expected, f"thread {index}'s soft tokens")


def test_packed_encoder_reverts_and_runs_stock_where_it_cannot_pack():
    encoder = make_encoder(torch.float32)
    pixels, ids, padding = inputs()
    with torch.no_grad():
        stock, stock_mask = encoder(pixels, ids)
        assert apply_fused_vision_to_sglang_gemma4(embedder=None, pooler=False, encoder="packed") == 1
        empty_ids = ids.clone()
        empty_ids[1] = -1  # an item with no real patch: stock's own forward
        expected = patching_stock(encoder, pixels, empty_ids)
        assert_bit_identical(encoder(pixels, empty_ids)[0], expected, "an item without real patches")
        assert revert_fused_vision_sglang_gemma4() == 1
        assert "fused_vision" not in repr(encoder)
        reverted, reverted_mask = encoder(pixels, ids)
    assert_bit_identical(reverted, stock, "reverted encoder")
    assert_bit_identical(reverted_mask, stock_mask, "reverted encoder's mask")
    with pytest.raises(ValueError, match="encoder: expected one of"):
        apply_fused_vision_to_sglang_gemma4(encoder="flat")


def patching_stock(encoder, pixels, ids):
    """SGLang's own forward, whatever is patched."""
    return vision.Gemma4VisionEncoder.__dict__["_fused_vision_stock_forward"](encoder, pixels, ids)[0]
