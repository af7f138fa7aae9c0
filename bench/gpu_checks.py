"""Correctness of the fused ops at real Gemma 4 shapes on a CUDA GPU (issues 2, 5, 6).

    python bench/gpu_checks.py --out DIR

- the lookup at B=32, N=2520, D=1152, P=10240 against the one-hot, bit for bit, in bf16, fp16, fp32;
- the lookup with an output of more than 2**31 elements (int64 offsets) against the gather reference;
- patch_embed's relative error against float64, next to stock's, in bf16, fp16, fp32;
- the pooler against the one-hot pooler at image 32 x 280, and its run-to-run bit-identity;
- the pooler's hidden-state gradient against autograd through the one-hot pooler, bit for bit;
- the table gradient against the deterministic reference;
- patch_embed and the lookup with syncs forbidden (torch's sync debug mode at "error", as vLLM's
  VLLM_GPU_SYNC_CHECK=error has it in the patch embedder): no sync, and a bad id's row NaN, not an error;
- patch_embed, the lookup and the pooler captured in one CUDA graph (vLLM 0.33 captures Gemma 4's
  tower) and replayed on new inputs: bit-identical to eager calls on those inputs;
- the pooler and its gradient on an item whose rows lie past 2**31 elements (int64 offsets), bit for bit.
Exits non-zero when any check fails (an exception fails its own check only); writes gpu_checks.json
under --out. `--smoke` runs the same code at tiny sizes on any device (TRITON_INTERPRET=1 on a CPU), to
test the script itself.
"""

import argparse
import contextlib
import json
import os
import sys
import time
import traceback
from functools import partial
from unittest import mock

import torch

import fused_vision
from fused_vision import _dispatch, reference

P = 10240
# Real sizes: image 32 x 280 soft tokens (N = 2520) at the 26B/31B width. --smoke shrinks them.
# big: a (B, N, D) lookup output of 2.21e9 elements; pool_big: (L, D) of one pooled item with L * D over 2**31.
SIZES = dict(batch=32, soft_tokens=280, hidden=1152, features=768, big=(190, 10080, 1152), pool_big=(1_865_000, 1152))
SMOKE_SIZES = dict(batch=2, soft_tokens=28, hidden=40, features=48, big=(2, 630, 16), pool_big=(50, 16))


