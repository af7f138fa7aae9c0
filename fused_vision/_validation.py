"""Input checks shared by the public ops: clear errors instead of memory faults or garbage.

The ``check_*_inputs`` functions look only at shapes, dtypes and devices, so torch.compile traces them
for free; the id range check reads the data and runs inside the ops' implementations.
"""

import os

import torch

from ._dispatch import every_item

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def _names(dtypes) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def check_tensor(name: str, value, ndim: int, dtypes) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    if value.layout is not torch.strided:
        raise TypeError(f"{name}: expected a dense (strided) tensor, got layout {value.layout}")
    if value.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(value.shape)}")
    if value.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype in ({_names(dtypes)}), got {value.dtype}")


def check_shape(name: str, value: torch.Tensor, expected: tuple, described: str) -> None:
    if tuple(value.shape) != tuple(expected):
        raise ValueError(f"{name}: expected shape {described} = {tuple(expected)}, got {tuple(value.shape)}")


def check_same_device(**tensors: torch.Tensor | None) -> None:
    named = [(name, t.device) for name, t in tensors.items() if t is not None]
    first_name, first_device = named[0]
    for name, device in named[1:]:
        if device != first_device:
            raise ValueError(f"{name}: expected a tensor on {first_device} like {first_name}, got one on {device}")


ENV_CHECK_IDS = "FUSED_VISION_CHECK_IDS"


def id_checks_enabled(position_ids: torch.Tensor) -> bool:
    """Whether to run the checks that read the ids and so synchronise the device.

    Not where a sync is unwanted: while a CUDA graph is being captured (a sync would break the capture),
    while ``torch.cuda.set_sync_debug_mode`` is armed (vLLM's VLLM_GPU_SYNC_CHECK arms it and fails on
    a sync outside the regions it allows, which leave out the patch embedder), or when
    FUSED_VISION_CHECK_IDS=0. The Triton kernels then write NaN where bad ids would have led them
    astray (a row's lookup, an item's pooled slots) instead of reading out of bounds or dropping patches.
    """
    if os.environ.get(ENV_CHECK_IDS) == "0":
        return False
    if not position_ids.is_cuda:
        return True
    return not (torch.cuda.is_current_stream_capturing() or torch.cuda.get_sync_debug_mode())


def check_position_ids_range(position_ids: torch.Tensor, num_positions: int) -> None:
    """Ids must lie below P; negative ids read row 0, as stock's ``clamp(min=0)`` makes them.
    One max reduction and one device-to-host sync (see id_checks_enabled)."""
    if position_ids.numel() == 0 or not id_checks_enabled(position_ids):
        return
    high = every_item(position_ids).max().item()
    if high >= num_positions:
        raise ValueError(
            f"position_ids: expected values below {num_positions} (= position_embedding_size; "
            f"negative ids read row 0, -1 on both axes marks padding), got a maximum of {high}"
        )


def check_ids_and_padding(position_ids: torch.Tensor, padding_positions: torch.Tensor | None) -> tuple[int, int]:
    """Shapes and dtypes of (B, N, 2) ids and optional (B, N) padding; returns (B, N)."""
    check_tensor("position_ids", position_ids, 3, INDEX_DTYPES)
    batch, seq_len, axes = position_ids.shape
    if axes != 2:
        raise ValueError(f"position_ids: expected shape (B, N, 2) with (x, y) last, got {tuple(position_ids.shape)}")
    if padding_positions is not None:
        check_tensor("padding_positions", padding_positions, 2, (torch.bool,))
        check_shape("padding_positions", padding_positions, (batch, seq_len), "(B, N)")
    return batch, seq_len


def check_table(table: torch.Tensor, dtypes=FLOAT_DTYPES) -> None:
    check_tensor("table", table, 3, dtypes)
    if table.shape[0] != 2 or table.shape[1] == 0:
        raise ValueError(f"table: expected shape (2, P, D) with P >= 1, got {tuple(table.shape)}")


def check_position_inputs(
    table: torch.Tensor,
    position_ids: torch.Tensor,
    padding_positions: torch.Tensor | None,
    residual: torch.Tensor | None,
) -> None:
    check_table(table)
    batch, seq_len = check_ids_and_padding(position_ids, padding_positions)
    if residual is not None:
        check_tensor("residual", residual, 3, (table.dtype,))
        check_shape("residual", residual, (batch, seq_len, table.shape[2]), "(B, N, D)")
    check_same_device(table=table, position_ids=position_ids, padding_positions=padding_positions, residual=residual)


def check_patch_embed_inputs(
    pixel_values: torch.Tensor,
    weight: torch.Tensor,
    table: torch.Tensor,
    position_ids: torch.Tensor,
    padding_positions: torch.Tensor | None,
) -> None:
    check_tensor("weight", weight, 2, FLOAT_DTYPES)
    hidden, features = weight.shape
    check_table(table, (weight.dtype,))
    if table.shape[2] != hidden:
        raise ValueError(
            f"table: expected shape (2, P, D) with D = weight.shape[0] = {hidden}, got {tuple(table.shape)}"
        )
    batch, seq_len = check_ids_and_padding(position_ids, padding_positions)
    check_tensor("pixel_values", pixel_values, 3, FLOAT_DTYPES)
    check_shape("pixel_values", pixel_values, (batch, seq_len, pixel_values.shape[2]), "(B, N, K) like position_ids")
    # The pixels' width is the processor's (3 * patch_size**2); a weight of another width is the weight's fault.
    if features != pixel_values.shape[2]:
        raise ValueError(
            f"weight: expected shape (D, K) with K = pixel_values.shape[2] = {pixel_values.shape[2]}, "
            f"got {tuple(weight.shape)}"
        )
    check_same_device(
        pixel_values=pixel_values,
        weight=weight,
        table=table,
        position_ids=position_ids,
        padding_positions=padding_positions,
    )


