"""vLLM's own Gemma 4 model, built by vLLM from tiny random configs on the CPU, and inputs as its processors
hand them, for tests/integrations/test_vllm*.py.

They need vLLM in an environment of its own (it brings its torch and transformers: `bash .ci/run
tests_vllm` builds one for 0.34.0; 0.33.0 works too) and skip without it. Nothing is downloaded:
each model's config is saved to a temporary directory vLLM reads.
"""

import importlib

import pytest
import torch

import fused_vision.integrations.stem as stem
import fused_vision.integrations.vllm as fv

from gemma4_towers import gemma4_config, modeling, randomize, vision_config
from helpers import dtype_id
from op_cases import grid_ids

try:
    gemma4_mm = importlib.import_module(fv.VLLM_MODULE)
    VLLM_MISSING = ""
except ImportError as exc:
    gemma4_mm = None
    VLLM_MISSING = f"vLLM's Gemma 4 is not importable ({exc}): pip install vllm==0.33.0, in an environment of its own"
needs_vllm = pytest.mark.skipif(gemma4_mm is None, reason=VLLM_MISSING)
GiB = 2**30


def model_class():
    return gemma4_mm.Gemma4ForConditionalGeneration


# the chunk and the guarded encoding calls: 0.34's _local halves, 0.33's whole calls
PATCHED = tuple(fv._methods(model_class())) if gemma4_mm is not None else ()


def vllm_is_patched() -> bool:
    return all(isinstance(model_class().__dict__[name], fv.patching.InstanceMethod) for name in PATCHED)


def transformers_is_patched() -> bool:
    return modeling.Gemma4VisionPatchEmbedder.forward is stem._embedder_forward


@pytest.fixture(scope="module")
def vllm_process(tmp_path_factory):
    """What vLLM's constructors need in a CPU-only process: a one-process group (its ReplicatedLinear asks for
    one), and an attention backend for the language model's layers, which this platform names none of."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.platforms import current_platform

    with pytest.MonkeyPatch.context() as patch, set_current_vllm_config(VllmConfig(device_config=DeviceConfig("cpu"))):
        cpu_attention = "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"
        patch.setattr(current_platform, "get_attn_backend_cls", lambda *args, **kwargs: cpu_attention)
        rendezvous = f"file://{tmp_path_factory.mktemp('gloo')}/rendezvous"
        parallel_state.init_distributed_environment(1, 0, rendezvous, 0, backend="gloo")
        parallel_state.ensure_model_parallel_initialized(1, 1)
        yield
        parallel_state.destroy_model_parallel()
        parallel_state.destroy_distributed_environment()


def build_vllm_model(directory, vision, dtype, device="cpu"):
    """vLLM's ``Gemma4ForConditionalGeneration`` from a tiny Gemma 4 config with ``vision`` as its tower."""
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    config = gemma4_config(vision)
    config.architectures = ["Gemma4ForConditionalGeneration"]
    config.save_pretrained(directory)
    model_config = ModelConfig(model=str(directory), skip_tokenizer_init=True, dtype=dtype)
    vllm_config = VllmConfig(model_config=model_config, device_config=DeviceConfig("cpu"))
    # As vLLM's model loader builds it, without the weights it would load next.
    with set_current_vllm_config(vllm_config), set_default_torch_dtype(dtype), torch.device(device):
        model = initialize_model(vllm_config=vllm_config)
    assert type(model) is model_class()
    return model.eval()


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=dtype_id)
def tiny_model(request, vllm_process, tmp_path_factory):
    """A tiny model with fresh random weights (vLLM leaves the tower as torch.empty made it)."""
    model = build_vllm_model(tmp_path_factory.mktemp("tiny"), vision_config(standardize=True), request.param)
    randomize(model.vision_tower, seed=5)
    randomize(model.embed_vision, seed=6)
    return model


@pytest.fixture
def memory(monkeypatch):
    """Sets the (free, total) bytes vLLM's loops read: torch.accelerator.get_memory_info raises without a driver."""

    def set_memory(free, total):
        monkeypatch.setattr(torch.accelerator, "get_memory_info", lambda *args: (free, total))

    set_memory(100 * GiB, 139 * GiB)
    return set_memory


# ---- inputs as vLLM's processors hand them ----------------------------------------------------------------


def items(grids, patches, seed):
    """Random pixels on each grid's patches, zero on the padding (as the processor pads), and their ids."""
    generator = torch.Generator().manual_seed(seed)
    ids = [grid_ids(w, h, patches) for w, h in grids]
    pixels = [
        torch.rand(patches, 3 * 2**2, generator=generator).masked_fill((i == -1).all(-1, keepdim=True), 0) for i in ids
    ]
    return pixels, ids


def image_input(model, seed):
    """Images of two resolution buckets, interleaved: the first (16 patches) holds 2, the second (64) 3."""
    small, big = items([(4, 4), (2, 6)], 16, seed), items([(8, 6), (4, 10), (6, 2)], 64, seed + 1)
    order = [(small, 0), (big, 0), (small, 1), (big, 1), (big, 2)]
    pixels, ids = [source[0][i] for source, i in order], [source[1][i] for source, i in order]
    return model._parse_and_validate_image_input(pixel_values=pixels, pixel_position_ids=ids)


def video_input(model, frame_counts, patches, seed):
    grids = [[(8, 6), (4, 10), (6, 2)][i % 3] for i in range(sum(frame_counts))]
    pixels, ids = items(grids, patches, seed)
    return model._parse_and_validate_video_input(
        pixel_values_videos=torch.stack(pixels),
        pixel_position_ids_videos=torch.stack(ids),
        video_frame_counts=torch.tensor(frame_counts),
    )


def vision_input(model, method, seed):
    """What ``method`` takes: the images above, or two videos of 2 and 3 frames of 64 patches."""
    return image_input(model, seed) if method == "_process_image_input" else video_input(model, [2, 3], 64, seed)


def run(model, method, inputs):
    """vLLM's ``method`` on ``inputs``: what its patch embedder returned, what its projection was handed
    (the pooled, standardized soft tokens) and its embeddings."""
    embedded, pooled = [], []
    hooks = [
        model.vision_tower.patch_embedder.register_forward_hook(lambda module, args, out: embedded.append(out)),
        model.embed_vision.register_forward_pre_hook(
            lambda module, args, kwargs: pooled.append(kwargs["inputs_embeds"]), with_kwargs=True
        ),
    ]
    try:
        with torch.no_grad():
            embeddings = getattr(model, method)(inputs)
    finally:
        for hook in hooks:
            hook.remove()
    return embedded, pooled, embeddings
