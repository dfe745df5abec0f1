"""One prompt's prefill step through the offline `LLM` on one engine thread, timed `repeats` times after a warm-up
(wall and process CPU time; the engine runs in this process). Run it twice, alternated, to compare settings, e.g.
issue 70's activation scales:

    LMSERVE_DISABLE_CPU_FEATURES=q8k .venv/bin/python benchmarks/one_prefill.py MODEL.gguf --tokens 512 --repeats 3
    .venv/bin/python benchmarks/one_prefill.py MODEL.gguf --tokens 512 --repeats 3
"""

from __future__ import annotations

import argparse
import time

from lmserve import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    llm = LLM(model=args.model, max_model_len=2 * args.tokens, engine_threads=1, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=1)
    for r in range(args.repeats + 1):
        prompt = [(1000 + 37 * i + r) % 30000 for i in range(args.tokens)]  # a new prompt each time
        cpu, wall = time.process_time(), time.perf_counter()
        llm.generate([prompt], params)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        if r:  # the first is a warm-up
            print(f"prefill {args.tokens}: cpu {cpu:.2f} s, wall {wall:.2f} s", flush=True)


if __name__ == "__main__":
    main()
