"""Prefill/decode disaggregation against its alternatives on the same cores: streams decode while long prompts arrive.

    .venv/bin/python benchmarks/disaggregation.py [--model M] [--streams 4] [--long 6] [--long-words 280]

Deployments of one model, one at a time, on this machine's CPUs:
  one:     one instance, chunked prefill (its default), every CPU;
  dp2:     `serve -dp 2`, each replica half of the CPUs, prompts routed by the front-end;
  pd:      a kv_producer instance on the first half of the CPUs, a kv_consumer on the second, `lmserve router` in
           front, the KV through /dev/shm (SharedStorageConnector);
  pd-link: the same pair, the KV over torch.distributed between them (PyNcclConnector: gloo on CPU).
Workload: --streams chat streams (short prompts, --stream-tokens each, ignore EOS) start together; once they decode,
--long requests with distinct prompts of --long-words words (~7 tokens a word; 16 tokens out) arrive one every --gap
seconds. Reported: the streams' inter-token latency p50/p99/max (from SSE arrival times) while the long requests are
in flight, and the long requests' TTFT p50/max.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

LMSERVE = str(Path(sys.executable).parent / "lmserve")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2) as client:  # one client: httpx.get builds a TLS context (~20 ms of CPU) each call
        while time.monotonic() < deadline:
            try:
                if client.get(url + "/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
    raise RuntimeError(f"{url} not healthy")


def start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([LMSERVE, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def deploy(kind: str, model: str, cpus: list[int], storage: str) -> tuple[str, list[subprocess.Popen]]:
    common = ["--max-model-len", "4096", "--log-level", "WARNING"]
    half = len(cpus) // 2 or 1
    first, second = ",".join(map(str, cpus[:half])), ",".join(map(str, cpus[half:] or cpus[:half]))
    if kind in ("one", "dp2"):
        port = free_port()
        extra = ["-dp", "2"] if kind == "dp2" else []
        proc = start(["serve", model, "--port", str(port), *common, *extra])
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url)
        return url, [proc]
    ports = [free_port() for _ in range(4)]
    procs = []
    for port, role, where in ((ports[0], "kv_producer", first), (ports[1], "kv_consumer", second)):
        config = json.dumps({"kv_connector": "PyNcclConnector", "kv_role": role, "kv_port": ports[3]} if kind == "pd-link"
                            else {"kv_connector": "SharedStorageConnector", "kv_role": role,
                                  "kv_connector_extra_config": {"shared_storage_path": storage}})
        procs.append(start(["serve", model, "--port", str(port), *common, "--engine-cpus", where, "--api-cpus", where,
                            "--kv-transfer-config", config]))
    for port in ports[:2]:
        wait_healthy(f"http://127.0.0.1:{port}")
    procs.append(start(["router", "--prefill", f"http://127.0.0.1:{ports[0]}", "--decode",
                        f"http://127.0.0.1:{ports[1]}", "--port", str(ports[2]), "--log-level", "WARNING"]))
    url = f"http://127.0.0.1:{ports[2]}"
    wait_healthy(url)
    wait_transferring(url, f"http://127.0.0.1:{ports[1]}", model)
    return url, procs


def wait_transferring(router: str, decode: str, model: str, timeout: float = 120) -> None:
    """Until a prompt sent through the router is loaded on the decode side (a link comes up after both started)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        before = httpx.get(decode + "/debug/engine", timeout=10).json()["kv_transfer_loaded_tokens"]
        prompt = f"Warm-up {random.randrange(10**9)}: " + "the quick brown fox jumps over the lazy dog " * 8
        httpx.post(router + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1}, timeout=60)
        if httpx.get(decode + "/debug/engine", timeout=10).json()["kv_transfer_loaded_tokens"] > before:
            return
        time.sleep(0.5)
    raise RuntimeError("the decode instance loads nothing from the prefill instance")


async def stream(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> list[float]:
    """Arrival times of the streamed text chunks (the first is the TTFT's end)."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True}
    times = []
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    times.append(time.perf_counter())
    return times


async def workload(url: str, model: str, streams: int, stream_tokens: int, long: int, long_words: int, gap: float,
                   seed: int) -> dict:
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=600) as client:
        model_id = (await client.get(url + "/v1/models")).json()["data"][0]["id"]
        tasks = [asyncio.create_task(stream(client, url, model_id, f"Tell story number {i} about a lighthouse.",
                                            stream_tokens)) for i in range(streams)]
        await asyncio.sleep(3.0)  # the streams are decoding
        ttfts, window = [], [time.perf_counter(), 0.0]

        async def newcomer(i: int) -> None:
            words = " ".join(f"w{rng.randrange(10**6)}" for _ in range(long_words))
            started = time.perf_counter()
            times = await stream(client, url, model_id, f"Document {i}: {words}\nSummarise it.", 16)
            ttfts.append(times[0] - started)
            window[1] = max(window[1], times[-1])

        arrivals = []
        for i in range(long):
            arrivals.append(asyncio.create_task(newcomer(i)))
            await asyncio.sleep(gap)
        await asyncio.gather(*arrivals)
        stream_times = await asyncio.gather(*tasks)
    # The streams' gaps while long prompts were in flight: what separation is for.
    gaps = sorted(b - a for times in stream_times for a, b in itertools.pairwise(times) if window[0] <= b <= window[1])
    if any(times[-1] < window[1] for times in stream_times):
        raise RuntimeError("a stream ended before the long prompts did: raise --stream-tokens")
    return {"itl_p50_ms": 1000 * statistics.median(gaps), "itl_p99_ms": 1000 * gaps[int(0.99 * (len(gaps) - 1))],
            "itl_max_ms": 1000 * gaps[-1], "ttft_p50_s": statistics.median(ttfts), "ttft_max_s": max(ttfts)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--deployments", default="one,dp2,pd,pd-link")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--stream-tokens", type=int, default=1500)
    parser.add_argument("--long", type=int, default=6)
    parser.add_argument("--long-words", type=int, default=280)
    parser.add_argument("--gap", type=float, default=1.5)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    results: dict[str, list[dict]] = {}
    for round_ in range(args.rounds):
        for kind in args.deployments.split(","):
            shm = "/dev/shm" if Path("/dev/shm").is_dir() else None  # the KV's trip through memory, not a disk
            with tempfile.TemporaryDirectory(dir=shm) as storage:
                url, procs = deploy(kind, args.model, cpus, storage)
                try:
                    result = asyncio.run(workload(url, args.model, args.streams, args.stream_tokens, args.long, args.long_words,
                                                  args.gap, seed=round_))
                finally:
                    for proc in reversed(procs):
                        os.killpg(proc.pid, signal.SIGINT)
                    for proc in procs:
                        try:
                            proc.wait(30)
                        except subprocess.TimeoutExpired:
                            os.killpg(proc.pid, signal.SIGKILL)
            results.setdefault(kind, []).append(result)
            print(kind, json.dumps({k: round(v, 4) for k, v in result.items()}), flush=True)
    keys = ("itl_p50_ms", "itl_p99_ms", "itl_max_ms", "ttft_p50_s", "ttft_max_s")
    print(f"\n{'':<6}" + "".join(f"{k:>13}" for k in keys))
    for kind, runs in results.items():
        print(f"{kind:<6}" + "".join(f"{statistics.median(r[k] for r in runs):>13.3f}" for k in keys))


if __name__ == "__main__":
    main()
