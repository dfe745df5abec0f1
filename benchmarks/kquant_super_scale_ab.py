"""The 8-bit K-quant linear op with one activation scale per 256 inputs (llama.cpp's q8_K, the default) against one per
32 (`LMSERVE_DISABLE_CPU_FEATURES=q8k`'s products), alternated in one process on one thread, by thread CPU time
(issue 70). Medians and minimums of `--repeats` calls each, and their ratios (per-256 over per-32).

    .venv/bin/python benchmarks/kquant_super_scale_ab.py [--repeats 11] [--k 2048] [--n 2048]

The weights are random codes with fixed float16 block scales: the products' time does not depend on their values.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from lmserve.worker.kernels import cpu_kernels
from lmserve.worker.weights.kquants import pack_kquant

# Block bytes, and where each format's float16 super-block scales sit (d, then dmin where it has one).
K_QUANT_BLOCKS = {"q4_k": (144, (0, 2)), "q5_k": (176, (0, 2)), "q6_k": (210, (208,))}


def random_blocks(method: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    block_bytes, scale_offsets = K_QUANT_BLOCKS[method]
    raw = rng.integers(0, 256, (rows, cols // 256, block_bytes), dtype=np.uint8)
    for at in scale_offsets:
        raw[..., at : at + 2] = np.full(raw.shape[:2], 1e-3, dtype=np.float16)[..., None].view(np.uint8)
    return raw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--k", type=int, default=2048, help="inputs (a multiple of 256)")
    parser.add_argument("--n", type=int, default=2048, help="outputs")
    args = parser.parse_args()
    torch.set_num_threads(1)
    ops = cpu_kernels()
    before = ops.set_kquant_super_scale(True)
    try:
        for method in K_QUANT_BLOCKS:
            weight = pack_kquant(method, random_blocks(method, args.n, args.k, np.random.default_rng(1)))
            linear = getattr(ops, f"{method}_int8_linear")
            for rows in (1, 8, 64, 512):
                x = torch.randn(rows, args.k, generator=torch.Generator().manual_seed(rows))
                times: dict[bool, list[float]] = {True: [], False: []}
                for r in range(args.repeats):
                    for per_256 in ((True, False) if r % 2 == 0 else (False, True)):
                        ops.set_kquant_super_scale(per_256)
                        linear(x, weight, args.n, None)  # warm: the first call after a switch pays for its caches
                        start = time.thread_time()
                        linear(x, weight, args.n, None)
                        times[per_256].append(time.thread_time() - start)
                median = {v: statistics.median(times[v]) * 1e3 for v in times}
                least = {v: min(times[v]) * 1e3 for v in times}
                rate = rows * args.n * args.k / (least[True] * 1e-3) / 1e9
                print(f"{method} M={rows:4d}: median per-256 {median[True]:8.2f} ms, per-32 {median[False]:8.2f} ms, "
                      f"ratio {median[True] / median[False]:.2f} | min ratio {least[True] / least[False]:.2f} "
                      f"| per-256 {rate:.0f} G multiply-adds/s", flush=True)
    finally:
        ops.set_kquant_super_scale(before)


if __name__ == "__main__":
    main()
