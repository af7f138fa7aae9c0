"""Plain PyTorch versions of every op: the semantic definition, the benchmark baselines, and the
fallback on devices Triton does not drive.

These functions import torch only and do not validate their inputs; ``fused_vision``'s public ops do
(ids included), then call them.
"""

import math

import torch
import torch.nn.functional as F


def onehot_position_embeddings(
    table: torch.Tensor, position_ids: torch.Tensor, padding_positions: torch.Tensor
) -> torch.Tensor:
    """The lookup exactly as transformers 5.5-5.9 shipped it in ``Gemma4VisionPatchEmbedder``.

    Materialises an int64 one-hot of (B, N, 2, P) -- 160 KiB per patch at P = 10240 -- and multiplies
    it with the (2, P, D) table. Kept as the definition the fast paths are tested against and as the
    benchmark baseline; never use it for real work. ``position_ids`` must be int64 (``F.one_hot``).
    """
    clamped = position_ids.clamp(min=0)
    one_hot = F.one_hot(clamped, num_classes=table.shape[1])
    one_hot = one_hot.permute(0, 2, 1, 3).to(table)
    position_embeddings = (one_hot @ table).sum(dim=1)
    return torch.where(padding_positions.unsqueeze(-1), 0.0, position_embeddings)


def default_padding_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """Gemma 4's rule: a patch is padding only when both coordinates are -1."""
    return (position_ids == -1).all(dim=-1)


