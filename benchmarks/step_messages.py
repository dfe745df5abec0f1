"""What one decode step's plan costs to send to ranks in other processes: the whole SchedulerOutput pickled (before)
against the per-step changes of executor/step_messages.py (now). No model runs: the plan of --requests decoding
requests of --context positions each (a fifth of them output), as the scheduler builds it.

    .venv/bin/python benchmarks/step_messages.py [--requests 256] [--context 2500] [--steps 50]
"""

from __future__ import annotations

import argparse
import pickle
import random
import statistics
import time

from lmserve.config import KV_BLOCK_SIZE
from lmserve.executor.step_messages import StepDecoder, StepEncoder
from lmserve.sampling_params import SamplingParams
from lmserve.step import ScheduledRequest, SchedulerOutput

BLOCK_SIZE = KV_BLOCK_SIZE


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--context", type=int, default=2500)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    rng = random.Random(0)
    output_len = args.context // 5
    prompts = [[rng.randrange(150_000) for _ in range(args.context - output_len)] for _ in range(args.requests)]
    outputs = [[rng.randrange(150_000) for _ in range(output_len)] for _ in range(args.requests)]
    params = SamplingParams(temperature=0.7, top_p=0.9)
    blocks = [list(range(i * 1000, i * 1000 + -(-args.context // BLOCK_SIZE))) for i in range(args.requests)]

    def plan() -> SchedulerOutput:
        return SchedulerOutput(scheduled=[
            ScheduledRequest(f"r{i}", [outputs[i][-1]], len(prompts[i]) + len(outputs[i]) - 1, list(blocks[i]), True,
                             params, prompts[i], outputs[i])
            for i in range(args.requests)
        ], num_batched_tokens=args.requests)

    encoder, decoder = StepEncoder(), StepDecoder()
    decoder.decode(pickle.loads(pickle.dumps(encoder.encode(plan()))))  # the first step sends everything
    whole_bytes, whole_s, delta_bytes, send_s, receive_s = [], [], [], [], []
    for step in range(args.steps):
        for i in range(args.requests):
            outputs[i].append(rng.randrange(150_000))
            if (len(prompts[i]) + len(outputs[i])) % BLOCK_SIZE == 1:
                blocks[i].append(500_000 + step * args.requests + i)
        scheduler_output = plan()
        started = time.perf_counter()
        whole = pickle.dumps(scheduler_output, protocol=pickle.HIGHEST_PROTOCOL)
        pickle.loads(whole)
        whole_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        data = pickle.dumps(encoder.encode(scheduler_output), protocol=pickle.HIGHEST_PROTOCOL)
        send_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        decoder.decode(pickle.loads(data))
        receive_s.append(time.perf_counter() - started)
        whole_bytes.append(len(whole))
        delta_bytes.append(len(data))
    ms = lambda xs: f"{statistics.median(xs) * 1e3:.2f} ms"
    print(f"{args.requests} decoding requests of {args.context} positions, medians of {args.steps} steps")
    print(f"whole plan:   {statistics.median(whole_bytes):>12,.0f} bytes, pickle + unpickle {ms(whole_s)}")
    print(f"step changes: {statistics.median(delta_bytes):>12,.0f} bytes, encode + pickle {ms(send_s)}, "
          f"unpickle + decode {ms(receive_s)}")


if __name__ == "__main__":
    main()
