"""The 8-concurrent workload of `gguf_peers.py` offline, step by step: where its time goes (prefill or decode).

Requests of random prompt tokens, EOS ignored, `--concurrency` at a time; equal lengths make them arrive in bursts
(8 prompts of 256 tokens in one step), as they do against a server. Prints the total, the steps that took more than
twice the median (the prompts' steps) and the rest (decode steps of the running batch).

    .venv/bin/python benchmarks/burst_steps.py MODEL.gguf [--requests 16] [--batched-weights prompt-int8] [--block-activations int8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lmserve import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--batched-weights", default=None)
    parser.add_argument("--block-activations", default=None)
    args = parser.parse_args()
    extra = {"batched_weights": args.batched_weights} if args.batched_weights else {}
    if args.block_activations:
        extra["block_activations"] = args.block_activations
    llm = LLM(args.model, max_num_seqs=args.concurrency, enable_prefix_caching=False, max_model_len=4096, **extra)
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(1000, 20000, (args.requests, args.prompt_len), generator=generator).tolist()
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
    started, times, added, finished = time.perf_counter(), [], 0, 0
    for prompt in prompts[: args.concurrency]:
        llm._add(prompt, params, 0)
        added += 1
    while finished < args.requests:
        step_started = time.perf_counter()
        deltas = llm._step()
        times.append(time.perf_counter() - step_started)
        for delta in deltas:
            if delta.finished:
                finished += 1
                if added < args.requests:
                    llm._add(prompts[added], params, 0)
                    added += 1
    total = time.perf_counter() - started
    median = statistics.median(times)
    prompt_steps = [t for t in times if t > 2 * median]
    print(f"total {total:.1f} s, {len(times)} steps; {len(prompt_steps)} prompt steps {sum(prompt_steps):.1f} s; "
          f"the rest {sum(times) - sum(prompt_steps):.1f} s (median step {median * 1e3:.1f} ms)")
    llm.shutdown()


if __name__ == "__main__":
    main()
