"""The workloads: Gemma 4's items as its processors hand them to the vision tower.

An item (an image, or one video frame) of L soft tokens is N = L * k^2 patches, padded to exactly N
with (-1, -1) ids and zero pixels; all items of one call share N. Patches are row-major, x fastest.
"""

import math
import re
from dataclasses import dataclass

import torch

PATCH_SIZE = 16
PATCH_FEATURES = 3 * PATCH_SIZE**2  # K = 768 pixel features per patch, ordered (py, px, c)
POOLING_KERNEL = 3  # k: k x k patches pool into one soft token
POSITION_EMBEDDING_SIZE = 10240  # P: rows per axis of the (2, P, D) position table

_CASE_NAME = re.compile(r"(image|video)_(\d+)x(\d+)")


@dataclass(frozen=True)
class Case:
    """``items`` images or video frames of ``soft_tokens`` soft tokens each."""

    kind: str
    items: int
    soft_tokens: int

    @classmethod
    def parse(cls, name: str) -> "Case":
        """``image_8x280`` is 8 images of 280 soft tokens; ``video_32x70`` is 32 frames of 70."""
        match = _CASE_NAME.fullmatch(name)
        if match is None or int(match[2]) < 1 or int(match[3]) < 1:
            raise ValueError(
                f"case {name!r}: expected image_<items>x<soft tokens> or video_<frames>x<soft tokens>, e.g. image_8x280"
            )
        return cls(match[1], int(match[2]), int(match[3]))

    @property
    def name(self) -> str:
        return f"{self.kind}_{self.items}x{self.soft_tokens}"

    @property
    def patches_per_item(self) -> int:
        return self.soft_tokens * POOLING_KERNEL**2

    @property
    def patches(self) -> int:
        return self.items * self.patches_per_item


def cases(*names: str) -> tuple[Case, ...]:
    return tuple(Case.parse(name) for name in names)


# The baselines' workloads (bench/baselines.md): 20,160 patches (video 32x70, image 8x280) and 80,640
# (image 32x280, 8x1120).
GPU_CASES = cases("video_32x70", "image_8x280", "image_32x280", "image_8x1120")
# The towers at the two 20,160-patch cases only: a tower call costs ~100x a stem op.
GPU_TOWER_CASES = GPU_CASES[:2]
# The stem's headline case, 32 images of 280 tokens: a run measures it first, so its first calls tune the tiles.
HEADLINE_CASE = "image_32x280"
# The fp32 one-hot lookup costs ~0.9 ms per patch on a 2-core x86 (1,082 ms at video_2x70): one image of 280
# tokens (2,520 patches) keeps its few calls within seconds.
CPU_CASES = cases("image_1x280")
# The encoder's mixes (bench/encoder.py), image mix first: the GPU target is 8 images x 280 tokens, and 8 x 1120
# the patches (80,640) where attention's share of the FLOPs grows; a CPU runs 7 x 140, one per aspect ratio:
# at 280 tokens a call of the 1-layer E2B/E4B tower takes ~10 s on 2 cores, too long for 12 calls in 3 minutes.
GPU_ENCODER_CASES = cases("image_8x280", "video_32x70", "image_8x1120")
# --headline's encoder mixes: the two 20,160-patch cases, an image mix and a video.
HEADLINE_ENCODER_CASES = GPU_ENCODER_CASES[:2]
CPU_ENCODER_CASES = cases("image_7x140")
# --tiny: a smoke run that exercises every code path in seconds, the Triton interpreter included.
TINY_CASES = cases("image_2x4")


def soft_token_grid(soft_tokens: int) -> tuple[int, int]:
    """(rows, cols) of the largest 16:9 landscape grid of at most ``soft_tokens`` soft tokens.

    The processors resize an item to fit its budget at its own aspect ratio, so most items leave
    some slots, k^2 patches each, as padding: 16:9 fills 66 of 70, 276 of 280 and 1100 of 1120.
    """
    rows = max(1, math.isqrt(soft_tokens * 9 // 16))
    return rows, soft_tokens // rows


def position_ids(case: Case, device: torch.device) -> torch.Tensor:
    """(B, N, 2) int64 (x, y) ids: each item's grid row-major, x fastest, then (-1, -1) padding up to N."""
    rows, cols = soft_token_grid(case.soft_tokens)
    height, width = rows * POOLING_KERNEL, cols * POOLING_KERNEL
    y, x = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    item = torch.full((case.patches_per_item, 2), -1, dtype=torch.int64)
    item[: height * width] = torch.stack([x.flatten(), y.flatten()], dim=-1)
    return item.expand(case.items, -1, -1).contiguous().to(device)


def pixel_values(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, N, K) float32 pixels in [0, 1), as the processors emit them, and 0 on padding patches."""
    batch, seq_len, _ = position_ids.shape
    pixels = torch.rand(batch, seq_len, PATCH_FEATURES, device=position_ids.device)
    return pixels.masked_fill_((position_ids == -1).all(dim=-1, keepdim=True), 0.0)


def distinct_table_rows(position_ids: torch.Tensor, padding_positions: torch.Tensor) -> int:
    """Table rows a lookup must read at the least: the distinct x and y of the patches that are not padding."""
    looked_up = position_ids[~padding_positions].clamp(min=0)
    return looked_up[:, 0].unique().numel() + looked_up[:, 1].unique().numel()
