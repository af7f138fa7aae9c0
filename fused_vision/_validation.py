"""The vocabulary of the ops' input checks: clear errors instead of memory faults or garbage.

Each op's own ``_check_inputs`` (in ``fused_vision/ops/<op>.py``) is built from these. They look only at
shapes, dtypes and devices, so torch.compile traces them for free; the id range check reads the data and
runs inside the ops' implementations.
"""

import operator

import torch

from ._dispatch import every_item
from ._environment import flag

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def _names(dtypes) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def positive_int(name: str, value, expected: str = "a positive int") -> int:
    """``value`` as an int (numpy integers too, never a bool), at least 1; else a ValueError naming ``name``."""
    try:
        count = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        count = None
    if count is None or count < 1:
        raise ValueError(f"{name}: expected {expected}, got {value!r}")
    return count


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


def id_checks_enabled(position_ids: torch.Tensor, *, guarded: bool = False) -> bool:
    """Whether to run the checks that read the ids and, on a GPU, synchronise the device.

    ``guarded``: the caller is a Triton kernel, which writes NaN where bad ids would lead it astray (a
    row's lookup, an item's pooled slots) instead of reading out of bounds or dropping patches. On a GPU
    such a path checks only on request, with FUSED_VISION_CHECK_IDS=1: a sync per call would cost more
    than its kernel. Host ids are checked by default (no device to stall); unguarded GPU paths (the
    reference, which would index out of bounds) too. Never while a CUDA graph is being captured (a
    sync would break the capture) or while ``torch.cuda.set_sync_debug_mode`` is armed (vLLM's
    VLLM_GPU_SYNC_CHECK arms it and fails on a sync outside the regions it allows, which leave out the
    patch embedder); nowhere with FUSED_VISION_CHECK_IDS=0.
    """
    requested = flag(ENV_CHECK_IDS, default=None)
    if requested is False:
        return False
    if not position_ids.is_cuda:
        return True
    if torch.cuda.is_current_stream_capturing() or torch.cuda.get_sync_debug_mode():
        return False
    return requested is True or not guarded


def check_position_ids_range(position_ids: torch.Tensor, num_positions: int, *, guarded: bool = False) -> None:
    """Ids must lie below P; negative ids read row 0, as stock's ``clamp(min=0)`` makes them.
    One max reduction and, on a GPU, one device-to-host sync (see id_checks_enabled)."""
    if position_ids.numel() == 0 or not id_checks_enabled(position_ids, guarded=guarded):
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
