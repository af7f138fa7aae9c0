"""The fp32 embedder's summation order against cuBLAS's, without a GPU: fp32 fma chains emulated on the CPU.

    python bench/fp32_accumulation.py [--rows 90] [--cols 72] [--features 768] [--seeds 8]

Each output of the projection sums K products. An ieee `tl.dot` on a GPU is one fma chain per output over
its K block. cuBLAS may split K into s chains for a small output and add their results, which is more
accurate than one chain. The fused embedder's fp32 path sums each K block's chain in fp64
(kernels/patch_embed.py). For each order this prints the relative error (2-norm) against float64 and its
ratio to s-way split chains, each the mean over seeds. The default shapes are those of the test that holds
fp32 accuracy to 1.5x stock's (tests/ops/test_patch_embed.py, K768_D72). An fma is emulated as the float64 sum
of the exact product and the fp32 accumulator, rounded to fp32: exact but for rare double roundings.
"""

import argparse

import numpy as np

SPLITS = (1, 2, 3, 4, 8, 16)
BLOCKS = (32, 64)


def split_name(splits: int) -> str:
    """The row of cuBLAS's order with K split ``splits`` ways; unsplit, the old kernel's one chain."""
    return "one chain over K (before 2026-12-02)" if splits == 1 else f"split K {splits} ways (cuBLAS)"


def fma_chain(a: np.ndarray, b: np.ndarray, acc: np.ndarray | None = None) -> np.ndarray:
    """a (M, K) @ b (K, N) in fp32 as one fma chain per output, k ascending, from ``acc`` or zero."""
    if acc is None:
        acc = np.zeros((a.shape[0], b.shape[1]), np.float32)
    for k in range(a.shape[1]):
        acc = (np.outer(a[:, k].astype(np.float64), b[k].astype(np.float64)) + acc).astype(np.float32)
    return acc


def chains_per_block(a: np.ndarray, b: np.ndarray, block: int):
    """Each K block's fp32 chain, for K blocks of ``block`` terms."""
    for k0 in range(0, a.shape[1], block):
        yield fma_chain(a[:, k0 : k0 + block], b[k0 : k0 + block])


def block_chains(a: np.ndarray, b: np.ndarray, block: int, sum_dtype: type) -> np.ndarray:
    """A chain per K block of ``block`` terms, the blocks added in ``sum_dtype``: the fused kernel's order
    in fp64; in fp32, cuBLAS's split K (blocks of K / splits), and the order `acc + tl.dot(a, b)` would
    give were Triton not to fold it into one chain."""
    out = np.zeros((a.shape[0], b.shape[1]), sum_dtype)
    for chain in chains_per_block(a, b, block):
        out = out + chain.astype(sum_dtype)
    return out.astype(np.float32)


def block_chains_compensated(a: np.ndarray, b: np.ndarray, block: int) -> np.ndarray:
    """A chain per K block of ``block`` terms, the blocks added in fp32 with Kahan's compensation: the
    alternative to fp64 sums that bench/NOTES.md weighs."""
    total = np.zeros((a.shape[0], b.shape[1]), np.float32)
    compensation = np.zeros_like(total)
    for chain in chains_per_block(a, b, block):
        addend = chain - compensation
        new_total = total + addend
        compensation = (new_total - total) - addend
        total = new_total
    return total


def orders(a: np.ndarray, b: np.ndarray) -> dict[str, np.ndarray]:
    results = {split_name(1): fma_chain(a, b)}
    results |= {split_name(s): block_chains(a, b, -(-a.shape[1] // s), np.float32) for s in SPLITS[1:]}
    for block in BLOCKS:
        results[f"K blocks of {block}, summed in fp64 (fused)"] = block_chains(a, b, block, np.float64)
        results[f"K blocks of {block}, summed in fp32"] = block_chains(a, b, block, np.float32)
        results[f"K blocks of {block}, Kahan sum in fp32"] = block_chains_compensated(a, b, block)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=90, help="M, rows of the output (default: 2 x 45 patches)")
    parser.add_argument("--cols", type=int, default=72, help="N, the width D")
    parser.add_argument("--features", type=int, default=768, help="K")
    parser.add_argument("--seeds", type=int, default=8)
    args = parser.parse_args()

    errors: dict[str, list[float]] = {}
    for seed in range(args.seeds):
        rng = np.random.default_rng(seed)
        # The test's inputs: prescaled pixels 2 * (U[0, 1) - 0.5) and weights N(0, 1/K), in fp32.
        a = (2 * (rng.random((args.rows, args.features)) - 0.5)).astype(np.float32)
        b = (rng.standard_normal((args.features, args.cols)) / args.features**0.5).astype(np.float32)
        exact = a.astype(np.float64) @ b.astype(np.float64)
        for name, result in orders(a, b).items():
            error = np.linalg.norm(result - exact) / np.linalg.norm(exact)
            errors.setdefault(name, []).append(error)

    print(f"M={args.rows} N={args.cols} K={args.features}, {args.seeds} seeds; error ratio to K split s ways")
    print(f"{'order':44} {'rel. error':>10}  " + " ".join(f"s={s:<4}" for s in SPLITS))
    for name, values in errors.items():
        values = np.array(values)
        ratios = [np.mean(values / np.array(errors[split_name(s)])) for s in SPLITS]
        print(f"{name:44} {values.mean():10.3e}  " + " ".join(f"{r:6.2f}" for r in ratios))


if __name__ == "__main__":
    main()
