"""A served model's answer time alone and beside another OpenMP program, with libgomp's own spin count at barriers
(300,000, what the engine runs with) and with a shorter one (GOMP_SPINCOUNT in the server's environment reaches its
engine process).

For each setting, in turns over --rounds: `lmserve serve` on the default model, 5 greedy 24-token completions alone,
then 5 beside a neighbour (a Python process doing torch matmuls on all cores in a loop, at libgomp's default
spin count), medians. One server at a time; nothing else should run.

    .venv/bin/python benchmarks/openmp_neighbour.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time

import openai
from timing import start_lmserve

NEIGHBOUR = """
import torch
a = torch.randn(256, 256)
while True:
    for _ in range(100):
        a = torch.tanh(a @ a * 0.01)
"""
SETTINGS = {"GOMP_SPINCOUNT=10000": {"GOMP_SPINCOUNT": "10000"}, "libgomp's default": {}}


def answer_times(server_env: dict[str, str]) -> tuple[float, float]:
    server, url = start_lmserve("--kv-cache-memory", "64MiB", "--max-model-len", "1024",
                                env={**os.environ, **server_env}, poll_s=0.2)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)

        def ask() -> float:
            start = time.perf_counter()
            client.completions.create(model="smollm2-135m-instruct", prompt="The weather in Paris is", max_tokens=24,
                                      temperature=0, extra_body={"ignore_eos": True})
            return time.perf_counter() - start

        ask()  # warm-up
        alone = statistics.median(ask() for _ in range(5))
        neighbour_env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
        neighbour = subprocess.Popen([sys.executable, "-c", NEIGHBOUR], env=neighbour_env)
        try:
            time.sleep(3)
            beside = statistics.median(ask() for _ in range(5))
        finally:
            neighbour.kill()
            neighbour.wait()
        return alone, beside
    finally:
        os.killpg(server.pid, signal.SIGINT)
        server.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in SETTINGS}
    for _ in range(args.rounds):
        for name, env in SETTINGS.items():
            results[name].append(answer_times(env))
            alone, beside = results[name][-1]
            print(f"{name}: alone {alone:.3f} s, beside the neighbour {beside:.3f} s", flush=True)
    for name, runs in results.items():
        alone = statistics.median(r[0] for r in runs)
        beside = statistics.median(r[1] for r in runs)
        print(f"median {name}: alone {alone:.3f} s, beside {beside:.3f} s ({beside / alone:.1f}x)")


if __name__ == "__main__":
    main()