def position_embeddings(
    table: torch.Tensor,
    position_ids: torch.Tensor,
    padding_positions: torch.Tensor | None = None,
    *,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """The lookup as two gathers (the transformers 5.10+ formulation); bit-identical to the one-hot for a
    finite table, but for a -0.0 sum, which the one-hot's sum turns +0.0.

    ``table[0][x] + table[1][y]`` rounds once, as the one-hot's ``sum(dim=1)`` does, and
    ``residual + pe`` rounds once more, as the stock ``hidden_states + position_embeddings``.
    """
    if padding_positions is None:
        padding_positions = default_padding_positions(position_ids)
    clamped = position_ids.clamp(min=0)
    pe = F.embedding(clamped[..., 0], table[0]) + F.embedding(clamped[..., 1], table[1])
    pe = pe.masked_fill(padding_positions.unsqueeze(-1), 0.0)
    return pe if residual is None else residual + pe


def prescale_pixels(pixel_values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gemma 4's input scaling: ``2 * (p - 0.5)`` in the pixel dtype, then cast to the projection's dtype."""
    return (2 * (pixel_values - 0.5)).to(dtype)


def patch_embed(
    pixel_values: torch.Tensor,
    weight: torch.Tensor,
    table: torch.Tensor,
    position_ids: torch.Tensor,
    padding_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """``Gemma4VisionPatchEmbedder.forward``: prescale in the pixel dtype, cast, project, add the lookup."""
    hidden_states = F.linear(prescale_pixels(pixel_values, weight.dtype), weight)
    return position_embeddings(table, position_ids, padding_positions, residual=hidden_states)


def pooling_kernel_size(seq_len: int, output_length: int) -> int:
    """k with k * k * L == N, raising as ``Gemma4VisionPooler`` does when there is none."""
    if output_length > seq_len:
        raise ValueError(
            f"Cannot output more soft tokens (requested {output_length}) than there are patches ({seq_len})."
        )
    k = math.isqrt(seq_len // output_length)
    if k * k * output_length != seq_len:
        raise ValueError(
            f"Cannot pool {seq_len} patches to {output_length}: {k=}^2 times {output_length=} must be {seq_len}."
        )
    return k


def slot_overflow_error(k: int, output_length: int) -> ValueError:
    return ValueError(
        f"position_ids: the {k}x{k} blocks of positions need more than output_length={output_length} slots "
        "(stock's F.one_hot raises here too); check that the ids match the pixel grid"
    )


def pooling_slots(position_ids: torch.Tensor, k: int) -> torch.Tensor:
    """The output slot of every patch: k x k blocks of positions, numbered row-major over the item's width.

    For N = k * k * L, each coordinate is clamped to k * L = N / k first: an id past it already puts its
    patch (or, in an item at least k wide, the item) beyond the L slots, so no slot and no verdict changes,
    and the products stay at most L * L + L instead of wrapping int64 into a slot that looks valid or
    negative (stock's own formula wraps there)."""
    id_limit = position_ids.shape[-2] // k
    clamped = position_ids.long().clamp(0, id_limit)  # long first: int32 ids past ~46,000 would wrap
    max_x = clamped[..., 0].amax(dim=-1, keepdim=True) + 1
    return clamped[..., 0] // k + (max_x // k) * (clamped[..., 1] // k)


def onehot_pool_by_positions(
    hidden_states: torch.Tensor,
    position_ids: torch.Tensor,
    padding_positions: torch.Tensor,
    output_length: int,
    round_average: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``Gemma4VisionPooler.forward`` as transformers ships it: a (B, N, L) fp32 one-hot matmul (its slots
    from ``pooling_slots``, equal to stock's wherever stock's int64 arithmetic does not wrap).

    Returns the pooled features scaled by sqrt(D) in fp32 (as transformers 5.10+; 5.5-5.9 return them
    in the hidden dtype, i.e. this result cast back) and the mask of filled slots. When N == L stock
    skips the pooling and returns ``padding_positions`` itself as the mask (True = padding), which the
    tower then uses as if True meant valid; this mirrors it. ``round_average=False``: the fp32 averages
    are scaled without the round to the hidden dtype, as SGLang's ``EmbeddingGemma2VisionPooler`` does.
    """
    seq_len, hidden = hidden_states.shape[1], hidden_states.shape[2]
    hidden_states = hidden_states.masked_fill(padding_positions.unsqueeze(-1), 0.0)
    if seq_len == output_length:
        return hidden_states.float() * hidden**0.5, padding_positions
    k = pooling_kernel_size(seq_len, output_length)
    weights = F.one_hot(pooling_slots(position_ids, k).long(), output_length).float() / (k * k)
    pooled = weights.transpose(1, 2) @ hidden_states.float()
    if round_average:
        pooled = pooled.to(hidden_states.dtype)
    mask = torch.logical_not((weights == 0).all(dim=1))
    return pooled.float() * hidden**0.5, mask


def pool_by_positions(
    hidden_states: torch.Tensor,
    position_ids: torch.Tensor,
    padding_positions: torch.Tensor,
    output_length: int,
    round_average: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pooler as a scatter-add: same semantics as ``onehot_pool_by_positions``, no (B, N, L) one-hot.

    An item whose positions need slots at or past ``output_length`` comes out NaN, as from the kernel
    (stock's ``F.one_hot`` raises there; so does ``fused_vision.pool_by_positions`` while its id checks are
    on, before calling this).
    """
    batch, seq_len, hidden = hidden_states.shape
    hidden_states = hidden_states.masked_fill(padding_positions.unsqueeze(-1), 0.0)
    if seq_len == output_length:
        return hidden_states.float() * hidden**0.5, padding_positions
    k = pooling_kernel_size(seq_len, output_length)
    slots = pooling_slots(position_ids, k)
    overflow = slots >= output_length
    slots = slots.masked_fill(overflow, 0)  # an address in range; the item is NaN below
    # Out of place: vmap (per-sample gradients) refuses to scatter mapped items into a tensor that is not.
    sums = torch.zeros(batch, output_length, hidden, dtype=torch.float32, device=hidden_states.device)
    sums = sums.scatter_add(1, slots.unsqueeze(-1).expand(-1, -1, hidden), hidden_states.float())
    average = sums / (k * k)
    if round_average:
        average = average.to(hidden_states.dtype).float()
    pooled = average * hidden**0.5
    counts = torch.zeros(batch, output_length, dtype=torch.int32, device=hidden_states.device)
    counts = counts.scatter_add(1, slots, torch.ones_like(slots, dtype=torch.int32))
    return pooled.masked_fill(overflow.any(dim=-1)[:, None, None], float("nan")), counts > 0


def pool_by_positions_backward(
    grad_pooled: torch.Tensor,
    position_ids: torch.Tensor,
    padding_positions: torch.Tensor,
    output_length: int,
    hidden_dtype: torch.dtype,
    round_average: bool = True,
) -> torch.Tensor:
    """The hidden states' gradient of ``onehot_pool_by_positions``, rounded as stock autograd rounds it.

    Stock's chain, backwards: the fp32 sqrt(D) scale, the casts to the hidden dtype around the fp32
    one-hot matmul (the one after it only where the averages are rounded; its one nonzero term per
    patch is an exact 1/k^2 product, and a zero comes out +0.0), the masked_fill. The (B, N, D) result
    is bit-identical to autograd through the stock pooler for a finite gradient (stock's 0 * inf terms
    spread a slot's inf or NaN over the item's other patches).
    """
    seq_len, hidden = position_ids.shape[1], grad_pooled.shape[2]
    grad = grad_pooled * hidden**0.5
    if seq_len != output_length:
        if round_average:
            grad = grad.to(hidden_dtype)
        k = pooling_kernel_size(seq_len, output_length)
        slots = pooling_slots(position_ids, k).unsqueeze(-1).expand(-1, -1, hidden)
        grad = grad.float().gather(1, slots) * (1.0 / (k * k)) + 0.0  # a zero is +0.0, as the matmul's sum
    return grad.to(hidden_dtype).masked_fill(padding_positions.unsqueeze(-1), 0.0)


def position_embeddings_backward(
    grad: torch.Tensor, position_ids: torch.Tensor, padding_positions: torch.Tensor, num_positions: int
) -> torch.Tensor:
    """fp32 (2, P, D) gradient of the lookup's table: non-padding rows scatter-added into [axis, id].

    ``index_put_(accumulate=True)`` is deterministic on every device when deterministic algorithms
    are enabled, so this is also the deterministic path behind the Triton backend.
    """
    clamped = position_ids.clamp(min=0)
    grad = grad.float().masked_fill(padding_positions.unsqueeze(-1), 0.0).flatten(0, 1)
    acc = grad.new_zeros((2, num_positions, grad.shape[-1]))
    acc[0].index_put_((clamped[..., 0].flatten(),), grad, accumulate=True)
    acc[1].index_put_((clamped[..., 1].flatten(),), grad, accumulate=True)
    return acc


def rms_norm(hidden_states: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``Gemma4RMSNorm.forward``: in fp32, ``x * pow(mean(x²) + eps, -0.5)``, times ``weight`` (not
    ``1 + weight``) in fp32, rounded once to the input's dtype; ``weight=None`` is ``with_scale=False``."""
    x = hidden_states.float()
    normed = x * torch.pow(x.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        normed = normed * weight.float()
    return normed.type_as(hidden_states)


def clipped(x: torch.Tensor, clamps: torch.Tensor | None, row: int) -> torch.Tensor:
    """``Gemma4ClippableLinear``'s clamp to row ``row`` of a (rows, 2) fp32 (min, max) table; none without one."""
    return x if clamps is None else torch.clamp(x, clamps[row, 0], clamps[row, 1])


def rope_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """``Gemma4VisionRotaryEmbedding.forward`` for (..., 2) (x, y) positions and its d // 4 inverse
    frequencies: (..., d) cos and sin laid out x, x, y, y, cast to ``dtype``. (Stock's multiply by its
    attention_scaling, 1.0 for the axial RoPE, is exact and left out.)"""
    freqs = position_ids[..., None].float() * inv_freq.float()

    def recompose(f):
        return torch.cat([f[..., 0, :], f[..., 0, :], f[..., 1, :], f[..., 1, :]], dim=-1)

    return recompose(freqs.cos()).to(dtype), recompose(freqs.sin()).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def axial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_multidimensional_rope`` with two axes on (T, H, d) heads and (T, d) cos and sin: the x half
    and the y half each ``x * cos + rotate_half(x) * sin`` in the heads' dtype."""
    half = x.shape[-1] // 2
    parts = []
    for axis in range(2):
        part = slice(axis * half, (axis + 1) * half)
        parts.append(x[..., part] * cos[:, None, part] + rotate_half(x[..., part]) * sin[:, None, part])
    return torch.cat(parts, dim=-1)


def qkv_norm_rope(
    qkv: torch.Tensor,
    position_ids: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    inv_freq: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    eps: float = 1e-6,
    clamps: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``Gemma4VisionAttention.forward`` from the projections to the attention call, on (T, (H + 2 Hkv) d)
    fused projections: the output clamps (rows q, k, v of ``clamps``), q_norm, k_norm, v_norm, the axial
    RoPE on q and k. Returns contiguous (T, H, d) q and (T, Hkv, d) k and v."""
    head_dim = q_weight.shape[0]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    cos, sin = rope_cos_sin(position_ids, inv_freq, qkv.dtype)
    q = rms_norm(clipped(q, clamps, 0).unflatten(-1, (num_heads, head_dim)), q_weight, eps)
    k = rms_norm(clipped(k, clamps, 1).unflatten(-1, (num_kv_heads, head_dim)), k_weight, eps)
    v = rms_norm(clipped(v, clamps, 2).unflatten(-1, (num_kv_heads, head_dim)), None, eps)
    return axial_rope(q, cos, sin).contiguous(), axial_rope(k, cos, sin).contiguous(), v.contiguous()


def residual_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    post_weight: torch.Tensor,
    next_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``h = residual + post_norm(x)`` (post_norm's output rounded to the hidden dtype first, as stock's
    layer adds it) and ``y = next_norm(h)``, None without ``next_weight`` (the tower's last layer)."""
    h = residual + rms_norm(x, post_weight, eps)
    return h, None if next_weight is None else rms_norm(h, next_weight, eps)


def gelu_gate(gate_up: torch.Tensor, clamps: torch.Tensor | None = None) -> torch.Tensor:
    """``Gemma4VisionMLP``'s ``act_fn(gate_proj(x)) * up_proj(x)`` on the (..., 2I) fused gate/up output
    (gate first), with the clipped linears' clamps: rows 0 and 1 of ``clamps`` gate's and up's output
    clamps, row 2 down_proj's input clamp."""
    gate, up = gate_up.chunk(2, dim=-1)
    activated = F.gelu(clipped(gate, clamps, 0), approximate="tanh")
    if torch.is_grad_enabled() and gate_up.requires_grad:
        return clipped(activated * clipped(up, clamps, 1), clamps, 2)
    # No graph to keep: the product goes into the GELU's buffer, one (..., I) buffer fewer at the MLP's peak.
    product = activated.mul_(clipped(up, clamps, 1))
    return product if clamps is None else product.clamp_(clamps[2, 0], clamps[2, 1])


def gate_up_gelu(y: torch.Tensor, weight: torch.Tensor, clamps: torch.Tensor | None = None) -> torch.Tensor:
    """The MLP's gate/up GEMM and its activation, as the fused layer runs them: ``gelu_gate`` of
    ``F.linear(y, weight)`` on the (2I, D) concatenated gate and up weight."""
    return gelu_gate(F.linear(y, weight), clamps)
