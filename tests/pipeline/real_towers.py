"""The released vision towers' shapes as the duck-typed configs the planner takes (a Gemma4VisionConfig works
the same), from the bench's one table of them, and the patch counts of the planner's tests."""

from types import SimpleNamespace

from fused_vision.bench.tower import VISION_TOWERS

GiB, MiB = 2**30, 2**20
P = 10240  # position_embedding_size
FRAME, IMAGE = 630, 2520  # patches: 70 and 280 soft tokens, pooling kernel 3
TOWER_26B_31B = SimpleNamespace(**VISION_TOWERS["tower_26b_31b"], position_embedding_size=P, patch_size=16)
TOWER_E2B_E4B = SimpleNamespace(**VISION_TOWERS["tower_e2b_e4b"], position_embedding_size=P, patch_size=16)
