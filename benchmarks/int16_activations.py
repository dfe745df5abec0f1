"""The block kernels with float32 activations against int16 activations (`--block-activations`), side by side.

One pass = the default model's 30 decoder layers of q4_1 weights (qkv 960x576, o 576x576, gate_up 3072x576, down
576x1536; distinct random weights, so each comes from memory as in a decode step) and its q8_0 output layer
(49152x576), for each number of rows. The two kernels take turns (the first turn alternating by round) so both see
the same machine state; the medians over the rounds are reported, and their ratio.

    .venv/bin/python benchmarks/int16_activations.py [--rows 1 2 4 8 16 32 64] [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lmserve.worker.kernels import cpu_kernels
from lmserve.worker.weights.block_packing import pack_blocks, quantize_blocks

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
OUTPUT_LAYER = (49152, 576)


def build(method: str, shape: tuple[int, int], gen: torch.Generator) -> dict[str, torch.Tensor]:
    blocks = quantize_blocks(method, torch.randn(*shape, generator=gen) * 0.05)
    return {"float32": pack_blocks(method, blocks), "int16": getattr(cpu_kernels(), f"{method}_int16_pack")([blocks])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    ops = cpu_kernels()
    if not hasattr(ops, "q4_1_int16_linear"):
        raise SystemExit("the int16 kernels are not built on this CPU (they need AVX2, FMA and F16C)")
    gen = torch.Generator().manual_seed(0)
    layers = [[("q4_1", shape, build("q4_1", shape, gen)) for shape in LAYER_SHAPES] for _ in range(30)]
    output = ("q8_0", OUTPUT_LAYER, build("q8_0", OUTPUT_LAYER, gen))
    kernels = {
        "float32": {"q4_1": ops.q4_1_linear, "q8_0": ops.q8_0_linear},
        "int16": {"q4_1": ops.q4_1_int16_linear, "q8_0": ops.q8_0_int16_linear},
    }
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ms per pass, median of {args.rounds} rounds")
    print("| rows | layers float32 | layers int16 | ratio | output layer float32 | output layer int16 | ratio |")
    print("|---|---|---|---|---|---|---|")
    for rows in args.rows:
        inputs = {k: torch.randn(rows, k, generator=gen) for k in (576, 1536)}
        times = {(kind, part): [] for kind in kernels for part in ("layers", "output")}
        for round_ in range(args.rounds):
            for kind in list(kernels)[:: 1 if round_ % 2 else -1]:
                started = time.perf_counter()
                for layer in layers:
                    for method, (n, k), packed in layer:
                        kernels[kind][method](inputs[k], packed[kind], n, None)
                middle = time.perf_counter()
                method, (n, k), packed = output
                kernels[kind][method](inputs[k], packed[kind], n, None)
                times[kind, "layers"].append(middle - started)
                times[kind, "output"].append(time.perf_counter() - middle)
        ms = {key: statistics.median(values) * 1e3 for key, values in times.items()}
        print(f"| {rows} | {ms['float32', 'layers']:.2f} | {ms['int16', 'layers']:.2f} | "
              f"{ms['float32', 'layers'] / ms['int16', 'layers']:.2f}x | {ms['float32', 'output']:.2f} | "
              f"{ms['int16', 'output']:.2f} | {ms['float32', 'output'] / ms['int16', 'output']:.2f}x |")


if __name__ == "__main__":
    main()
