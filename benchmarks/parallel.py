"""What splitting the default model across ranks costs on this machine, and whether the planner's communication
bytes match what the ranks send (issue 19).

Offline part, one layout at a time (`LLM(...)`, greedy, 16 prompts of 256 random tokens, 64 output tokens each):
median decode-step time, wall time, and the bytes each rank handed to torch.distributed (all-reduce, all-gather,
pipeline sends) beside the planner's prediction (lmserve.plan.comm) for the positions the run computed.
Served part (`--served`): W1 (256 in / 128 out, 64 requests, 16 concurrent; `lmserve bench`) against `lmserve serve`
with -dp 1 and -dp 2.

    .venv/bin/python benchmarks/parallel.py [--layouts tp1,tp3,pp2] [--served]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from timing import start_lmserve

from lmserve import LLM, SamplingParams
from lmserve.config import DEFAULT_MODEL
from lmserve.plan.comm import comm_per_token
from lmserve.plan.model_spec import Layout, load_spec

LAYOUTS = {"tp1": {}, "tp3": {"tensor_parallel_size": 3}, "pp2": {"pipeline_parallel_size": 2},
           "pp3": {"pipeline_parallel_size": 3}}
PROMPTS, PROMPT_LEN, OUTPUT_LEN = 16, 256, 64
W1 = ["--random-input-len", "256", "--random-output-len", "128", "--num-prompts", "64", "--max-concurrency", "16"]


def offline(name: str) -> dict:
    layout = LAYOUTS[name]
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 40000) for _ in range(PROMPT_LEN)] for _ in range(PROMPTS)]
    params = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0, ignore_eos=True)
    with LLM(DEFAULT_MODEL, max_model_len=512, kv_cache_memory="256MiB", **layout) as llm:
        # Warm-up on other prompts: a prefix-cache hit would skip positions the prediction counts.
        llm.generate([[7] * PROMPT_LEN, [8] * PROMPT_LEN], SamplingParams(max_tokens=4, ignore_eos=True))
        before = llm.engine.executor.communication_stats()
        step, decode_steps = llm.engine.step, []

        def timed_step(*args, **kwargs):
            started = time.perf_counter()
            outputs = step(*args, **kwargs)
            record = llm.engine.last_step
            if record is not None and not record.prefill and record.decode:
                decode_steps.append(time.perf_counter() - started)
            return outputs

        llm.engine.step = timed_step
        started = time.perf_counter()
        llm.generate(prompts, params)
        wall = time.perf_counter() - started
        after = llm.engine.executor.communication_stats()
    sent = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before, strict=True)]
    spec = load_spec(DEFAULT_MODEL, None)
    tp, pp = layout.get("tensor_parallel_size", 1), layout.get("pipeline_parallel_size", 1)
    comm = comm_per_token(spec, Layout(tp, pp, 1), "float32")
    positions = PROMPTS * (PROMPT_LEN + OUTPUT_LEN - 1)  # the last sampled token is never fed back
    sampled = PROMPTS * OUTPUT_LEN
    predicted = {
        "all_reduce_bytes (rank 0)": positions * comm.tp_all_reduce[0],
        "all_gather_bytes (last stage)": sampled * comm.tp_all_gather,
        "send_bytes (stage 0)": positions * comm.pp_send,
    }
    measured = {
        "all_reduce_bytes (rank 0)": sent[0]["all_reduce_bytes"],
        "all_gather_bytes (last stage)": sent[-1]["all_gather_bytes"],
        "send_bytes (stage 0)": sent[0]["send_bytes"],
    }
    return {
        "layout": name, "wall_s": round(wall, 2), "output_tok_s": round(sampled / wall, 1),
        "decode_step_ms_median": round(statistics.median(decode_steps) * 1e3, 2) if decode_steps else None,
        # A decode step of the 16 sequences: one position each.
        "all_reduce_bytes_per_decode_step (rank 0, planner)": PROMPTS * comm.tp_all_reduce[0],
        "collective_calls (rank 0)": sent[0]["calls"],
        "predicted": predicted, "measured": measured,
    }


def served(dp: int, tmp: Path) -> float:
    process, url = start_lmserve("--max-model-len", "1024", "-dp", str(dp))
    try:
        result = tmp / f"dp{dp}.json"
        subprocess.run([sys.executable, "-m", "lmserve.bench", "--base-url", url, "--ignore-eos", "--temperature", "0",
                        "--disable-tqdm", "--seed", "0", "--output", str(result), *W1], check=True, capture_output=True)
        return json.loads(result.read_text())["output_throughput"]
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", default="tp1,tp3,pp2")
    parser.add_argument("--served", action="store_true", help="also W1 served with -dp 1 and -dp 2")
    args = parser.parse_args()
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("flags")), [])
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"avx512_bf16={'avx512_bf16' in flags}, amx={'amx_bf16' in flags}")
    for name in args.layouts.split(","):
        print(json.dumps(offline(name)), flush=True)
    if args.served:
        with tempfile.TemporaryDirectory() as tmp:
            for dp in (1, 2):
                print(json.dumps({"served": f"dp{dp}", "W1_output_tok_s": round(served(dp, Path(tmp)), 1)}),
                      flush=True)


if __name__ == "__main__":
    main()
