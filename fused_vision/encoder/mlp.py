"""The fused layer's MLP, as the device and the user choose it: whether its gate/up GEMM carries the GELU
gate in its epilogue, and how many rows each of its blocks holds."""

from .._environment import flag

ENV_GATE_UP_EPILOGUE = "FUSED_VISION_GATE_UP_EPILOGUE"
MLP_BLOCK_BYTES = 64 * 2**20  # a block's (rows, 2I) gate/up activations: 3,840 of the 26B/31B's bf16 rows
MLP_MIN_BLOCK_ROWS = 1024  # so that each block's GEMMs still fill the device


def gate_up_epilogue() -> bool:
    """Whether the MLP runs its gate/up GEMM with the GELU gate in the epilogue (``gate_up_gelu``):
    ``FUSED_VISION_GATE_UP_EPILOGUE=1``. Off by default: cuBLAS's GEMM and the gate kernel stay until
    the benchmark's ``gate_up_gelu`` rows show the epilogue faster on a device."""
    return flag(ENV_GATE_UP_EPILOGUE)


def mlp_block_rows(intermediate: int, element_size: int) -> int:
    """Rows per MLP block: ``MLP_BLOCK_BYTES`` of (rows, 2I) activations, a multiple of 128 (the GEMMs'
    tile rows), at least ``MLP_MIN_BLOCK_ROWS``."""
    return max(MLP_MIN_BLOCK_ROWS, MLP_BLOCK_BYTES // (2 * intermediate * element_size) // 128 * 128)
