"""What a device's kernels can be built for: its tensor-core family, read off its architecture, and the
shared memory (LDS) one block may use. The vocabulary the launchers' tile lists (kernels/) and the
dispatch's fallback decision (``_dispatch.untiled``) share; it imports nothing of fused_vision.
"""

import functools
import re
from dataclasses import dataclass

import torch

# The tensor-core families: what Triton builds a half-precision dot into. The kernels' GEMM tiles are offered
# per family (kernels/common.py), so a device no list names still gets its family's. FMA: Turing (sm_75),
# where Triton 3.6 to 3.9 build every dot on the FMA units (no mma.sync below sm_80): fp32's tiles only.
FMA, MMA_SYNC, WGMMA, TCGEN05, MFMA, WMMA = "fma", "mma.sync", "wgmma", "tcgen05", "mfma", "wmma"
FAMILIES = (FMA, MMA_SYNC, WGMMA, TCGEN05, MFMA, WMMA)
# NVIDIA's by compute capability major: Ampere, Ada and consumer Blackwell (12.x) issue warp-wide mma.sync;
# Hopper wgmma; data-centre Blackwell and Thor (10.x, 11.x) tcgen05.
_NVIDIA_FAMILIES = {8: MMA_SYNC, 9: WGMMA, 10: TCGEN05, 11: TCGEN05, 12: MMA_SYNC}


def tensor_core_family(arch: str) -> str | None:
    """The family of an architecture as ``device_limits`` spells it ("sm_121", "gfx1201"); None for one
    outside every family: Volta, AMD's GCN and RDNA 1-2 (no matrix cores), a generation not yet released."""
    if nvidia := re.fullmatch(r"sm_(\d+)(\d)[af]?", arch):
        major, minor = int(nvidia.group(1)), int(nvidia.group(2))
        return FMA if (major, minor) == (7, 5) else _NVIDIA_FAMILIES.get(major)
    if arch in ("gfx908", "gfx90a") or re.fullmatch(r"gfx9[4-9a-f][0-9a-f]", arch):  # CDNA 1 to 4 and after
        return MFMA
    if re.fullmatch(r"gfx1[12][0-9a-f]{2}", arch):  # RDNA 3, 3.5 and 4
        return WMMA
    return None


@dataclass(frozen=True)
class DeviceLimits:
    """What a launcher's tile choice depends on, as the device reports it: its architecture, and so its
    family and the dtypes its tiles serve, and the shared memory (LDS) one block may use."""

    arch: str  # "sm_90", "gfx942"
    shared_memory: int  # bytes, the opt-in maximum per block

    @property
    def family(self) -> str | None:
        return tensor_core_family(self.arch)

    def multiplies(self, dtype: torch.dtype) -> bool:
        """Whether its GEMM tiles serve ``dtype``: float32 (ieee dots, on the FMA units) in every family,
        bf16 and fp16 where Triton builds their dots into tensor-core instructions (not Turing)."""
        if self.family is None:
            return False
        return dtype == torch.float32 or self.family != FMA


@functools.cache
def _cuda_device_limits(index: int) -> DeviceLimits:
    properties = torch.cuda.get_device_properties(index)
    hip = torch.version.hip is not None
    arch = properties.gcnArchName.split(":")[0] if hip else f"sm_{properties.major}{properties.minor}"
    return DeviceLimits(arch, properties.shared_memory_per_block_optin)


def device_limits(device: torch.device) -> DeviceLimits | None:
    """The limits of a CUDA or ROCm device (both report type "cuda"); None for any other, whose launchers
    offer every candidate."""
    if device.type != "cuda":
        return None
    return _cuda_device_limits(torch.cuda.current_device() if device.index is None else device.index)
