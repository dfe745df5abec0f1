"""A flood against one lmserve server: how fast the requests it cannot take now are told so.

    .venv/bin/python benchmarks/overload.py [--requests 200] [--max-queued 0,16]

For each --max-queued value (0: no limit), starts `lmserve serve` on the default model, sends --requests streaming
completions at once (short random prompts, --output-tokens each, ignore EOS), and reports for the accepted ones the
time to first token (p50, p90) and for the refused ones (HTTP 429) the time to the answer. Nothing else runs during
a measurement: start it on a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "api"))
from server_process import start_server


async def one(client: httpx.AsyncClient, body: dict) -> tuple[int, float, float]:
    """(status, seconds to the first chunk or the refusal, seconds to the end)."""
    started = time.perf_counter()
    first = None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: "):
                first = time.perf_counter() - started
        status = response.status_code
    end = time.perf_counter() - started
    return status, first if first is not None else end, end


async def flood(base_url: str, num_requests: int, output_tokens: int) -> list[tuple[int, float, float]]:
    rng = random.Random(0)
    words = ["the", "a", "river", "stone", "light", "over", "under", "quiet", "city", "morning", "paper", "window"]
    bodies = [
        {"prompt": " ".join(rng.choice(words) for _ in range(48)), "max_tokens": output_tokens, "stream": True,
         "ignore_eos": True, "temperature": 0}
        for _ in range(num_requests)
    ]
    limits = httpx.Limits(max_connections=num_requests, max_keepalive_connections=num_requests)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        return await asyncio.gather(*(one(client, b) for b in bodies))


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else (values[0] if values else float("nan"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--max-queued", default="0,16")
    args = parser.parse_args()
    print(f"# {platform.processor() or platform.machine()}, python {platform.python_version()}, "
          f"{args.requests} concurrent streaming requests, {args.output_tokens} output tokens each")
    print("| --max-queued-requests | served | refused (429) | served TTFT p50 / p90 (s) | refusal p50 / max (s) "
          "| wall (s) |")
    print("|---|---|---|---|---|---|")
    for limit in (int(v) for v in args.max_queued.split(",")):
        extra = ["--max-queued-requests", str(limit)] if limit else []
        server = start_server(Path("/tmp"), "--max-model-len", "512", *extra)
        try:
            started = time.perf_counter()
            results = asyncio.run(flood(server.base_url, args.requests, args.output_tokens))
            wall = time.perf_counter() - started
        finally:
            server.stop()
        served = [r for r in results if r[0] == 200]
        refused = [r for r in results if r[0] == 429]
        other = len(results) - len(served) - len(refused)
        ttft = [r[1] for r in served]
        refusal = [r[1] for r in refused]
        print(f"| {limit or 'none'} | {len(served)} | {len(refused)}{f' (+{other} other)' if other else ''} | "
              f"{pct(ttft, 50):.2f} / {pct(ttft, 90):.2f} | "
              f"{(pct(refusal, 50) if refusal else float('nan')):.3f} / {(max(refusal) if refusal else 0):.3f} | "
              f"{wall:.1f} |")


if __name__ == "__main__":
    main()
