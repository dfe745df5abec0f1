"""One stream, served against offline, for each sampling setting, on the default model (issue 22's targets: served
single stream >= 0.9x offline; every sampling setting within 10% of greedy's decode rate).

One `lmserve serve` (defaults; --serve-args adds flags) and one offline `LLM` of the same configuration live side by
side; only one of them runs at a time. For each round and each setting, the offline engine decodes `--requests`
requests of a 128-token prompt one after another, then `lmserve bench` sends the server as many (random 128-token
prompts, one at a time). Both report 1/TPOT: tokens after the first over the time after the first. The table gives
medians over the rounds and the two ratios, and the offline engine's sampler time per step (the model runner's
`_sample`, timed around the call): what a setting adds to a step, which this VM's drift of whole rates (±15% between
minutes) cannot hide.

    .venv/bin/python benchmarks/single_stream.py [--rounds 2] [--output-len 256] [--settings greedy,top_p]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
from serve_ab import REPO, bench, free_port, serve

from lmserve import LLM, SamplingParams
from lmserve.worker.kernels import cpu_flags

# name: (SamplingParams keywords, the same as lmserve bench flags)
SETTINGS: dict[str, tuple[dict, list[str]]] = {
    "greedy": ({"temperature": 0.0}, ["--temperature", "0"]),
    "temperature 1": ({"temperature": 1.0}, ["--temperature", "1"]),
    "top_p 0.95": ({"temperature": 1.0, "top_p": 0.95}, ["--temperature", "1", "--top-p", "0.95"]),
    "top_k 40": ({"temperature": 1.0, "top_k": 40}, ["--temperature", "1", "--top-k", "40"]),
    "min_p 0.05": ({"temperature": 1.0, "min_p": 0.05}, ["--temperature", "1", "--min-p", "0.05"]),
    "penalties": ({"temperature": 1.0, "repetition_penalty": 1.1, "frequency_penalty": 0.3, "presence_penalty": 0.3},
                  ["--temperature", "1", "--repetition-penalty", "1.1", "--frequency-penalty", "0.3",
                   "--presence-penalty", "0.3"]),
    "seed": ({"temperature": 1.0, "seed": 1}, ["--temperature", "1", "--extra-body", json.dumps({"seed": 1})]),
}
PROMPT_LEN = 128


def offline_rate(llm: LLM, params: dict, output_len: int, requests: int) -> float:
    """Median 1/TPOT (tokens/s) of `requests` one-at-a-time requests."""
    gen = torch.Generator().manual_seed(0)
    rates = []
    for _ in range(requests):
        prompt = torch.randint(100, 10000, (PROMPT_LEN,), generator=gen).tolist()
        sampling = SamplingParams(max_tokens=output_len, ignore_eos=True, **params)
        first = None
        count = 0
        for delta in llm.stream(prompt, sampling):
            for out in delta.outputs:
                if out.token_ids and first is None:
                    first = time.perf_counter()
                count += len(out.token_ids)
        rates.append((count - 1) / (time.perf_counter() - first))
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated of: {', '.join(SETTINGS)}")
    parser.add_argument("--serve-args", default="", help="extra lmserve serve flags")
    args = parser.parse_args()
    settings = [s.strip() for s in args.settings.split(",")]
    workload = ["--random-input-len", str(PROMPT_LEN), "--random-output-len", str(args.output_len),
                "--num-prompts", str(args.requests), "--max-concurrency", "1"]
    offline: dict[str, list[float]] = {s: [] for s in settings}
    served: dict[str, list[float]] = {s: [] for s in settings}
    llm = LLM(max_model_len=1024)
    sampler_s: dict[str, list[float]] = {s: [] for s in settings}
    current = [settings[0]]
    runner = llm.engine.executor.worker.runner
    sample = runner.rejection_sampler.sample

    def timed_sample(*args, **kwargs):
        started = time.perf_counter()
        out = sample(*args, **kwargs)
        sampler_s[current[0]].append(time.perf_counter() - started)
        return out

    runner.rejection_sampler.sample = timed_sample
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        port = free_port()
        server = serve(REPO / "src", port, tmp / "server.log", args.serve_args.split())
        try:
            offline_rate(llm, {}, 16, 1)  # warm-up of both
            sampler_s[settings[0]].clear()
            bench(port, "W4", tmp / "warmup.json", ["--num-prompts", "1", "--random-output-len", "16"])
            for round_index in range(args.rounds):
                for setting in settings:
                    params, flags = SETTINGS[setting]
                    current[0] = setting
                    offline[setting].append(offline_rate(llm, params, args.output_len, args.requests))
                    result = bench(port, "W4", tmp / f"{round_index}-{setting}.json", [*flags, *workload])
                    served[setting].append(1000.0 / result["median_tpot_ms"])
                    print(f"round {round_index} {setting}: offline {offline[setting][-1]:.1f}, "
                          f"served {served[setting][-1]:.1f} tok/s", flush=True)
        finally:
            server.terminate()
            server.wait(30)
    flags = ", ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in cpu_flags())
    print(f"\n{platform.processor() or platform.machine()} ({flags}), torch {torch.__version__}, python "
          f"{platform.python_version()}; {args.rounds} rounds x {args.requests} requests of {PROMPT_LEN} + "
          f"{args.output_len} tokens; serve args {args.serve_args!r}; 1/TPOT tok/s, medians")
    print("| setting | offline | served | served / offline | served / served greedy | sampler ms per step (offline) |")
    print("|---|---|---|---|---|---|")
    greedy = statistics.median(served["greedy"]) if "greedy" in served else None
    for setting in settings:
        off, on = statistics.median(offline[setting]), statistics.median(served[setting])
        vs_greedy = f"{on / greedy:.2f}" if greedy else "-"
        sampler_ms = statistics.median(sampler_s[setting]) * 1e3
        print(f"| {setting} | {off:.1f} | {on:.1f} | {on / off:.2f} | {vs_greedy} | {sampler_ms:.2f} |")


if __name__ == "__main__":
    main()
