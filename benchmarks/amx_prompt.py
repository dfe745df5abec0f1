"""Prompt rows on AMX tiles (`--batched-weights prompt-bf16`, auto where the CPU has AMX) against the other paths.

1. One linear layer of the default model's shapes: torch's bfloat16 linear (oneDNN) with the casts its caller needs
   (float32 in, float32 out: Bfloat16WeightLinear) against lmserve's AMX kernel (AmxBfloat16Linear), alternating
   calls, medians.
2. Prefill only, offline engine: 64 prompts of 256 random tokens, max_tokens 1, 16 sequences, for each
   `--batched-weights` setting, the settings taking turns for --rounds rounds (one engine at a time).

    .venv/bin/python benchmarks/amx_prompt.py [--rounds 2] [--settings fp16 prompt-bf16 bf16] [--skip-layers]
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import time

import torch

from lmserve import LLM, SamplingParams
from lmserve.worker.kernels import cpu_flags
from lmserve.worker.weights.batched_copies import AmxBfloat16Linear, Bfloat16WeightLinear
from lmserve.worker.weights.kernel_choice import amx_kernel_loads

SHAPES = {"gate_up 3072 x 576": (3072, 576), "down 576 x 1536": (576, 1536), "qkv 960 x 576": (960, 576)}
ROWS = (16, 64, 256, 2048)


def layer_table(calls: int) -> None:
    print("| layer (out x in) | rows | oneDNN bf16 + casts (ms) | lmserve AMX kernel (ms) | AMX GFLOP/s |")
    print("|---|---|---|---|---|")
    for name, (n, k) in SHAPES.items():
        weight = torch.randn(n, k) * 0.05
        arms = {"onednn": Bfloat16WeightLinear(weight, None), "amx": AmxBfloat16Linear(weight, None)}
        for rows in ROWS:
            x = torch.randn(rows, k)
            times: dict[str, list[float]] = {a: [] for a in arms}
            for layer in arms.values():
                layer(x)
            for _ in range(calls):
                for arm, layer in arms.items():
                    started = time.perf_counter()
                    layer(x)
                    times[arm].append((time.perf_counter() - started) * 1e3)
            onednn, amx = statistics.median(times["onednn"]), statistics.median(times["amx"])
            print(f"| {name} | {rows} | {onednn:.3f} | {amx:.3f} | {2 * rows * n * k / amx / 1e6:.0f} |", flush=True)


def prefill_rate(setting: str) -> float:
    llm = LLM(batched_weights=setting, max_num_seqs=16, enable_prefix_caching=False)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(1000, 49000, (64, 256), generator=g).tolist()
    llm.generate(prompts[:16], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    time.sleep(3)  # the background thread's copies
    started = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    rate = 64 * 256 / (time.perf_counter() - started)
    del llm
    gc.collect()
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--calls", type=int, default=15)
    parser.add_argument("--settings", nargs="+", default=["fp16", "prompt-bf16", "bf16"])
    parser.add_argument("--skip-layers", action="store_true")
    args = parser.parse_args()
    if not amx_kernel_loads():
        raise SystemExit("this CPU has no AMX (or the kernel did not build): nothing to compare")
    flags = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16") if f in cpu_flags()]
    print(f"{platform.machine()}, torch {torch.__version__}, CPU flags: {', '.join(flags)}, "
          f"{torch.get_num_threads()} threads\n")
    if not args.skip_layers:
        layer_table(args.calls)
    rates: dict[str, list[float]] = {s: [] for s in args.settings}
    for r in range(args.rounds):
        for setting in args.settings:
            rates[setting].append(prefill_rate(setting))
            print(f"round {r} {setting}: {rates[setting][-1]:.0f} prompt tokens/s", flush=True)
    print("\n| --batched-weights | prefill tokens/s, per round | median |")
    print("|---|---|---|")
    for setting, values in rates.items():
        print(f"| {setting} | {', '.join(f'{v:.0f}' for v in values)} | {statistics.median(values):.0f} |")


if __name__ == "__main__":
    main()