def image_ids(batch, soft_tokens, k=3, generator=None):
    """Ids as Gemma 4's processor makes them: a row-major grid of k*k*soft_tokens patches or fewer, then
    (-1, -1) padding. Widths vary per item so some items carry padding."""
    seq_len = k * k * soft_tokens
    ids = torch.full((batch, seq_len, 2), -1, dtype=torch.int64)
    for item in range(batch):
        width_slots = int(torch.randint(4, 2 * int(soft_tokens**0.5), (1,), generator=generator))
        height_slots = max(1, soft_tokens // width_slots)
        ys, xs = torch.meshgrid(torch.arange(k * height_slots), torch.arange(k * width_slots), indexing="ij")
        grid = torch.stack([xs.flatten(), ys.flatten()], dim=-1)
        ids[item, : len(grid)] = grid
    return ids


def bits_equal(a, b):
    view = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return bool(torch.equal(a.view(view), b.view(view)))


def relative_error(actual, exact):
    return float((actual.double() - exact).norm() / exact.norm())


def check_lookup_real_shape(device, results, batch, soft_tokens, hidden, **_):
    ids = image_ids(batch, soft_tokens).to(device)
    padding = reference.default_padding_positions(ids)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        table = torch.randn(2, P, hidden, device=device).to(dtype)
        residual = torch.randn(*ids.shape[:2], hidden, device=device).to(dtype)
        expected = reference.onehot_position_embeddings(table, ids, padding)
        actual = fused_vision.position_embeddings(table, ids, backend="triton")
        with_residual = fused_vision.position_embeddings(table, ids, residual=residual, backend="triton")
        ok = bits_equal(actual, expected) and bits_equal(with_residual, residual + expected)
        results.append(dict(check=f"lookup_bit_identical_B{batch}_N{ids.shape[1]}_D{hidden}", dtype=str(dtype), ok=ok))
        del expected, actual, with_residual, residual


def check_lookup_over_2_31(device, results, big, **_):
    batch, seq_len, hidden = big
    ids = torch.randint(0, 3360, (batch, seq_len, 2), device=device)
    ids[:, -500:] = -1
    table = torch.randn(2, P, hidden, device=device, dtype=torch.bfloat16)
    actual = fused_vision.position_embeddings(table, ids, backend="triton")
    ok = True
    for chunk in range(0, batch, 38):  # the reference in pieces, to keep its temporaries small
        expected = reference.position_embeddings(table, ids[chunk : chunk + 38])
        ok = ok and bits_equal(actual[chunk : chunk + 38], expected)
    results.append(dict(check="lookup_big_output", numel=actual.numel(), over_2_31=actual.numel() > 2**31, ok=ok))


def check_patch_embed(device, results, batch, soft_tokens, hidden, features, **_):
    ids = image_ids(batch, soft_tokens).to(device)
    pixels = torch.rand(*ids.shape[:2], features, device=device)
    pixels[(ids == -1).all(-1)] = 0.0
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        weight = (torch.randn(hidden, features, device=device) / features**0.5).to(dtype)
        table = torch.randn(2, P, hidden, device=device).to(dtype)
        exact = reference.patch_embed(pixels.double(), weight.double(), table.double(), ids)
        fused = fused_vision.patch_embed(pixels, weight, table, ids, backend="triton")
        stock = reference.patch_embed(pixels, weight, table, ids)
        fused_error, stock_error = relative_error(fused, exact), relative_error(stock, exact)
        results.append(
            dict(
                check=f"patch_embed_error_vs_float64_B{batch}_N{ids.shape[1]}_D{hidden}",
                dtype=str(dtype),
                fused_error=fused_error,
                stock_error=stock_error,
                ok=fused_error <= 1.5 * stock_error,
            )
        )
        del exact, fused, stock


def check_pooler(device, results, batch, soft_tokens, hidden, **_):
    ids = image_ids(batch, soft_tokens).to(device)
    padding = reference.default_padding_positions(ids)
    hidden_states = torch.randn(*ids.shape[:2], hidden, device=device, dtype=torch.bfloat16)
    for round_average in (True, False):  # transformers' rounded averages, SGLang EmbeddingGemma2's fp32 ones
        pool = partial(fused_vision.pool_by_positions, round_average=round_average, backend="triton")
        pooled, mask = pool(hidden_states, ids, padding, soft_tokens)
        again, _ = pool(hidden_states, ids, padding, soft_tokens)
        expected, expected_mask = reference.onehot_pool_by_positions(hidden_states, ids, padding, soft_tokens, round_average)
        close = torch.allclose(pooled, expected, atol=2**-7 * hidden**0.5, rtol=2**-7)
        results.append(
            dict(
                check=f"pooler_vs_onehot_B{batch}_N{ids.shape[1]}_D{hidden}_bf16{'' if round_average else '_fp32_average'}",
                max_abs_diff=float((pooled - expected).abs().max()),
                mask_equal=bool(torch.equal(mask, expected_mask)),
                deterministic=bits_equal(pooled, again),
                ok=close and bool(torch.equal(mask, expected_mask)) and bits_equal(pooled, again),
            )
        )


def check_pooler_backward(device, results, batch, soft_tokens, hidden, **_):
    ids = image_ids(batch, soft_tokens).to(device)
    padding = reference.default_padding_positions(ids)
    hidden_states = torch.randn(*ids.shape[:2], hidden, device=device, dtype=torch.bfloat16)
    grad_pooled = torch.randn(batch, soft_tokens, hidden, device=device)
    grad_pooled[..., ::7] = -0.0  # stock's matmul turns a zero +0.0, and so must the kernel
    grads = []
    for pool in (partial(fused_vision.pool_by_positions, backend="triton"), reference.onehot_pool_by_positions):
        leaf = hidden_states.detach().requires_grad_(True)
        pool(leaf, ids, padding, soft_tokens)[0].backward(grad_pooled)
        grads.append(leaf.grad)
    check = f"pooler_backward_bit_identical_B{batch}_N{ids.shape[1]}_D{hidden}_bf16"
    results.append(dict(check=check, max_abs_diff=float((grads[0] - grads[1]).abs().max()), ok=bits_equal(*grads)))


def check_pooler_rows_past_2_31(device, results, pool_big, **_):
    """The pooler and its gradient on one item whose rows lie past 2**31 elements (int64 row offsets): the
    hidden states' N * D = 8.6e9 and the pooled gradient's L * D = 2.15e9. The image is two patches wide
    (k = 2: one slot per row of slots) and only its last slots' patches are real; neither kernel reads
    padding, so the expected values come from the reference on those patches alone, and integer values
    keep every sum exact: both results must match bit for bit."""
    output_length, hidden = pool_big
    k, tail_slots = 2, min(64, output_length // 2)
    seq_len, tail = k * k * output_length, k * k * (output_length - tail_slots)
    ys, xs = torch.meshgrid(torch.arange(k * output_length), torch.arange(k), indexing="ij")
    ids = torch.stack([xs.flatten(), ys.flatten()], dim=-1)[None].to(device)
    padding = torch.ones(1, seq_len, dtype=torch.bool, device=device)
    padding[:, tail:] = False
    hidden_states = torch.empty(1, seq_len, hidden, device=device, dtype=torch.bfloat16)  # 17 GB; the tail is read
    hidden_states[:, tail:] = torch.randint(-8, 9, (1, seq_len - tail, hidden), device=device).bfloat16()
    tail_ids = ids[:, tail:] - torch.tensor([0, k * (output_length - tail_slots)], device=device)
    tail_states = hidden_states[:, tail:].clone()
    hidden_states.requires_grad_(True)

    pooled, mask = fused_vision.pool_by_positions(hidden_states, ids, padding, output_length, backend="triton")
    expected, _ = reference.pool_by_positions(tail_states, tail_ids, padding[:, tail:], tail_slots)
    forward_ok = (
        bool(mask.all()) and bool((pooled[:, :-tail_slots] == 0).all()) and bits_equal(pooled[:, -tail_slots:], expected)
    )
    grad_pooled = torch.randn(1, output_length, hidden, device=device)
    pooled.backward(grad_pooled)
    del pooled
    grad = hidden_states.grad
    expected_grad = reference.pool_by_positions_backward(
        grad_pooled[:, -tail_slots:], tail_ids, padding[:, tail:], tail_slots, torch.bfloat16
    )
    backward_ok = bool((grad[:, :tail] == 0).all()) and bits_equal(grad[:, tail:], expected_grad)
    shape = f"L{output_length}_D{hidden}_bf16"
    results.append(dict(check=f"pooler_rows_past_2_31_{shape}", over_2_31=seq_len * hidden >= 2**31, ok=forward_ok))
    results.append(
        dict(check=f"pooler_backward_slots_past_2_31_{shape}", over_2_31=output_length * hidden >= 2**31, ok=backward_ok)
    )


def check_table_grad(device, results, batch, soft_tokens, hidden, **_):
    ids = image_ids(batch, soft_tokens).to(device)
    table = torch.randn(2, P, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad_out = torch.randn(*ids.shape[:2], hidden, device=device, dtype=torch.bfloat16)
    fused_vision.position_embeddings(table, ids, backend="triton").backward(grad_out)
    fused = table.grad.float()
    expected = reference.position_embeddings_table_grad(grad_out, ids, reference.default_padding_positions(ids), P)
    error = float((fused - expected.bfloat16().float()).abs().max() / expected.abs().max())
    results.append(dict(check="table_grad_vs_reference_bf16", max_rel_diff=error, ok=error < 2**-7))


@contextlib.contextmanager
def syncs_forbidden(device):
    """A device-to-host sync raises, as under vLLM's VLLM_GPU_SYNC_CHECK=error (torch's sync debug mode).
    Off a GPU (--smoke) there is no such mode: the id checks are switched off instead, to test the rest."""
    if device.type != "cuda":
        with mock.patch.dict(os.environ, {"FUSED_VISION_CHECK_IDS": "0"}):
            yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def check_no_sync_where_syncs_are_forbidden(device, results, batch, soft_tokens, hidden, features, **_):
    ids = image_ids(batch, soft_tokens).to(device)
    bad_ids = ids.clone()
    bad_ids[0, 0] = P  # a real patch (the grid comes first), out of range on both axes
    others = torch.ones(ids.shape[:2], dtype=torch.bool, device=device)
    others[0, 0] = False
    pixels = torch.rand(*ids.shape[:2], features, device=device)
    weight = (torch.randn(hidden, features, device=device) / features**0.5).bfloat16()
    table = torch.randn(2, P, hidden, device=device, dtype=torch.bfloat16)
    residual = torch.randn(*ids.shape[:2], hidden, device=device, dtype=torch.bfloat16)
    ops = dict(  # backend "auto", as the patched Gemma 4 embedder calls them
        patch_embed=lambda position_ids: fused_vision.patch_embed(pixels, weight, table, position_ids),
        lookup=lambda position_ids: fused_vision.position_embeddings(table, position_ids, residual=residual),
    )
    for name, op in ops.items():
        expected = op(ids)  # and the warm-up: autotuning syncs, once per shape, as in vLLM's profile run
        with syncs_forbidden(device):
            good = op(ids)
            if _dispatch._failed:  # the reference would index the table with the bad id: a device-side assert
                raise RuntimeError(f"{name}: 'auto' fell back to the reference, which must not meet out-of-range ids")
            unchecked = op(bad_ids)
        ok = (
            bits_equal(good, expected)
            and bool(unchecked[0, 0].isnan().all())
            and bits_equal(unchecked[others], expected[others])
        )
        results.append(dict(check=f"{name}_no_sync_where_syncs_are_forbidden_bf16", ok=ok))


def check_cuda_graph_replay(device, results, batch, soft_tokens, hidden, features, **_):
    weight = (torch.randn(hidden, features, device=device) / features**0.5).bfloat16()
    table = torch.randn(2, P, hidden, device=device, dtype=torch.bfloat16)

    def stem(pixels, ids, residual, hidden_states):  # backend "auto", as the patched Gemma 4 modules call them
        padding = reference.default_padding_positions(ids)
        embedded = fused_vision.patch_embed(pixels, weight, table, ids, padding)
        looked_up = fused_vision.position_embeddings(table, ids, padding, residual=residual)
        pooled, mask = fused_vision.pool_by_positions(hidden_states, ids, padding, soft_tokens)
        return embedded, looked_up, pooled, mask

    def inputs(items, seed):
        generator = torch.Generator().manual_seed(seed)  # new grids, so new padding, on each seed
        ids = image_ids(items, soft_tokens, generator=generator).to(device)
        return dict(
            pixels=torch.rand(*ids.shape[:2], features, generator=generator).to(device),
            ids=ids,
            residual=torch.randn(*ids.shape[:2], hidden, generator=generator).to(device, torch.bfloat16),
            hidden_states=torch.randn(*ids.shape[:2], hidden, generator=generator).to(device, torch.bfloat16),
        )

    def replay_matches_eager(items, warm_up):
        static, new = inputs(items, 1), inputs(items, 2)
        if warm_up:
            stem(**static)  # autotuning and compilation cannot be captured
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):  # a sync in any op fails the capture
                captured = stem(**static)
        for name, value in new.items():
            static[name].copy_(value)
        if device.type == "cuda":
            graph.replay()
        else:  # no graphs off a GPU (--smoke): an eager call on the buffers, to test the rest
            captured = stem(**static)
        expected = stem(**new)
        return all(
            torch.equal(got, want) if got.dtype == torch.bool else bits_equal(got, want)
            for got, want in zip(captured, expected, strict=True)
        )

    shape = f"N{soft_tokens * 9}_D{hidden}_bf16"
    results.append(dict(check=f"cuda_graph_replay_on_new_inputs_B{batch}_{shape}", ok=replay_matches_eager(batch, True)))
    # Half the batch, captured without a warm-up at that size, as a server meets a new batch size: nothing
    # may compile, autotune or sync (the tiles are tuned per D, not per size).
    half = max(1, batch // 2)
    ok = replay_matches_eager(half, False)
    results.append(dict(check=f"cuda_graph_capture_at_a_new_batch_size_B{half}_{shape}", ok=ok))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for gpu_checks.json")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on any device, to test this script")
    args = parser.parse_args()
    if not (args.smoke or torch.cuda.is_available()):
        sys.exit("gpu_checks: needs a CUDA device (or --smoke)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    # The fp32 references must not run on TF32, which an environment can switch on.
    torch.set_float32_matmul_precision("highest")
    results = []
    # The checks only a GPU can make (sync debug mode, graph capture) before the slowest to build, so that
    # a time box cuts that one: past 2**31 the pooler's strides are typed int64, which builds its kernels
    # again, and its L is a new autotuning key.
    checks = (
        check_lookup_real_shape,
        check_lookup_over_2_31,
        check_patch_embed,
        check_pooler,
        check_pooler_backward,
        check_table_grad,
        check_no_sync_where_syncs_are_forbidden,
        check_cuda_graph_replay,
        check_pooler_rows_past_2_31,
    )
    os.makedirs(args.out, exist_ok=True)
    environment = dict(
        device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        torch=torch.__version__,
        fused_vision=fused_vision.__version__,
        float32_matmul_precision=torch.get_float32_matmul_precision(),
    )
    for check in checks:
        start, done = time.perf_counter(), len(results)
        try:
            check(device, results, **(SMOKE_SIZES if args.smoke else SIZES))
            if device.type == "cuda":  # inside: a sticky CUDA error surfaces here, as this check's failure
                torch.cuda.synchronize(device)
                torch.cuda.empty_cache()
        except Exception as exc:  # a compile or out-of-memory error fails this check, not the ones after it
            traceback.print_exc()
            results.append(dict(check=check.__name__, error=f"{type(exc).__name__}: {exc}", ok=False))
        if _dispatch._failed:  # backend "auto" ran the reference: its results say nothing of the kernels
            fell_back = ", ".join(f"{op} on {device_type}" for op, device_type in sorted(_dispatch._failed))
            results.append(dict(check=f"{check.__name__}_ran_the_kernels", error=f"'auto' fell back: {fell_back}", ok=False))
            _dispatch._failed.clear()  # the next check runs the kernels again
        print(f"{check.__name__}: {time.perf_counter() - start:.1f} s", flush=True)
        for row in results[done:]:
            print(("PASS " if row["ok"] else "FAIL ") + json.dumps(row), flush=True)
        # Rewritten after every check, whole or not at all: a time box that interrupts the script keeps
        # the finished ones.
        path = os.path.join(args.out, "gpu_checks.json")
        with open(path + ".tmp", "w") as f:
            json.dump(dict(environment=environment, results=results), f, indent=1)
        os.replace(path + ".tmp", path)
    passed = all(row["ok"] for row in results) and (args.smoke or any(row.get("over_2_31") for row in results))
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
