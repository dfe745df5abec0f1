"""Prompt-sized products on a real Q4_K_M file's layers: the stored blocks with 16-bit activations (`--batched-weights
none`), with 8-bit ones (`prompt-int8`) and fbgemm's float16 copy (`prompt-fp16`), interleaved call by call.

Each layer is read from the file (its own type: Q5_0, Q6_K, Q4_K, Q8_0), packed as the engine packs it, and
multiplied by M random rows; the error is the relative Frobenius error against the float32 product of the file's
values. LMSERVE_KERNEL_MARCH=haswell LMSERVE_DISABLE_CPU_FEATURES=amx,vnni times the AVX2 build of the kernels
(fbgemm still picks its own kernels for the CPU it runs on).

    .venv/bin/python benchmarks/int8_prompt_rows.py MODEL.gguf [--rows 256] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader

from lmserve.worker.kernels import cpu_flags, cpu_kernels, kernel_march
from lmserve.worker.weights.batched_copies import Float16WeightLinear

LAYERS = ("blk.0.attn_q.weight", "blk.0.ffn_gate.weight", "blk.0.ffn_down.weight", "blk.3.ffn_down.weight",
          "output.weight")
BLOCK_BYTES = {"q4_k": 144, "q5_k": 176, "q6_k": 210, "q5_0": 22, "q5_1": 24, "q8_0": 34, "q4_1": 20}


def cpu_kind() -> str:
    flags = cpu_flags()
    return ", ".join(f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16") if f in flags)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.manual_seed(0)
    ops = cpu_kernels()
    print(f"CPU: {cpu_kind()}; kernels built for -march={kernel_march()}; {torch.get_num_threads()} threads; "
          f"torch {torch.__version__}; {args.rows} rows")
    print("| layer | type | shape | 16-bit (none) | 8-bit (prompt-int8) | float16 copy | 8-bit vs 16-bit | "
          "8-bit vs copy | error 16 / 8 / copy |")
    print("|---|---|---|---|---|---|---|---|---|")
    for tensor in GGUFReader(args.model).tensors:
        if tensor.name not in LAYERS:
            continue
        method = GGMLQuantizationType(tensor.tensor_type).name.lower()
        if method not in BLOCK_BYTES:
            continue
        n, k = int(tensor.shape[1]), int(tensor.shape[0])
        blocks = torch.from_numpy(np.array(tensor.data)).reshape(n, -1, BLOCK_BYTES[method])
        ms, errors = time_layer(ops, method, blocks, n, k, args.rows, args.repeats)
        print(f"| {tensor.name} | {method} | {n} x {k} | {ms['int16']:.2f} ms | {ms['int8']:.2f} ms | "
              f"{ms['fp16']:.2f} ms | {ms['int16'] / ms['int8']:.2f}x | {ms['fp16'] / ms['int8']:.2f}x | "
              f"{errors['int16']:.1e} / {errors['int8']:.1e} / {errors['fp16']:.1e} |")


def time_layer(ops, method: str, blocks: torch.Tensor, n: int, k: int, rows: int,
               repeats: int) -> tuple[dict[str, float], dict[str, float]]:
    """Median milliseconds and relative errors of the three paths on one layer."""
    weight = getattr(ops, f"{method}_int16_pack")([blocks])
    values = torch.empty(n, k)
    getattr(ops, f"{method}_int16_dequantize")(weight, values)
    copy = Float16WeightLinear(values, None)
    x = torch.randn(rows, k)
    reference = x @ values.T
    int16, int8 = getattr(ops, f"{method}_int16_linear"), getattr(ops, f"{method}_int8_linear")
    paths = {"int16": lambda: int16(x, weight, n, None), "int8": lambda: int8(x, weight, n, None),
             "fp16": lambda: copy(x)}
    errors = {name: ((run() - reference).norm() / reference.norm()).item() for name, run in paths.items()}
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(repeats):
        for name, run in paths.items():
            started = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}, errors

if __name__ == "__main__":
    main()
