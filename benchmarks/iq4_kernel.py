"""IQ4_NL weights at their stored size against the same weights as q8_0 blocks (what lmserve held them as before the
iq4_nl kernel): `iq4_nl_int16_linear` and `q8_0_int16_linear` of kernels/int16_activations.cpp over 24 matrices of
Qwen2.5 0.5B's gate/up size (9,728 x 896: 112 MiB as iq4_nl, 210 MiB as q8_0, so that the weights come from memory
as in a decode step), the same random indices and scales, passes alternating between the two. Median ms per pass.

    .venv/bin/python benchmarks/iq4_kernel.py [--rows 1 8] [--passes 9]
    LMSERVE_KERNEL_MARCH=haswell LMSERVE_DISABLE_CPU_FEATURES=amx,vnni .venv/bin/python benchmarks/iq4_kernel.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from lmserve.worker.kernels import cpu_kernels, kernel_march
from lmserve.worker.weights.stored_formats import convert_blocks

OUT_FEATURES, IN_FEATURES, MATRICES = 9728, 896, 24


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--passes", type=int, default=9)
    args = parser.parse_args()
    ops, rng = cpu_kernels(), np.random.default_rng(0)
    weights: dict[str, list[torch.Tensor]] = {"iq4_nl": [], "q8_0": []}
    for _ in range(MATRICES):
        scales = (rng.random((OUT_FEATURES, IN_FEATURES // 32, 1)) * 2e-3).astype(np.float16)
        indices = rng.integers(0, 256, (OUT_FEATURES, IN_FEATURES // 32, 16), dtype=np.uint8)
        blocks = np.concatenate([scales.view(np.uint8), indices], axis=-1)
        weights["iq4_nl"].append(ops.iq4_nl_int16_pack([torch.from_numpy(blocks)]))
        weights["q8_0"].append(ops.q8_0_int16_pack([torch.from_numpy(convert_blocks("iq4_nl", blocks, "q8_0"))]))
    print(f"march {kernel_march()}, {torch.get_num_threads()} threads, {MATRICES} x {OUT_FEATURES} x {IN_FEATURES}")
    for rows in args.rows:
        x = torch.randn(rows, IN_FEATURES)
        times: dict[str, list[float]] = {name: [] for name in weights}
        for _ in range(args.passes):
            for name, layers in weights.items():
                op = getattr(ops, f"{name}_int16_linear")
                start = time.perf_counter()
                for w in layers:
                    op(x, w, OUT_FEATURES, None)
                times[name].append((time.perf_counter() - start) * 1e3)
        medians = {name: statistics.median(t) for name, t in times.items()}
        sizes = {name: sum(w.numel() for w in layers) / 2**20 for name, layers in weights.items()}
        print(f"rows {rows}: " + ", ".join(
            f"{name} {medians[name]:.2f} ms ({min(times[name]):.2f}-{max(times[name]):.2f}, {sizes[name]:.0f} MiB)"
            for name in weights) + f"; iq4_nl / q8_0 = {medians['iq4_nl'] / medians['q8_0']:.2f}")


if __name__ == "__main__":
    main()
