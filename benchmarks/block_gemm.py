"""Batches above 8 rows: the block kernel's widened-weights path against the float16 copy through fbgemm.

Part 1 times the default model's linear layers (qkv, o, gate_up, down in 30 layers of distinct random weights, so
the weights come from memory as in a real step) with q4_1 blocks through `torch.ops.lmserve.q4_1_linear`, and with
the same weights in float16 through fbgemm (the layer's copy above BLOCK_KERNEL_MAX_ROWS), interleaved call by call.
Part 2 runs the offline engine on the default model with a batch of decodes and alternates
`quantization.BLOCK_KERNEL_MAX_ROWS` between 8 (every batch above 8 rows through fbgemm, the setting before this
path) and its current value every 5 steps, on the same running requests.

    .venv/bin/python benchmarks/block_gemm.py [--rows 9 16 20 ...] [--decodes 16] [--skip-engine]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from lmserve import LLM, SamplingParams
from lmserve.worker import quantization
from lmserve.worker.kernels import cpu_kernels
from lmserve.worker.quantization import Q4_1Linear

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down: (out, in)


def layer_table(rows_list: list[int], layers: int, repeats: int) -> None:
    gen = torch.Generator().manual_seed(0)
    linears = [[Q4_1Linear(torch.randn(n, k, generator=gen) * 0.05, None) for n, k in SHAPES] for _ in range(layers)]
    op = torch.ops.lmserve.q4_1_linear
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {layers} layers × 4 linears\n")
    print("| input rows | q4_1 kernel ms | fbgemm float16 ms | fbgemm / kernel | kernel GMAC/s |")
    print("|---|---|---|---|---|")
    for rows in rows_list:
        inputs = {k: torch.randn(rows, k, generator=gen) for k in (576, 1536)}
        for (n, k), layer in zip(SHAPES, linears[0], strict=True):
            reference = inputs[k] @ layer.dequantized().T
            torch.testing.assert_close(op(inputs[k], layer.blocks, n, None), reference, rtol=1e-4, atol=2e-3)

        def kernel(inputs=inputs) -> None:
            for layer in linears:
                for (n, k), linear in zip(SHAPES, layer, strict=True):
                    op(inputs[k], linear.blocks, n, None)

        def fbgemm(inputs=inputs) -> None:
            for layer in linears:
                for (_, k), linear in zip(SHAPES, layer, strict=True):
                    linear.prepare_batched()(inputs[k])

        times: dict[str, list[float]] = {"kernel": [], "fbgemm": []}
        for _ in range(repeats if rows <= 256 else max(3, repeats // 3)):
            for name, fn in (("kernel", kernel), ("fbgemm", fbgemm)):
                started = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - started)
        a, b = (statistics.median(times[name]) * 1e3 for name in ("kernel", "fbgemm"))
        macs = rows * layers * sum(n * k for n, k in SHAPES)
        print(f"| {rows} | {a:.1f} | {b:.1f} | {b / a:.2f}x | {macs / a / 1e6:.1f} |", flush=True)


def engine_steps(decodes: int, rounds: int) -> None:
    arms = {"fbgemm above 8 rows": 8, f"kernel up to {quantization.BLOCK_KERNEL_MAX_ROWS} rows":
            quantization.BLOCK_KERNEL_MAX_ROWS}
    llm = LLM(max_num_seqs=decodes, enable_prefix_caching=False)
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=6 * 2 * rounds + 8, temperature=0, ignore_eos=True)
    for prompt in torch.randint(1000, 49000, (decodes, 256), generator=gen).tolist():
        llm._add(prompt, params, 0)
    scheduler = llm.engine.scheduler
    while len(scheduler.running) < decodes or any(not r.output_token_ids for r in scheduler.running):
        llm.engine.step()  # the prompts' prefill
    times: dict[str, list[float]] = {name: [] for name in arms}
    try:
        for _ in range(rounds):
            for name, limit in arms.items():
                quantization.BLOCK_KERNEL_MAX_ROWS = limit
                llm.engine.step()  # the first step after a switch is not timed
                for _ in range(5):
                    started = time.perf_counter()
                    llm.engine.step()
                    times[name].append(time.perf_counter() - started)
    finally:
        quantization.BLOCK_KERNEL_MAX_ROWS = arms[list(arms)[1]]
    print(f"\n| engine decode step, {decodes} decodes at context ~256-{256 + 6 * 2 * rounds} | median ms | min ms |")
    print("|---|---|---|")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values) * 1e3:.1f} | {min(values) * 1e3:.1f} |")
    a, b = (statistics.median(values) for values in times.values())
    print(f"\nkernel speedup on the step: {a / b:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[9, 12, 16, 20, 32, 64, 128, 256, 512, 1024])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--decodes", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--skip-engine", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    cpu_kernels()
    layer_table(args.rows, args.layers, args.repeats)
    if not args.skip_engine:
        engine_steps(args.decodes, args.rounds)


if __name__ == "__main__":
    main()
