"""How fast each stored format's blocks are packed into the int16 kernels' layout: the start-up work a GGUF file's
matrices cost once they are mapped (a 3B Q4_K_M model packs ~1.9 GB). Random blocks, 12 matrices of 8,960 x 1,536,
packed 5 times on all threads; the median, in GB/s of the file's bytes (the output's pages faulted in included, as at
start-up). For an A/B of two trees, run it alternately from each (PYTHONPATH=WORKTREE/src, and LMSERVE_CACHE=another
folder so that the two trees' kernels do not rebuild each other's).

    .venv/bin/python benchmarks/packing.py [--formats q4_k q6_k ...]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from lmserve.worker.kernels import cpu_kernels, kernel_march

# llama.cpp's bytes per block and weights per block, for each format the int16 kernels pack.
BLOCKS = {
    "q4_k": (144, 256), "q5_k": (176, 256), "q6_k": (210, 256), "q3_k": (110, 256), "q2_k": (84, 256),
    "q8_0": (34, 32), "q4_0": (18, 32), "q4_1": (20, 32), "q5_0": (22, 32), "q5_1": (24, 32), "iq4_nl": (18, 32),
}
OUT_FEATURES, IN_FEATURES, MATRICES, PASSES = 8960, 1536, 12, 5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", nargs="+", default=list(BLOCKS), choices=list(BLOCKS))
    args = parser.parse_args()
    ops, rng = cpu_kernels(), np.random.default_rng(0)
    print(f"march {kernel_march()}, {torch.get_num_threads()} threads, {MATRICES} x {OUT_FEATURES} x {IN_FEATURES}")
    for name in args.formats:
        block_bytes, width = BLOCKS[name]
        shape = (OUT_FEATURES, IN_FEATURES // width, block_bytes)
        # Random bytes are valid blocks for the packers: they move bits and never read the float16 scales' values.
        blocks = [torch.from_numpy(rng.integers(0, 256, shape, dtype=np.uint8)) for _ in range(MATRICES)]
        pack = getattr(ops, f"{name}_int16_pack")
        times = []
        for _ in range(PASSES):
            start = time.perf_counter()
            packed = [pack([matrix]) for matrix in blocks]
            times.append(time.perf_counter() - start)
            del packed
        total = sum(matrix.numel() for matrix in blocks)
        median = statistics.median(times)
        print(f"{name}: {total / median / 1e9:.2f} GB/s ({median * 1e3:.0f} ms for {total / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
