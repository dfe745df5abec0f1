"""Q3_K and Q2_K weights at their stored size against what lmserve held them as before their kernel formats: Q3_K as
q6_k blocks (`q3_k_int16_linear` against `q6_k_int16_linear`, kernels/kquant_int16.cpp), Q2_K as float16 weights
through fbgemm (Float16WeightLinear). 24 matrices of Qwen2.5 0.5B's down-projection size (896 x 4,864), so that the
weights come from memory as in a decode step; the same random codes and scales for both sides of a pair, passes
alternating between them. Median ms per pass.

    .venv/bin/python benchmarks/low_bit_kquants.py [--rows 1 8 64] [--passes 9]
    LMSERVE_KERNEL_MARCH=haswell LMSERVE_DISABLE_CPU_FEATURES=amx,vnni .venv/bin/python benchmarks/low_bit_kquants.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from lmserve.worker.kernels import cpu_kernels, kernel_march
from lmserve.worker.weights.batched_copies import Float16WeightLinear
from lmserve.worker.weights.block_packing import StoredBlocks
from lmserve.worker.weights.stored_formats import convert_blocks

OUT_FEATURES, IN_FEATURES, MATRICES = 896, 4864, 24
BLOCK_BYTES, SCALE_AT = {"q3_k": 110, "q2_k": 84}, {"q3_k": (108,), "q2_k": (80, 82)}


def random_blocks(stored_type: str, rng: np.random.Generator) -> np.ndarray:
    blocks = rng.integers(0, 256, (OUT_FEATURES, IN_FEATURES // 256, BLOCK_BYTES[stored_type]), dtype=np.uint8)
    for at in SCALE_AT[stored_type]:
        scale = (rng.random((OUT_FEATURES, IN_FEATURES // 256, 1)) * 1e-3).astype(np.float16)
        blocks[..., at : at + 2] = scale.view(np.uint8)
    return blocks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--passes", type=int, default=9)
    args = parser.parse_args()
    ops, rng = cpu_kernels(), np.random.default_rng(0)
    # pair -> side -> (bytes held, one call per matrix)
    pairs: dict[str, dict[str, tuple[int, list[Callable[[torch.Tensor], torch.Tensor]]]]] = {}
    for stored_type, before in (("q3_k", "q6_k"), ("q2_k", "float16")):
        calls: dict[str, list] = {stored_type: [], before: []}
        held = {stored_type: 0, before: 0}
        for _ in range(MATRICES):
            blocks = random_blocks(stored_type, rng)
            packed = getattr(ops, f"{stored_type}_int16_pack")([torch.from_numpy(blocks)])
            held[stored_type] += packed.numel()
            calls[stored_type].append((stored_type, packed))
            if before == "q6_k":
                other = ops.q6_k_int16_pack([torch.from_numpy(convert_blocks("q3_k", blocks, "q6_k"))])
                held[before] += other.numel()
                calls[before].append(("q6_k", other))
            else:
                layer = Float16WeightLinear(StoredBlocks(stored_type, torch.from_numpy(blocks)).dequantize(), None)
                held[before] += 2 * OUT_FEATURES * IN_FEATURES
                calls[before].append(("float16", layer))
        pairs[f"{stored_type} / {before}"] = {side: (held[side], calls[side]) for side in calls}
    print(f"march {kernel_march()}, {torch.get_num_threads()} threads, {MATRICES} x {OUT_FEATURES} x {IN_FEATURES}")

    def run(call: tuple[str, object], x: torch.Tensor, activations: str) -> None:
        name, weight = call
        if name == "float16":
            weight(x)
        else:
            getattr(ops, f"{name}_{activations}_linear")(x, weight, OUT_FEATURES, None)

    for rows in args.rows:
        x = torch.randn(rows, IN_FEATURES)
        for activations in ("int16", "int8"):
            for pair, sides in pairs.items():
                times: dict[str, list[float]] = {side: [] for side in sides}
                for _ in range(args.passes):
                    for side, (_, calls) in sides.items():
                        start = time.perf_counter()
                        for call in calls:
                            run(call, x, activations)
                        times[side].append((time.perf_counter() - start) * 1e3)
                medians = {side: statistics.median(t) for side, t in times.items()}
                first, second = list(sides)
                print(f"rows {rows}, {activations} activations: " + ", ".join(
                    f"{side} {medians[side]:.2f} ms ({min(times[side]):.2f}-{max(times[side]):.2f}, "
                    f"{sides[side][0] / 2**20:.0f} MiB)" for side in sides)
                    + f"; {pair} = {medians[first] / medians[second]:.2f}")


if __name__ == "__main__":
    main()
