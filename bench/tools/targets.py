"""The GPUs the build matrix compiles for, their per-block and per-SM limits, and how to read a compiled
kernel's resources off each vendor's compiler output.

Limits, from the vendors' public tables:
- NVIDIA: CUDA C++ Programming Guide, "Compute Capabilities", table "Technical Specifications per Compute
  Capability" (https://docs.nvidia.com/cuda/cuda-c-programming-guide/#compute-capabilities): shared memory
  per block (opt-in) 163 KiB on 8.0, 99 KiB on 8.6, 8.9 and 12.0, 227 KiB on 9.0 and 10.0; shared memory
  per SM 164, 100 and 228 KiB; 64 K registers per SM; 64 resident warps per SM (48 on 8.6, 8.9, 12.0).
  The driver reserves 1 KiB of shared memory per resident block (ibid., "Shared Memory" of each 8.x/9.0
  section).
- AMD: "AMD Instinct MI300 / MI200 hardware" in the ROCm docs
  (https://rocm.docs.amd.com/en/latest/reference/gpu-arch-specs.html): 64 KiB of LDS per CU and per
  workgroup on gfx90a and gfx942, wavefronts of 64, 512 VGPRs per SIMD lane shared by its waves (arch VGPRs
  and AGPRs together, allocated in granules of 8), at most 8 waves per SIMD, 4 SIMDs per CU.
"""

import math
import re
from dataclasses import dataclass

from triton.backends.compiler import GPUTarget

from fused_vision._device import DeviceLimits

KIB = 1024


@dataclass(frozen=True)
class AmdRegisters:
    """How an AMD compute unit shares its vector registers among the wavefronts resident on it."""

    vgprs_per_lane: int  # per SIMD lane, shared by its waves (arch VGPRs and AGPRs together on CDNA)
    granule: int  # VGPRs are allocated in units of this many
    waves_per_simd: int
    simds_per_cu: int


@dataclass(frozen=True)
class Target:
    name: str
    target: GPUTarget
    shared_per_block: int  # bytes one block may use (the opt-in maximum)
    shared_per_sm: int  # bytes all resident blocks of one SM (CU) share
    max_warps: int  # resident warps per SM, wavefronts per CU
    tensor_core: str  # what a half-precision dot must become: a pattern in the PTX or AMDGCN
    amd_registers: AmdRegisters | None = None
    oldest_triton: tuple[int, int] = (3, 6)  # the oldest Triton whose compilers build for it, of those checked

    @property
    def amd(self) -> bool:
        return self.target.backend == "hip"

    @property
    def limits(self) -> DeviceLimits:
        """What the launchers would read off such a device."""
        arch = self.name if self.amd else f"sm_{self.target.arch}"  # a device reports sm_90, not sm_90a
        return DeviceLimits(arch, self.shared_per_block)


def nvidia(name, capability, shared_per_block_kib, shared_per_sm_kib, max_warps, tensor_core, oldest_triton=(3, 6)):
    return Target(
        name,
        GPUTarget("cuda", capability, 32),
        shared_per_block_kib * KIB,
        shared_per_sm_kib * KIB,
        max_warps,
        tensor_core,
        oldest_triton=oldest_triton,
    )


def amd(name, lds_kib, wave, vgprs_per_lane, vgpr_granule, waves_per_simd, simds_per_cu, tensor_core):
    return Target(
        name,
        GPUTarget("hip", name, wave),
        lds_kib * KIB,
        lds_kib * KIB,
        simds_per_cu * waves_per_simd,
        tensor_core,
        AmdRegisters(vgprs_per_lane, vgpr_granule, waves_per_simd, simds_per_cu),
    )


