"""A real GGUF at its stored size against the float16 copies it ran as before (issue 34): ready, memory, speed, accuracy.

Settings, each in a fresh process (so that ready time and resident memory are the process's own):
- `fp16`: `--quantization fp16`, every matrix dequantized and kept in float16: what a Q4_K_M file ran as before
  lmserve read its stored types (worker/stored_formats.py, worker/kquant_formats.py);
- `stored`: `--quantization auto`: each layer in the kernel format that holds the file's values exactly (Q5_0 and
  Q4_0 as q8_0 / q4_1 blocks, Q5_0, Q5_1 and the K-quants at their stored size where the int16 kernels run), the embedding looked
  up in the file's blocks, prompt rows on the copies of `--batched-weights auto`;
- `stored, no copies`: the same with `--batched-weights none`: every row on the block kernels, no copy of any weight;
- `float32`: `--quantization none`, the reference for perplexity (the file's values in float32).

Measured: time to ready (the LLM built, in process), resident memory at ready and once the background copies are
built, the prefill of a 512-token prompt (median of 3), time per output token of one stream (64 tokens after a short
prompt, `ignore_eos`), output tokens per second of 8 concurrent requests (256 random-word prompt tokens, 64 out),
and the perplexity of the shipped prose (lmserve/bench/data/passages.txt, first 1,024 tokens) from prompt logprobs.

    .venv/bin/python benchmarks/stored_size.py MODEL.gguf [--settings fp16 stored "stored, no copies" float32]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import threading
import time
from importlib import resources

SETTINGS = {
    "fp16": {"quantization": "fp16"},
    "stored": {},
    "stored, no copies": {"batched_weights": "none"},
    "float32": {"quantization": "none"},
}


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        return int(status.read().split("VmRSS:")[1].split()[0]) / 1024


def measure(model: str, setting: str, max_model_len: int) -> dict:
    started = time.perf_counter()
    from lmserve import LLM, SamplingParams

    llm = LLM(model=model, max_model_len=max_model_len, **SETTINGS[setting])
    result = {"setting": setting, "ready_s": time.perf_counter() - started, "rss_ready_mib": rss_mib()}
    for thread in threading.enumerate():
        if thread.name == "batched-copies":
            thread.join()
    result["rss_copies_mib"] = rss_mib()
    words = [f"word{i}" for i in range(2000)]
    first = SamplingParams(temperature=0, max_tokens=1)
    llm.generate([" ".join(words[:400])], first)  # warm-up
    prefill = []
    for i in range(3):
        t = time.perf_counter()
        llm.generate([" ".join(words[i * 7 : i * 7 + 400])], first)
        prefill.append(time.perf_counter() - t)
    result["prefill_s"] = statistics.median(prefill)
    decode = SamplingParams(temperature=0, max_tokens=65, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=1)
    t = time.perf_counter()
    llm.generate(["Write a story about a cat."], short)
    one = time.perf_counter() - t
    t = time.perf_counter()
    llm.generate(["Write a story about a cat."], decode)
    result["tpot_ms"] = (time.perf_counter() - t - one) / 64 * 1000
    batch = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    prompts = [" ".join(words[i * 150 : i * 150 + 190]) for i in range(8)]
    t = time.perf_counter()
    outs = llm.generate(prompts, [batch] * 8)
    result["tok_s_8"] = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)
    text = resources.files("lmserve.bench").joinpath("data/passages.txt").read_text()
    score = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    ids = llm.tokenizer.encode(text)[:1024]
    out = llm.generate([ids], score)[0]
    logprobs = [e.logprob for e in out.prompt_logprobs if e is not None]
    result["perplexity"] = math.exp(-sum(logprobs) / len(logprobs))
    result["scored_tokens"] = len(logprobs)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.model, args.child, args.max_model_len)))
        return
    rows = []
    for setting in args.settings:
        command = [sys.executable, __file__, args.model, "--child", setting, "--max-model-len", str(args.max_model_len)]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n{'setting':<20}{'ready s':>9}{'RSS ready':>11}{'RSS +copies':>13}{'prefill 512':>13}{'TPOT ms':>9}"
          f"{'8x tok/s':>10}{'perplexity':>12}")
    for r in rows:
        print(f"{r['setting']:<20}{r['ready_s']:>9.2f}{r['rss_ready_mib']:>11.0f}{r['rss_copies_mib']:>13.0f}"
              f"{r['prefill_s']:>13.3f}{r['tpot_ms']:>9.1f}{r['tok_s_8']:>10.1f}{r['perplexity']:>12.4f}")


if __name__ == "__main__":
    main()
