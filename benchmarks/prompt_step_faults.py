"""A burst's prompt step, offline, three times in one engine: its wall time, the engine's RSS after it and the
process's minor page faults so far (large blocks mapped afresh fault in every step; reused ones do not).

    .venv/bin/python benchmarks/prompt_step_faults.py MODEL.gguf [--prompts 8] [--prompt-len 256]
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

from lmserve import LLM, SamplingParams


def rss_mib() -> float:
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    args = parser.parse_args()
    llm = LLM(args.model, max_num_seqs=args.prompts, enable_prefix_caching=False, max_model_len=2048)
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    print(f"ready: RSS {rss_mib():.0f} MiB")
    for _ in range(3):
        for _ in range(args.prompts):
            llm._add(torch.randint(1000, 20000, (args.prompt_len,), generator=generator).tolist(), params, 0)
        started = time.perf_counter()
        llm._step()
        took = time.perf_counter() - started
        while llm._step():
            pass
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        print(f"prompt step {took:.2f} s, RSS {rss_mib():.0f} MiB, minor faults so far {faults}", flush=True)
    llm.shutdown()


if __name__ == "__main__":
    main()