MFMA, WMMA = r"v_mfma_f32_", r"v_wmma_f32_"
TARGETS = {
    t.name: t
    for t in (
        nvidia("sm_80", 80, 163, 164, 64, r"mma\.sync\.aligned"),
        nvidia("sm_86", 86, 99, 100, 48, r"mma\.sync\.aligned"),
        nvidia("sm_89", 89, 99, 100, 48, r"mma\.sync\.aligned"),
        nvidia("sm_90a", 90, 227, 228, 64, r"wgmma\.mma_async"),
        nvidia("sm_100a", 100, 227, 228, 64, r"tcgen05\.mma"),
        nvidia("sm_120", 120, 99, 100, 48, r"mma\.sync\.aligned"),
        amd("gfx942", 64, 64, 512, 8, 8, 4, MFMA),
        amd("gfx90a", 64, 64, 512, 8, 8, 4, MFMA),
        nvidia("sm_75", 75, 64, 64, 32, r"mma\.sync\.aligned"),
        nvidia("sm_87", 87, 163, 164, 48, r"mma\.sync\.aligned"),
        nvidia("sm_103a", 103, 227, 228, 64, r"tcgen05\.mma"),
        # Triton 3.6's ptxas (CUDA 12.9) knows Thor as sm_101 only; sm_110 arrived with CUDA 13.
        nvidia("sm_110a", 110, 227, 228, 48, r"tcgen05\.mma", oldest_triton=(3, 7)),
        nvidia("sm_121", 121, 99, 100, 48, r"mma\.sync\.aligned"),
        amd("gfx950", 160, 64, 512, 8, 8, 4, MFMA),
        amd("gfx1100", 64, 32, 1536, 24, 16, 2, WMMA),
        amd("gfx1201", 64, 32, 1536, 24, 16, 2, WMMA),
    )
}

REGISTERS_PER_SM = 64 * KIB  # 32-bit registers, every NVIDIA architecture above
REGISTERS_PER_WARP_GRANULE = 256  # ptxas allocates a warp's registers in 256-register units
RESERVED_SHARED_PER_BLOCK = KIB


@dataclass(frozen=True)
class Resources:
    registers: int  # per thread: NVIDIA registers, AMD VGPRs (AGPRs included)
    spill_bytes: int  # local (NVIDIA) or scratch (AMD) memory the register allocator spilled to
    scalar_spills: int  # AMD SGPR spills, kept in VGPR lanes while no scratch is used; 0 on NVIDIA
    shared: int  # bytes of shared memory (LDS) per block


def ptxas_resources(ptxas_log: str, shared: int) -> Resources:
    """Registers and spill bytes as ptxas -v reports them."""
    registers = re.search(r"Used (\d+) registers", ptxas_log)
    if registers is None:
        raise RuntimeError(f"no register count in Triton's ptxas log: {ptxas_log[-500:]!r}")
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", ptxas_log))
    return Resources(int(registers.group(1)), spills, 0, shared)


def amdgcn_resources(amdgcn: str, shared: int) -> Resources:
    """VGPRs and spills from the AMDGPU code object metadata Triton's AMDGCN carries."""
    fields = dict(re.findall(r"^\s*\.(\w+):\s+(\d+)\s*$", amdgcn, flags=re.MULTILINE))
    missing = {"vgpr_count", "vgpr_spill_count", "sgpr_spill_count", "private_segment_fixed_size"} - fields.keys()
    if missing:
        raise RuntimeError(f"no {sorted(missing)} in Triton's AMDGCN metadata")
    # Scratch memory is what a spill costs; SGPR spills land in VGPR lanes until it is used.
    scratch = max(int(fields["private_segment_fixed_size"]), 4 * int(fields["vgpr_spill_count"]))
    return Resources(int(fields["vgpr_count"]), scratch, int(fields["sgpr_spill_count"]), shared)


def occupancy(target: Target, resources: Resources, num_warps: int) -> float:
    """Resident warps (wavefronts) per SM (CU) over the most it can hold, from registers and shared memory."""
    if target.amd:
        cu = target.amd_registers
        vgprs = math.ceil(resources.registers / cu.granule) * cu.granule
        waves_per_simd = min(cu.waves_per_simd, cu.vgprs_per_lane // max(vgprs, 1))
        by_registers = waves_per_simd // math.ceil(num_warps / cu.simds_per_cu)  # a workgroup spans the SIMDs
        by_shared = target.shared_per_sm // max(resources.shared, 1)
    else:
        per_warp = math.ceil(resources.registers * 32 / REGISTERS_PER_WARP_GRANULE) * REGISTERS_PER_WARP_GRANULE
        by_registers = REGISTERS_PER_SM // per_warp // num_warps
        by_shared = target.shared_per_sm // (resources.shared + RESERVED_SHARED_PER_BLOCK)
    blocks = min(by_registers, by_shared, target.max_warps // num_warps)
    return blocks * num_warps / target.max_warps
