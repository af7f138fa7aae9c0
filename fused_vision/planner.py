"""How many images or video frames to send through Gemma 4's vision tower in one call.

vLLM chunks the tower's work with ``_encoder_chunk`` (gemma4_mm.py): a memory budget divided by the transient
bytes of one item, priced as the int64 one-hot of transformers 5.5-5.9's patch embedder. Without the
one-hot that price is ~8x the real peak: on a 22 GiB card with 3 GiB free it admits one 2520-patch image
where the tower's own activations (~96 MiB per image) leave room for sixteen. ``plan`` keeps vLLM's budget
as the safety net and divides it by the transient of the path in use; ``encoder_chunk`` is vLLM's function.

Budget (vLLM's)
    budget = min(free // 2, total // 10);   chunk = max(1, min(num_items, budget // cost))

Cost: peak transient bytes of one item in one tower forward, without autograd
    Weights and inputs are not transients. Each encoder layer frees its activations before the next runs,
    so the number of layers does not enter. Per patch, with

    b  bytes per element of the compute dtype   D  hidden size   I  intermediate size   N  patches per item
    H  attention heads, d head_dim, Q = H·d      P  position_embedding_size
    F  = 3·patch_size² pixel features (float32, as Gemma 4's processors emit them)
    m  = attention-mask bytes: N for sdpa's (N, N) bool mask, b·N for eager's additive one
         (transformers builds it whenever a chunk holds padding, and items are padded to N)
    c  = b·⌈N⌉₈ when 8 ∤ N, else 0: the mask copy memory-efficient attention pads to a multiple of 8

    held      = 2·b·D + m + 2·b·d              embedder output (the model's forward keeps it) and the
                                               layer's input; the attention mask; rope cos and sin
    embedder  = max(8·F, b·F + 5·b·D)          pixels - 0.5 and its double in float32; or the cast pixels,
                                               projection, x rows, y rows, their sum, the masked sum
    norm      = held + 2·b·D + 8·D             residual, input, two float32 copies inside RMSNorm
    attention = held + b·D + 3·b·Q + max(8·Q, scores)    normed input, q, k, v; float32 q/k/v norms
      sdpa:   scores = b·N + max(N, c) + b·Q + 4·H    the mask made additive in the compute dtype; the
                                               bool inverse older torch builds, or c; output, log-sum-exp
      eager:  scores = H·N·(b + 8)             scores, their float32 copy, the float32 softmax
                     = H·N·(b + 4) in float32  (transformers upcasts; float32 scores need no copy)
    mlp       = held + 2·b·D + 3·b·I           residual, input; activated gate, up projection, product
                                               (the same with clipped linears)
      eager:  norm and mlp add H·N·b           the layer keeps the attention weights until it returns

    fused  = N · (max(embedder, norm, attention, mlp) + 64) · 21/20
    onehot = max(32·N·P, fused)                vLLM's price of the 5.5-5.9 embedder's one-hot

    The pooler needs no term: its int64 (N, L) one-hot and float32 copies, at most
    3·b·D + max(12·L, 4·L + 5·D) per patch with L <= N/4 soft tokens, stay below the attention phase
    (whose mask terms alone reach 3·N) and the norm phase.

The 64 bytes per patch cover padding flags, int64 ids and pooling slots. The itemised peak matches the
H200 peaks of bench/baselines.md (read as MiB; stock 26B/31B tower, bf16, sdpa, 1-16 images, 4-64 frames) within
0.5 % either way; the 5 % on top covers what is not itemised: the CUDA caching allocator may hand out a
cached block up to 1 MiB larger than asked and counts all of it. For that tower the MLP phase is the peak
up to 5040 patches, the attention phase at 10080.

The one-hot lives inside the patch embedder and is freed before the first encoder layer runs, so the
encoder's activations do not add to it: path="onehot" costs the larger of the two. vLLM's price is itself
an upper bound (the baselines measured 502 MB per 2520-patch image; it charges 788 MiB) and exceeds the
encoder's peak for every real config with sdpa, where ``plan(path="onehot")`` equals
``min(num_items, encoder_chunk(...))``. Eager attention from 2520 patches up costs more than the one-hot,
which vLLM's function does not see.

Covered: transformers' stock Gemma 4 vision tower (F.embedding era) and fused_vision's lookup, which writes
less; ``attn_implementation`` "sdpa" (transformers' default; priced as the fused kernels of CUDA and the
CPU, which hold no (N, N) scores; ``plan`` prices MPS's, which does, as eager) or "eager"; inference only.
"""