def check_pool_inputs(
    hidden_states: torch.Tensor,
    position_ids: torch.Tensor,
    padding_positions: torch.Tensor,
    output_length,
    round_average,
) -> None:
    check_tensor("hidden_states", hidden_states, 3, FLOAT_DTYPES)
    if not isinstance(round_average, bool):
        raise TypeError(f"round_average: expected a bool, got {type(round_average).__name__}")
    batch, seq_len = check_ids_and_padding(position_ids, padding_positions)
    if padding_positions is None:
        raise TypeError("padding_positions: expected a (B, N) bool tensor, got None")
    check_shape("hidden_states", hidden_states, (batch, seq_len, hidden_states.shape[2]), "(B, N, D) like position_ids")
    # A SymInt under torch.compile with dynamic shapes (transformers computes L from a tensor's shape).
    if isinstance(output_length, bool) or not isinstance(output_length, (int, torch.SymInt)) or output_length < 1:
        raise ValueError(f"output_length: expected a positive int, got {output_length!r}")
    check_same_device(hidden_states=hidden_states, position_ids=position_ids, padding_positions=padding_positions)


def check_eps(eps) -> None:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps: expected a non-negative float, got {eps!r}")


def check_clamps(clamps: torch.Tensor | None, rows: int, described: str) -> None:
    if clamps is not None:
        check_tensor("clamps", clamps, 2, (torch.float32,))
        check_shape("clamps", clamps, (rows, 2), f"({described}) x (min, max)")


def check_norm_weight(name: str, weight: torch.Tensor | None, size: int, described: str) -> None:
    if weight is not None:
        check_tensor(name, weight, 1, FLOAT_DTYPES)
        check_shape(name, weight, (size,), described)


def check_qkv_norm_rope_inputs(qkv, position_ids, q_weight, k_weight, inv_freq, num_heads, num_kv_heads, eps, clamps):
    check_tensor("qkv", qkv, 2, FLOAT_DTYPES)
    check_tensor("q_weight", q_weight, 1, FLOAT_DTYPES)
    head_dim = q_weight.shape[0]
    if head_dim == 0 or head_dim % 4:
        raise ValueError(f"q_weight: expected shape (head_dim,) with head_dim a positive multiple of 4, got {head_dim}")
    check_norm_weight("k_weight", k_weight, head_dim, "(head_dim,)")
    for name, heads in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
        if isinstance(heads, bool) or not isinstance(heads, (int, torch.SymInt)) or heads < 1:
            raise ValueError(f"{name}: expected a positive int, got {heads!r}")
    columns = (num_heads + 2 * num_kv_heads) * head_dim
    check_shape("qkv", qkv, (qkv.shape[0], columns), "(T, (num_heads + 2 * num_kv_heads) * head_dim)")
    check_tensor("position_ids", position_ids, 2, INDEX_DTYPES)
    check_shape("position_ids", position_ids, (qkv.shape[0], 2), "(T, 2)")
    check_tensor("inv_freq", inv_freq, 1, (torch.float32,))
    check_shape("inv_freq", inv_freq, (head_dim // 4,), "(head_dim // 4,)")
    check_eps(eps)
    check_clamps(clamps, 3, "q, k, v")
    check_same_device(
        qkv=qkv, position_ids=position_ids, q_weight=q_weight, k_weight=k_weight, inv_freq=inv_freq, clamps=clamps
    )


def check_residual_rms_norm_inputs(x, residual, post_weight, next_weight, eps):
    check_tensor("x", x, x.dim() if isinstance(x, torch.Tensor) else 1, FLOAT_DTYPES)
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"x: expected shape (..., D) with D >= 1, got {tuple(x.shape)}")
    check_tensor("residual", residual, x.dim(), (x.dtype,))
    check_shape("residual", residual, x.shape, "x's shape")
    check_tensor("post_weight", post_weight, 1, FLOAT_DTYPES)
    check_norm_weight("post_weight", post_weight, x.shape[-1], "(D,)")
    check_norm_weight("next_weight", next_weight, x.shape[-1], "(D,)")
    check_eps(eps)
    check_same_device(x=x, residual=residual, post_weight=post_weight, next_weight=next_weight)


def check_gelu_gate_inputs(gate_up, clamps):
    check_tensor("gate_up", gate_up, gate_up.dim() if isinstance(gate_up, torch.Tensor) else 1, FLOAT_DTYPES)
    if gate_up.dim() == 0 or gate_up.shape[-1] == 0 or gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up: expected shape (..., 2 * I) with I >= 1, got {tuple(gate_up.shape)}")
    check_clamps(clamps, 3, "gate, up, down input")
    check_same_device(gate_up=gate_up, clamps=clamps)
