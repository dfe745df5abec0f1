"""Structured output's costs (issue 20), on the default model; results in docs/benchmarks.md.

1. Grammar compile time per JSON schema against the model's vocabulary: cold (a fresh compiler) and cached.
2. Served TPOT of 16 concurrent JSON-schema streams (16 different schemas, already compiled) against 16 unconstrained
   streams of about the same length, side by side on one server, alternating, medians over rounds.
3. Whether a slow compile stalls other streams: the max inter-token gap of 4 running unconstrained streams while 8
   requests with 8 new schemas arrive, against the same 4 streams alone.

    .venv/bin/python benchmarks/structured_output.py [--rounds 3]

`--serve-args "--distributed-executor-backend mp" --tpot-only`: part 2 alone, with ranks in their own processes
(where the engine sends each constrained step's grammar masks after the step).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shlex
import signal
import statistics
import sys
import time

import httpx
from timing import start_lmserve

MODEL = "smollm2-135m-instruct"


def schema(i: int, items: int = 10) -> dict:
    """Schema number i: distinct property names (so a distinct grammar), about 60-90 tokens of output."""
    return {"type": "object", "properties": {
        f"city_{i}": {"type": "string", "maxLength": 16},
        f"facts_{i}": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": items,
                       "maxItems": items},
        f"year_{i}": {"type": "integer", "minimum": 1000, "maximum": 2100}},
        "required": [f"city_{i}", f"facts_{i}", f"year_{i}"], "additionalProperties": False}


def compile_times() -> tuple[list[float], list[float]]:
    import xgrammar as xgr

    from lmserve.model_tokenizer import load_tokenizer
    from lmserve.models import resolve_model

    info = xgr.TokenizerInfo.from_huggingface(load_tokenizer(resolve_model(MODEL)), vocab_size=49152)
    cold, cached = [], []
    for i in range(10):
        compiler = xgr.GrammarCompiler(info, max_threads=1)
        text = json.dumps(schema(100 + i))
        for times in (cold, cached):
            started = time.perf_counter()
            compiler.compile_json_schema(text, any_whitespace=False)
            times.append(time.perf_counter() - started)
    return cold, cached


async def stream(client: httpx.AsyncClient, url: str, body: dict) -> list[float]:
    """Arrival times of the stream's chunks that carry text."""
    times = []
    async with client.stream("POST", f"{url}/v1/completions", json={"model": MODEL, "stream": True, **body}) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                times.append(time.perf_counter())
    return times


def tpot(times: list[float]) -> float:
    return (times[-1] - times[0]) / (len(times) - 1)


async def tpot_round(client: httpx.AsyncClient, url: str, constrained: bool) -> list[float]:
    bodies = []
    for i in range(16):
        body = {"prompt": f"Facts about city number {i}, as JSON:", "temperature": 0, "max_tokens": 300}
        if constrained:
            body["structured_outputs"] = {"json": schema(i)}
        else:
            body.update(max_tokens=75, ignore_eos=True)  # about the constrained answers' length
        bodies.append(body)
    results = await asyncio.gather(*(stream(client, url, b) for b in bodies))
    return [tpot(t) for t in results]


async def max_gap(client: httpx.AsyncClient, url: str, with_compiles: bool, base: int) -> float:
    long = {"prompt": "Write a long story about the sea.", "max_tokens": 200, "ignore_eos": True, "temperature": 0}
    runners = [asyncio.create_task(stream(client, url, long)) for _ in range(4)]
    await asyncio.sleep(1.5)
    if with_compiles:  # eight schemas never seen before
        await asyncio.gather(*(stream(client, url, {"prompt": "JSON:", "max_tokens": 300, "temperature": 0,
                                                     "structured_outputs": {"json": schema(base + k, 2)}})
                               for k in range(8)))
    results = await asyncio.gather(*runners)
    return max(max(b - a for a, b in itertools.pairwise(t)) for t in results)


async def served(rounds: int, serve_args: list[str], tpot_only: bool) -> dict:
    process, url = start_lmserve("--max-model-len", "1024", *serve_args)
    try:
        async with httpx.AsyncClient(timeout=600) as client:
            await tpot_round(client, url, constrained=True)  # compile the 16 schemas; warm up
            plain, constrained = [], []
            for _ in range(rounds):
                plain += await tpot_round(client, url, constrained=False)
                constrained += await tpot_round(client, url, constrained=True)
            alone, compiling = [], []
            for r in range(0 if tpot_only else rounds):
                alone.append(await max_gap(client, url, False, 0))
                compiling.append(await max_gap(client, url, True, 1000 + 10 * r))
        return {"plain": plain, "constrained": constrained, "alone": alone, "compiling": compiling}
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--serve-args", default="", help="more `lmserve serve` flags, one string")
    parser.add_argument("--tpot-only", action="store_true", help="only part 2 (the served TPOT)")
    args = parser.parse_args()
    if not args.tpot_only:
        cold, cached = compile_times()
        print(f"compile per schema: cold median {statistics.median(cold) * 1e3:.0f} ms (max "
              f"{max(cold) * 1e3:.0f}), cached median {statistics.median(cached) * 1e6:.0f} us")
    r = asyncio.run(served(args.rounds, shlex.split(args.serve_args), args.tpot_only))
    plain, constrained = statistics.median(r["plain"]), statistics.median(r["constrained"])
    print(f"TPOT median, 16 streams: unconstrained {plain * 1e3:.1f} ms, JSON schema {constrained * 1e3:.1f} ms "
          f"({constrained / plain:.2f}x)")
    if args.tpot_only:
        return 0
    print(f"max ITL of 4 running streams: alone {[round(x * 1e3) for x in r['alone']]} ms, while 8 new schemas "
          f"compile {[round(x * 1e3) for x in r['compiling']]} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
