"""SGLang's own Gemma 4 vision tower (its installed package), tiny and random, for tests/integrations/test_sglang*.py.

SGLang wants an environment of its own (sglang 0.5.23 brings torch 2.14.1 and transformers 5.19.0), so
`bash .ci/run tests_sglang` builds one; elsewhere the modules that import this one skip.
"""

import contextlib
import copy
import importlib

import pytest
import torch

from gemma4_towers import make_inputs, randomize, vision_config
from helpers import DEVICE

SGLANG_MISSING = (
    "SGLang is not installed, and these tests run its real package: pip install sglang==0.5.23 "
    "(in an environment of its own, as `bash .ci/run tests_sglang` builds)"
)
pytest.importorskip("sglang", reason=SGLANG_MISSING)
vision = importlib.import_module("sglang.srt.models.gemma4_vision")
embedding_gemma2 = importlib.import_module("sglang.srt.models.embedding_gemma2")
parallel_state = importlib.import_module("sglang.srt.distributed.parallel_state")
runtime = importlib.import_module("sglang.srt.runtime_context")
server_args = importlib.import_module("sglang.srt.server_args")

POOLING = 3  # Gemma 4's k: bf16's 1/9 is where SGLang's pooler rounds its weights
GRIDS = [(9, 6), (6, 3), (3, 12)]  # 6, 2 and 4 soft tokens of L = 9, each item padded
SEQ_LEN = 81
HIDDEN = 40


@contextlib.contextmanager
def single_process_world(init_file):
    """SGLang's config published and its process groups built (gloo) at world size 1, as a one-GPU
    server's scheduler holds them: its tensor-parallel layers read both when built and when run."""
    no_model = server_args.ServerArgs(model_path="dummy")  # SGLang's word for no checkpoint: it reads no config
    runtime.publish(no_model, role="test", ranks=runtime.SpawnRanks(world_rank=0))
    try:
        parallel_state.init_distributed_environment(
            world_size=1, rank=0, local_rank=0, distributed_init_method=f"file://{init_file}", backend="gloo"
        )
        parallel_state.initialize_model_parallel(backend="gloo")
        yield
    finally:
        parallel_state.destroy_model_parallel()
        parallel_state.destroy_distributed_environment()
        runtime.reset_context()


def config():
    return vision_config(patch_size=2, pooling=POOLING, positions=64, hidden=HIDDEN)


def make_embedder(dtype, seed=0):
    return randomize(vision.Gemma4VisionPatchEmbedder(config()), seed).to(DEVICE, dtype).eval()


def make_encoder(dtype, *, mask_first=False, standardize=False, seed=0):
    """SGLang's ``Gemma4VisionEncoder`` as its model builds it, random but for the clip bounds, which stay
    the ±inf a checkpoint without them leaves (random ones would clamp every activation to a constant)."""
    vision_cfg = config()
    vision_cfg.standardize = standardize
    encoder = vision.Gemma4VisionEncoder(vision_cfg, mask_pad_before_pool=mask_first)
    bounds = [buffer for name, buffer in encoder.named_buffers() if name.endswith(("_min", "_max"))]
    assert bounds, "SGLang's clippable layers have clip bounds"
    infinite = [bound.clone() for bound in bounds]
    randomize(encoder, seed)
    with torch.no_grad():
        for bound, value in zip(bounds, infinite):
            bound.copy_(value)
    return encoder.to(DEVICE, dtype).eval()


def float64_twin(module):
    """The module in float64, unpatched. SGLang's layers hold its process groups, which cannot be copied:
    the twin shares them."""
    groups = {
        id(v): v for m in module.modules() for v in vars(m).values() if isinstance(v, parallel_state.GroupCoordinator)
    }
    return copy.deepcopy(module, memo=groups).double()


def inputs(dtype=torch.float32, grids=GRIDS):
    pixels, ids = make_inputs(grids, SEQ_LEN)
    return pixels.to(dtype), ids, (ids == -1).all(-1)


def ulps_apart(actual: torch.Tensor, expected: torch.Tensor) -> int:
    """The most units in the last place between same-signed finite values of one float dtype."""
    int_view = {2: torch.int16, 4: torch.int32}[actual.element_size()]
    assert (actual.sign() * expected.sign() >= 0).all()
    return int((actual.view(int_view).long() - expected.view(int_view).long()).abs().max())


def forbid_one_hot(monkeypatch) -> None:
    """From here on, an F.one_hot call fails: a patched tower runs none."""

    def refuse(*args, **kwargs):
        raise AssertionError("F.one_hot ran inside a patched SGLang tower")

    monkeypatch.setattr(torch.nn.functional, "one_hot", refuse)
