"""The block kernel against the two copies that larger batches can multiply with: float16 through fbgemm (float32
activations) and bfloat16 through oneDNN (activations rounded to bfloat16; AMX or AVX-512 BF16 where the CPU has them).

Part 1 times the default model's linear layers (qkv, o, gate_up, down in 30 layers of distinct random weights, so
the weights come from memory as in a real step) with q4_1 blocks through `torch.ops.lmserve.q4_1_linear`, and with
the same weights through each copy, interleaved call by call. Part 2 runs the offline engine on the default model
with a batch of decodes and alternates the layers' batched path (`--batched-weights` and the kernel's row limit)
every 5 steps, on the same running requests.

    .venv/bin/python benchmarks/block_gemm.py [--rows 1 4 8 16 ...] [--decodes 16] [--skip-engine]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from lmserve import LLM, SamplingParams
from lmserve.worker.kernels import cpu_flags, cpu_kernels
from lmserve.worker.weights.block_linear import Q4_1Linear, use_batched_path
from lmserve.worker.weights.kernel_choice import AMX_BLOCK_KERNEL_MAX_ROWS, BLOCK_KERNEL_MAX_ROWS, BatchedPath

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down: (out, in)
COPIES = {"fbgemm float16": "fp16", "oneDNN bfloat16": "bf16"}


def cpu_kind() -> str:
    flags = cpu_flags()
    return ", ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags)


def layer_table(rows_list: list[int], layers: int, repeats: int) -> None:
    gen = torch.Generator().manual_seed(0)
    weights = [[torch.randn(n, k, generator=gen) * 0.05 for n, k in SHAPES] for _ in range(layers)]
    copies = {
        name: [[Q4_1Linear(w, None, BatchedPath(kind, 0)) for w in layer] for layer in weights]
        for name, kind in COPIES.items()
    }
    kernel_layers = next(iter(copies.values()))
    for layer_list in copies.values():
        for layer in layer_list:
            for linear in layer:
                linear.prepare_batched()
    op = torch.ops.lmserve.q4_1_linear
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU flags: {cpu_kind()}; "
          f"{layers} layers × 4 linears, ms per pass (medians of {repeats})\n")
    print("| input rows | q4_1 kernel | " + " | ".join(COPIES) + " | best | kernel GMAC/s |")
    print("|---|---|" + "---|" * len(COPIES) + "---|---|")
    for rows in rows_list:
        inputs = {k: torch.randn(rows, k, generator=gen) for k in (576, 1536)}

        def kernel(inputs=inputs) -> None:
            for layer in kernel_layers:
                for (n, k), linear in zip(SHAPES, layer, strict=True):
                    op(inputs[k], linear.blocks, n, None)

        arms = {"kernel": kernel}
        for name, layer_list in copies.items():
            def copy(inputs=inputs, layer_list=layer_list) -> None:
                for layer in layer_list:
                    for (_, k), linear in zip(SHAPES, layer, strict=True):
                        linear.batched(inputs[k])
            arms[name] = copy
        times: dict[str, list[float]] = {name: [] for name in arms}
        for _ in range(repeats if rows <= 256 else max(3, repeats // 3)):
            for name, fn in arms.items():
                started = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - started)
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        macs = rows * layers * sum(n * k for n, k in SHAPES)
        print(f"| {rows} | " + " | ".join(f"{v:.2f}" for v in ms.values()) + f" | {min(ms, key=ms.get)} | "
              f"{macs / ms['kernel'] / 1e6:.1f} |", flush=True)


def engine_steps(decodes: int, rounds: int) -> None:
    arms = {
        f"kernel up to {BLOCK_KERNEL_MAX_ROWS} rows, fp16 copy above": BatchedPath("fp16", BLOCK_KERNEL_MAX_ROWS),
        f"kernel up to {AMX_BLOCK_KERNEL_MAX_ROWS} rows, bf16 copy above": BatchedPath("bf16", AMX_BLOCK_KERNEL_MAX_ROWS),
    }
    llm = LLM(max_num_seqs=decodes, enable_prefix_caching=False)
    model = llm.engine.executor.runner.model
    for path in arms.values():
        use_batched_path(model, path)
        for layer in model.layers:
            for linear in layer.modules():
                if hasattr(linear, "prepare_batched"):
                    linear.prepare_batched()
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=6 * 2 * rounds + 8, temperature=0, ignore_eos=True)
    for prompt in torch.randint(1000, 49000, (decodes, 256), generator=gen).tolist():
        llm._add(prompt, params, 0)
    scheduler = llm.engine.scheduler
    while len(scheduler.running) < decodes or any(not r.output_token_ids for r in scheduler.running):
        llm.engine.step()  # the prompts' prefill
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(rounds):
        for name, path in arms.items():
            use_batched_path(model, path)
            llm.engine.step()  # the first step after a switch (and its copy's build) is not timed
            for _ in range(5):
                started = time.perf_counter()
                llm.engine.step()
                times[name].append(time.perf_counter() - started)
    print(f"\n| engine decode step, {decodes} decodes at context ~256-{256 + 6 * 2 * rounds} | median ms | min ms |")
    print("|---|---|---|")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values) * 1e3:.1f} | {min(values) * 1e3:.1f} |")
    a, b = (statistics.median(values) for values in times.values())
    print(f"\nbf16 path's speedup on the step: {a / b:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 32, 64, 128, 256, 512])
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
