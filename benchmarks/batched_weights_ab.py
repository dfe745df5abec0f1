"""Two `--batched-weights` settings side by side on the default model, offline, one engine at a time in turns.

Made to price `prompt-fp16` (auto where the CPU has no AMX: prompt rows always on fbgemm's float16 copy, generated
rows always on the block kernel) against `fp16` (the block kernel up to 64 rows, the float16 copy above, for every
row). Three cases per round and setting:
- W1-like: 32 prompts of 256 random tokens, 64 output tokens each, 16 sequences at a time: output tokens/s (steps mix
  decodes with prompt chunks);
- a short prompt alone: 24 tokens, one output token: the median prefill time of 10 (a prompt of few rows is where
  the two differ most: the block kernel against fbgemm);
- one stream: a 128-token prompt, 128 output tokens: decode tokens/s.

`LMSERVE_KERNEL_MARCH=haswell` runs lmserve's kernels as an AVX2 machine builds them (torch's own stay native).

    .venv/bin/python benchmarks/batched_weights_ab.py [--settings fp16 prompt-fp16] [--rounds 2]
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import time

import torch

from lmserve import LLM, SamplingParams
from lmserve.worker.kernels import kernel_march


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    return torch.randint(1000, 40000, (count, length), generator=torch.Generator().manual_seed(seed)).tolist()


def measure(setting: str) -> dict[str, float]:
    llm = LLM(batched_weights=setting, max_num_seqs=16, enable_prefix_caching=False)
    llm.generate(prompts(4, 64, 9), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
    results = {}
    started = time.perf_counter()
    outs = llm.generate(prompts(32, 256, 1), SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    results["W1-like output tok/s"] = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - started)
    times = []
    for i in range(10):
        started = time.perf_counter()
        llm.generate(prompts(1, 24, 100 + i), SamplingParams(max_tokens=1, temperature=0.0))
        times.append(time.perf_counter() - started)
    results["24-token prompt alone, ms"] = statistics.median(times) * 1e3
    llm.generate(prompts(1, 128, 2), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    started = time.perf_counter()
    out = llm.generate(prompts(1, 128, 3), SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True))[0]
    results["one stream, tok/s"] = len(out.outputs[0].token_ids) / (time.perf_counter() - started)
    del llm
    gc.collect()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", nargs="+", default=["fp16", "prompt-fp16"])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    rounds: dict[str, list[dict[str, float]]] = {s: [] for s in args.settings}
    for r in range(args.rounds):
        for setting in args.settings if r % 2 == 0 else reversed(args.settings):
            rounds[setting].append(measure(setting))
            print(setting, rounds[setting][-1], flush=True)
    print(f"\n{platform.processor() or platform.machine()}, kernels -march={kernel_march()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, medians of {args.rounds} rounds\n")
    cases = list(rounds[args.settings[0]][0])
    print("| case | " + " | ".join(args.settings) + " |\n|---|" + "---|" * len(args.settings))
    for case in cases:
        values = [statistics.median(run[case] for run in rounds[s]) for s in args.settings]
        print(f"| {case} | " + " | ".join(f"{v:.1f}" for v in values) + " |")


if __name__ == "__main__":
    main()
