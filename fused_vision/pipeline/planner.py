"""How many images or video frames to send through Gemma 4's vision tower in one call.

vLLM's ``_encoder_chunk`` divides a budget, ``min(free // 2, total // 10)``, by the transient bytes of one
item priced as transformers 5.5-5.9's int64 one-hot, ~8x the real peak. ``plan`` keeps that budget as the
safety net and divides it by the transient of the path in use (padded, or ``plan_tokens`` for the packed
encoder's real patches); ``encoder_chunk`` is vLLM's function. The cost model, itemised per phase (held
tensors, embedder, norm, attention, MLP; 64 bytes per patch; 5 % on top), what it covers and how well it
fits the measured peaks: docs/planner.md.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from ._memory import current_device, device_memory, visible_device

__all__ = [
    "encoder_chunk",
    "device_memory",
    "transient_bytes_per_item",
    "plan",
    "plan_tokens",
    "PATHS",
    "PLANNED_ENCODERS",
    "ATTENTION_IMPLEMENTATIONS",
]

PATHS = ("fused", "onehot")
PLANNED_ENCODERS = ("stock", "packed")  # stock's padded encoder, or fused_vision.encoder.packed
ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")

_BOOKKEEPING_BYTES = 64  # per patch: padding flags, int64 position ids and pooling slots
_HEADROOM_NUMERATOR, _HEADROOM_DENOMINATOR = 21, 20  # 5 % for the caching allocator's block rounding
_ONEHOT_BYTES_PER_ROW = 4 * 8  # vLLM's price: 4 int64 one-hot entries per patch and table row


def encoder_chunk(patches_per_item: int, free_bytes: int, total_bytes: int, position_embedding_size: int) -> int:
    """Items per call as vLLM's ``_encoder_chunk`` plans them: budget // one-hot cost, at least 1.

    Equals vLLM's function for every integer input, numpy integers included: never raises on them,
    never divides by zero, never returns less than 1. Prices each item by the one-hot of
    transformers 5.5-5.9, 32·N·P bytes.
    """
    # Python ints: numpy's int64 would overflow in the cost product for large inputs.
    patches = operator.index(patches_per_item)
    budget = _budget(operator.index(free_bytes), operator.index(total_bytes))
    cost = _onehot_bytes(patches, operator.index(position_embedding_size))
    if patches <= 0 or budget <= 0 or cost <= 0:
        return 1
    return max(1, budget // cost)


def plan(
    num_items: int,
    patches_per_item: int,
    vision_config,
    *,
    path: str = "fused",
    device: torch.device | str | None = None,
    free_bytes: int | None = None,
    total_bytes: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    attn_implementation: str | None = None,
    extra_bytes_per_item: int = 0,
    encoder: str = "stock",
) -> int:
    """Items to encode per vision-tower call: ``max(1, min(num_items, budget // cost))``.

    ``budget`` is vLLM's ``min(free // 2, total // 10)``; ``cost`` is ``transient_bytes_per_item`` of the
    path and ``encoder`` in use, plus ``extra_bytes_per_item`` (what the caller allocates per item beside the
    tower, e.g. a device copy of its inputs). Memory comes from ``free_bytes`` and ``total_bytes`` when given, else
    from ``device_memory(device)``, ``device`` defaulting to the current accelerator (the CPU without one).
    On MPS, whose SDPA builds the (N, N) scores that CUDA's fused kernels never hold, sdpa is priced as
    eager attention. With path="onehot" and sdpa on CUDA this is ``min(num_items, encoder_chunk(...))``
    for every real config.
    """
    items = _positive_int("num_items", num_items)
    extra = _integer("extra_bytes_per_item", extra_bytes_per_item, 0)
    memory = _check_memory_arguments(device, free_bytes, total_bytes)
    device = _planned_device(device, free_bytes)
    attn_implementation = _priced_attention(vision_config, attn_implementation, device)
    cost = extra + transient_bytes_per_item(
        patches_per_item,
        vision_config,
        path=path,
        dtype=dtype,
        attn_implementation=attn_implementation,
        encoder=encoder,
    )
    return max(1, min(items, _planned_budget(device, memory) // cost))


def plan_tokens(
    longest_item: int,
    vision_config,
    *,
    path: str = "fused",
    device: torch.device | str | None = None,
    free_bytes: int | None = None,
    total_bytes: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    attn_implementation: str | None = None,
    extra_bytes_per_patch: int = 0,
) -> int:
    """Real patches per call of the packed encoder: ``max(1, (budget - S) // c)``.

    ``c`` is the packed encoder's bytes per real patch with headroom (the larger of it and the one-hot's
    32·P for path="onehot"), plus ``extra_bytes_per_patch``; ``S`` the scores of the longest item
    (``longest_item`` real patches) where the attention kernel materialises them (MPS), else 0. The budget,
    ``device``, ``free_bytes``, ``total_bytes``, ``dtype`` and ``attn_implementation`` are ``plan``'s.
    The caller fills each call with whole items up to that many patches, at least one item.
    """
    longest = _positive_int("longest_item", longest_item)
    extra = _integer("extra_bytes_per_patch", extra_bytes_per_patch, 0)
    if path not in PATHS:
        raise ValueError(f"path: expected one of {PATHS}, got {path!r}")
    memory = _check_memory_arguments(device, free_bytes, total_bytes)
    device = _planned_device(device, free_bytes)
    shape = _tower_shape(vision_config, _priced_attention(vision_config, attn_implementation, device))
    per_patch, per_square = _packed_costs(shape, _dtype_bytes(dtype))
    cost = _with_headroom(per_patch)
    if path == "onehot":
        cost = max(cost, _onehot_bytes(1, shape.table_rows))
    scores = _with_headroom(per_square * longest * longest)
    return max(1, (_planned_budget(device, memory) - scores) // (cost + extra))


def _check_memory_arguments(device, free_bytes, total_bytes) -> tuple[int, int] | None:
    """The caller's (free, total) as ints, checked to be one device's reading; None when not given."""
    if (free_bytes is None) != (total_bytes is None):
        raise ValueError("free_bytes, total_bytes: pass both or neither")
    if free_bytes is None:
        return None
    if device is not None:
        raise ValueError("device: pass either a device or free_bytes and total_bytes, not both")
    free, total = _integer("free_bytes", free_bytes, 0), _integer("total_bytes", total_bytes, 0)
    if free > total:
        # Not one device's reading (devices or units mixed): vLLM's min(free // 2, total // 10) would hide it.
        raise ValueError(
            f"free_bytes, total_bytes: expected free memory at most the device's total, got free_bytes={free} "
            f"> total_bytes={total}"
        )
    return free, total


def _planned_device(device, free_bytes) -> torch.device | None:
    """The device whose memory to ask: ``device``, else the current accelerator; None with ``free_bytes``."""
    if free_bytes is not None:
        return None
    return visible_device(device) if device is not None else current_device()


def _priced_attention(vision_config, attn_implementation, device) -> str | None:
    """MPS's SDPA builds the (N, N) scores that CUDA's and the CPU's fused kernels never hold: eager's price."""
    if device is not None and device.type == "mps" and _attention(vision_config, attn_implementation) == "sdpa":
        return "eager"
    return attn_implementation


def _planned_budget(device, memory: tuple[int, int] | None) -> int:
    return _budget(*(device_memory(device) if memory is None else memory))


def transient_bytes_per_item(
    patches_per_item: int,
    vision_config,
    *,
    path: str = "fused",
    dtype: torch.dtype = torch.bfloat16,
    attn_implementation: str | None = None,
    encoder: str = "stock",
) -> int:
    """Peak transient bytes one item adds to a vision-tower forward (see the module docstring).

    Args:
        patches_per_item: N, the patches every item is padded to (630 per video frame, 2520 per image).
        vision_config: a transformers ``Gemma4VisionConfig``, or any object with ``hidden_size``,
            ``intermediate_size``, ``num_attention_heads``, ``head_dim`` and ``position_embedding_size``
            (``patch_size`` defaults to Gemma 4's 16).
        path: "fused" (no one-hot: fused_vision or transformers 5.10+) or "onehot" (transformers 5.5-5.9).
        dtype: the tower's compute dtype.
        attn_implementation: "sdpa" or "eager"; default: the config's ``_attn_implementation``, else "sdpa"
            (transformers' default).
        encoder: "stock" (every item padded to N, behind an (N, N) mask) or "packed" (``fused_vision.encoder.packed``:
            N is the item's real patches; no mask, attention per item).
    """
    patches = _positive_int("patches_per_item", patches_per_item)
    if path not in PATHS:
        raise ValueError(f"path: expected one of {PATHS}, got {path!r}")
    if encoder not in PLANNED_ENCODERS:
        raise ValueError(f"encoder: expected one of {PLANNED_ENCODERS}, got {encoder!r}")
    shape = _tower_shape(vision_config, attn_implementation)
    if encoder == "packed":
        per_patch, per_square = _packed_costs(shape, _dtype_bytes(dtype))
        peak = patches * per_patch + per_square * patches * patches
    else:
        peak = _encoder_peak_bytes(shape, patches, _dtype_bytes(dtype))
    fused = _with_headroom(peak)
    if path == "onehot":
        return max(_onehot_bytes(patches, shape.table_rows), fused)
    return fused


def _budget(free_bytes: int, total_bytes: int) -> int:
    """vLLM's encoder budget: half the free memory, at most a tenth of the device."""
    return min(free_bytes // 2, total_bytes // 10)


def _onehot_bytes(patches: int, table_rows: int) -> int:
    return patches * _ONEHOT_BYTES_PER_ROW * table_rows


@dataclass(frozen=True)
class _TowerShape:
    hidden: int
    intermediate: int
    heads: int
    head_dim: int
    pixel_features: int
    table_rows: int
    attention: str


def _integer(name: str, value, minimum: int) -> int:
    kind = "a positive integer" if minimum == 1 else "a non-negative integer"
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected {kind}, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected {kind}, got {type(value).__name__}") from None
    if value < minimum:
        raise ValueError(f"{name}: expected {kind}, got {value}")
    return value


def _positive_int(name: str, value) -> int:
    return _integer(name, value, 1)


def _attention(vision_config, attn_implementation: str | None) -> str:
    """The attention implementation asked for, else the config's, else transformers' default."""
    return attn_implementation or getattr(vision_config, "_attn_implementation", None) or "sdpa"


def _tower_shape(vision_config, attn_implementation: str | None) -> _TowerShape:
    def field(name: str) -> int:
        if not hasattr(vision_config, name):
            raise TypeError(f"vision_config: expected a Gemma4VisionConfig or an object with {name!r}")
        return _positive_int(f"vision_config.{name}", getattr(vision_config, name))

    heads = field("num_attention_heads")
    kv_heads = getattr(vision_config, "num_key_value_heads", heads)
    if kv_heads != heads:  # repeat_kv copies are not modelled; Gemma 4's vision tower has none
        raise ValueError(f"vision_config.num_key_value_heads: expected {heads} (= num_attention_heads), got {kv_heads}")
    # patch_size defaults to Gemma 4's 16 (every released checkpoint).
    patch_size = _positive_int("vision_config.patch_size", getattr(vision_config, "patch_size", 16))
    attention = _attention(vision_config, attn_implementation)
    if attention not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(f"attn_implementation: expected one of {ATTENTION_IMPLEMENTATIONS}, got {attention!r}")
    return _TowerShape(
        hidden=field("hidden_size"),
        intermediate=field("intermediate_size"),
        heads=heads,
        head_dim=field("head_dim"),
        pixel_features=3 * patch_size**2,
        table_rows=field("position_embedding_size"),
        attention=attention,
    )


def _dtype_bytes(dtype) -> int:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype: expected a floating-point torch.dtype, got {dtype!r}")
    return dtype.itemsize


def _with_headroom(peak: int) -> int:
    return _ceil_div(peak * _HEADROOM_NUMERATOR, _HEADROOM_DENOMINATOR)


def _ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


def _encoder_peak_bytes(shape: _TowerShape, patches: int, dtype_bytes: int) -> int:
    """Bytes alive at the peak of one item's forward without the one-hot, before headroom.

    The module docstring's phases, in its notation.
    """
    b, n = dtype_bytes, patches
    H, Q = shape.heads, shape.heads * shape.head_dim
    kept_weights = 0
    if shape.attention == "eager":
        mask = b * n
        scores = H * n * _softmax_bytes(b)
        kept_weights = H * n * b  # the encoder layer holds the attention weights (its `_`) until it returns
    else:
        mask = n
        aligned_copy = b * _ceil_div(n, 8) * 8 if n % 8 else 0  # memory-efficient attention's padded mask
        scores = b * n + max(n, aligned_copy) + b * Q + 4 * H
    return n * _bytes_per_patch(shape, b, mask, scores, kept_weights)


def _softmax_bytes(b: int) -> int:
    """Per score: itself, softmax's float32 output, and its float32 input copy (none for float32 scores)."""
    return b + (4 if b == 4 else 8)


def _bytes_per_patch(shape: _TowerShape, b: int, mask: int, scores: int, kept_weights: int) -> int:
    """The peak phase's bytes per patch (the module docstring's phases), bookkeeping included."""
    D, I, H, d, F = shape.hidden, shape.intermediate, shape.heads, shape.head_dim, shape.pixel_features  # noqa: E741 (the docstring's notation)
    Q = H * d
    held = 2 * b * D + mask + 2 * b * d
    per_patch = max(
        max(8 * F, b * F + 5 * b * D),  # patch embedder
        held + kept_weights + 2 * b * D + 8 * D,  # RMSNorm
        held + b * D + 3 * b * Q + max(8 * Q, scores),  # attention
        held + kept_weights + 2 * b * D + 3 * b * I,  # MLP
    )
    return per_patch + _BOOKKEEPING_BYTES


def _packed_costs(shape: _TowerShape, b: int) -> tuple[int, int]:
    """The packed encoder's bytes: (per real patch, per square patch of the longest item). No mask, no padding;
    each item's outputs and their concatenation, log-sum-exp; where the kernel materialises scores
    (eager-priced: MPS), one item's at a time."""
    H, Q = shape.heads, shape.heads * shape.head_dim
    per_patch = _bytes_per_patch(shape, b, mask=0, scores=2 * b * Q + 4 * H, kept_weights=0)
    return per_patch, H * _softmax_bytes(b) if shape.attention == "eager" else 0