from __future__ import annotations

import operator
import os
from dataclasses import dataclass

import torch

__all__ = ["encoder_chunk", "device_memory", "transient_bytes_per_item", "plan", "PATHS", "ATTENTION_IMPLEMENTATIONS"]

PATHS = ("fused", "onehot")
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
) -> int:
    """Items to encode per vision-tower call: ``max(1, min(num_items, budget // cost))``.

    ``budget`` is vLLM's ``min(free // 2, total // 10)``; ``cost`` is ``transient_bytes_per_item`` of the
    path in use, plus ``extra_bytes_per_item`` (what the caller allocates per item beside the tower, e.g.
    a device copy of its inputs). Memory comes from ``free_bytes`` and ``total_bytes`` when given, else
    from ``device_memory(device)``, ``device`` defaulting to the current accelerator (the CPU without one).
    On MPS, whose SDPA builds the (N, N) scores that CUDA's fused kernels never hold, sdpa is priced as
    eager attention. With path="onehot" and sdpa on CUDA this is ``min(num_items, encoder_chunk(...))``
    for every real config.
    """
    items = _positive_int("num_items", num_items)
    extra = _integer("extra_bytes_per_item", extra_bytes_per_item, 0)
    if (free_bytes is None) != (total_bytes is None):
        raise ValueError("free_bytes, total_bytes: pass both or neither")
    if free_bytes is not None and device is not None:
        raise ValueError("device: pass either a device or free_bytes and total_bytes, not both")
    if free_bytes is None:
        device = _visible_device(device) if device is not None else _current_device()
    if device is not None and device.type == "mps" and _attention(vision_config, attn_implementation) == "sdpa":
        attn_implementation = "eager"
    cost = extra + transient_bytes_per_item(
        patches_per_item, vision_config, path=path, dtype=dtype, attn_implementation=attn_implementation
    )
    if free_bytes is None:
        free, total = device_memory(device)
    else:
        free, total = _integer("free_bytes", free_bytes, 0), _integer("total_bytes", total_bytes, 0)
    return max(1, min(items, _budget(free, total) // cost))


def transient_bytes_per_item(
    patches_per_item: int,
    vision_config,
    *,
    path: str = "fused",
    dtype: torch.dtype = torch.bfloat16,
    attn_implementation: str | None = None,
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
    """
    patches = _positive_int("patches_per_item", patches_per_item)
    if path not in PATHS:
        raise ValueError(f"path: expected one of {PATHS}, got {path!r}")
    shape = _tower_shape(vision_config, attn_implementation)
    peak = _encoder_peak_bytes(shape, patches, _dtype_bytes(dtype))
    fused = _ceil_div(peak * _HEADROOM_NUMERATOR, _HEADROOM_DENOMINATOR)
    if path == "onehot":
        return max(_onehot_bytes(patches, shape.table_rows), fused)
    return fused


def _visible_device(device: torch.device | str | int) -> torch.device:
    """``torch.device(device)``, which must name a device this torch can see."""
    try:
        device = torch.device(device)
    except RuntimeError as exc:  # an index where this machine has no accelerator
        raise ValueError(f"device: {device!r} names no device here ({exc}); pass free_bytes and total_bytes") from None
    available = {"cuda": torch.cuda.is_available, "xpu": torch.xpu.is_available, "mps": torch.backends.mps.is_available}
    if device.type in available and not available[device.type]():
        raise ValueError(
            f"device: this torch sees no {device.type} device; "
            "pass free_bytes and total_bytes to plan for another machine"
        )
    return device


def device_memory(device: torch.device | str | int) -> tuple[int, int]:
    """(free_bytes, total_bytes) of ``device``, asked of its own backend.

    CUDA and ROCm (whose devices are "cuda" too): ``torch.cuda.mem_get_info``. XPU: ``torch.xpu.mem_get_info``.
    MPS: Metal's recommended working-set size as the total, less what the Metal driver holds for this
    process. CPU: available and total RAM from the operating system, within the process's cgroup memory
    limit (a container's) when it has one. Any other accelerator (HPU, an out-of-tree NPU, ...):
    ``torch.accelerator.get_memory_info`` where this torch has it (2.10+).
    """
    device = _visible_device(device)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
    elif device.type == "xpu":
        free, total = torch.xpu.mem_get_info(device)
    elif device.type == "mps":
        total = torch.mps.recommended_max_memory()
        free = max(0, total - torch.mps.driver_allocated_memory())
    elif device.type == "cpu":
        free, total = _host_memory()
    elif hasattr(torch.accelerator, "get_memory_info") and device.type == getattr(
        torch.accelerator.current_accelerator(check_available=True), "type", None
    ):
        free, total = torch.accelerator.get_memory_info(device)
    else:
        raise ValueError(
            f"device: cannot query memory of device type {device.type!r}; expected cuda, xpu, mps, cpu or "
            "this machine's accelerator with torch 2.10+ (or pass free_bytes and total_bytes)"
        )
    return int(free), int(total)


def _budget(free_bytes: int, total_bytes: int) -> int:
    """vLLM's encoder budget: half the free memory, at most a tenth of the device."""
    return min(free_bytes // 2, total_bytes // 10)


def _onehot_bytes(patches: int, table_rows: int) -> int:
    return patches * _ONEHOT_BYTES_PER_ROW * table_rows


def _host_memory() -> tuple[int, int]:
    """The host's available and total RAM, cut to the cgroup's limit and what it has left under it."""
    free, total = _machine_memory()
    limit = _cgroup_limit()
    if limit is not None:
        limit_bytes, used_bytes = limit
        free, total = min(free, max(0, limit_bytes - used_bytes)), min(total, limit_bytes)
    return free, total


def _machine_memory() -> tuple[int, int]:
    try:  # Linux: MemAvailable counts reclaimable page cache, which sysconf's free pages do not
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        return _kib_field(fields["MemAvailable"]), _kib_field(fields["MemTotal"])
    except (OSError, KeyError, ValueError):
        pass
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page
    except (AttributeError, ValueError, OSError) as exc:
        raise RuntimeError("device: cannot read this host's memory; pass free_bytes and total_bytes") from exc


CGROUP_ROOT = "/sys/fs/cgroup"
# (limit, usage) files: cgroup v2, then v1. v2's limit reads "max" when there is none; v1's, a huge number.
_CGROUP_FILES = (("memory.max", "memory.current"), ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"))


def _cgroup_limit() -> tuple[int, int] | None:
    """(limit, usage) bytes of the memory cgroup mounted at CGROUP_ROOT, or None without a limit. In a
    container (Docker, Kubernetes) that is the container's own; a process in a nested cgroup of a host
    is not looked up."""
    for limit_file, usage_file in _CGROUP_FILES:
        try:
            with open(os.path.join(CGROUP_ROOT, limit_file)) as f:
                limit = f.read().strip()
            with open(os.path.join(CGROUP_ROOT, usage_file)) as f:
                usage = int(f.read().strip())
            limit_bytes = None if limit == "max" else int(limit)
        except (OSError, ValueError):
            continue
        return None if limit_bytes is None or limit_bytes >= 2**62 else (limit_bytes, usage)
    return None


def _kib_field(value: str) -> int:
    amount, unit = value.split()
    if unit != "kB":
        raise ValueError(f"unexpected /proc/meminfo unit {unit!r}")
    return int(amount) * 1024


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


def _ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


def _encoder_peak_bytes(shape: _TowerShape, patches: int, dtype_bytes: int) -> int:
    """Bytes alive at the peak of one item's forward without the one-hot, before headroom.

    The module docstring's phases, in its notation.
    """
    b, n = dtype_bytes, patches
    D, I, H, d, F = shape.hidden, shape.intermediate, shape.heads, shape.head_dim, shape.pixel_features  # noqa: E741 (the docstring's notation)
    Q = H * d
    kept_weights = 0
    if shape.attention == "eager":
        mask = b * n
        scores = H * n * (b + (4 if b == 4 else 8))  # softmax's float32 output, and its float32 input copy
        kept_weights = H * n * b  # the encoder layer holds the attention weights (its `_`) until it returns
    else:
        mask = n
        aligned_copy = b * _ceil_div(n, 8) * 8 if n % 8 else 0  # memory-efficient attention's padded mask
        scores = b * n + max(n, aligned_copy) + b * Q + 4 * H
    held = 2 * b * D + mask + 2 * b * d

    per_patch = max(
        max(8 * F, b * F + 5 * b * D),  # patch embedder
        held + kept_weights + 2 * b * D + 8 * D,  # RMSNorm
        held + b * D + 3 * b * Q + max(8 * Q, scores),  # attention
        held + kept_weights + 2 * b * D + 3 * b * I,  # MLP
    )
    return n * (per_patch + _BOOKKEEPING_BYTES)


def _current_device() -> torch.device:
    # check_available: a CUDA build of torch names "cuda" even on a machine without a GPU or driver.
    return torch.accelerator.current_accelerator(check_available=True) or torch.device("cpu")
