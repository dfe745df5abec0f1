"""One stream's decode step, offline: the median of 300 steps after a 128-token prompt and 10 warm-up steps. For A/B
runs of two trees, run it alternately from each (PYTHONPATH=WORKTREE/src, and LMSERVE_CACHE=another folder so that
the two trees' kernels do not rebuild each other's).

    .venv/bin/python benchmarks/decode_step.py MODEL [--label NAME] [--steps 300]
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
    parser.add_argument("--label", default="")
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    llm = LLM(args.model, max_num_seqs=8, enable_prefix_caching=False, max_model_len=4096)
    prompt = torch.randint(1000, 20000, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    llm._add(prompt, SamplingParams(max_tokens=args.steps + 100, temperature=0, ignore_eos=True), 0)
    for _ in range(10):
        llm._step()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        llm._step()
        times.append((time.perf_counter() - start) * 1e3)
    times.sort()
    print(f"{args.label} median {statistics.median(times):.3f} ms, p10 {times[len(times) // 10]:.3f} ms")


if __name__ == "__main__":
    main()
