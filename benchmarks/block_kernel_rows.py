"""What one more row costs the int16 block kernels: a GGUF file's own MLP matrices (the first of each of Q4_K, Q6_K,
Q5_0 and Q8_0), packed as lmserve packs them, timed at 1 to 8 rows (medians of 40 calls), with 16-bit activations
(`--block-activations int16`, the default) or 8-bit ones (`int8`: LMSERVE_ROWS_ACTIVATIONS=int8). A kernel bound by the
weights' bytes takes about as long for 5 rows as for 1; one bound by arithmetic takes ~5x. Speculative decoding's
verify step and a batch of decodes pay that difference. Run with LMSERVE_KERNEL_MARCH=haswell
LMSERVE_DISABLE_CPU_FEATURES=amx,vnni for the AVX2 build.

    .venv/bin/python benchmarks/block_kernel_rows.py MODEL.gguf [ROWS ...]
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import gguf
import numpy as np
import torch

from lmserve.worker.kernels import cpu_kernels

FORMATS = {"Q4_K": ("q4_k", 256, 144), "Q6_K": ("q6_k", 256, 210), "Q5_0": ("q5_0", 32, 22), "Q8_0": ("q8_0", 32, 34)}


def main() -> None:
    ops = cpu_kernels()
    rows_list = [int(x) for x in sys.argv[2:]] or [1, 2, 3, 4, 5, 8]
    layers = {}
    for tensor in gguf.GGUFReader(sys.argv[1]).tensors:
        kind = tensor.tensor_type.name
        if kind in FORMATS and kind not in layers and len(tensor.shape) == 2 and ".ffn_" in tensor.name:
            name, per_block, block_bytes = FORMATS[kind]
            in_features, out_features = int(tensor.shape[0]), int(tensor.shape[1])
            blocks = torch.from_numpy(np.array(tensor.data).reshape(out_features, in_features // per_block,
                                                                     block_bytes))
            packed = getattr(ops, f"{name}_int16_pack")([blocks])
            layers[kind] = (name, tensor.name, packed, out_features, in_features)
    for name, tensor_name, packed, out_features, in_features in layers.values():
        op = getattr(ops, f"{name}_{os.environ.get('LMSERVE_ROWS_ACTIVATIONS', 'int16')}_linear")
        timings = []
        for rows in rows_list:
            x = torch.randn(rows, in_features)
            for _ in range(5):
                op(x, packed, out_features, None)
            samples = []
            for _ in range(40):
                started = time.perf_counter()
                op(x, packed, out_features, None)
                samples.append(time.perf_counter() - started)
            timings.append(f"{rows}: {statistics.median(samples) * 1e6:.0f} us")
        print(f"{name} {tensor_name} [{out_features} x {in_features}]  " + ", ".join(timings), flush=True)


if __name__ == "__main__":
    main()
