"""lmserve against llama.cpp's server on the same GGUF file, one server at a time, `lmserve bench` as the client.

    benchmarks/setup_peers.sh llama                              # once: builds llama-server (outside the repo)
    .venv/bin/python benchmarks/gguf_peers.py MODEL.gguf [--servers lmserve,llama] [--rounds 2]
    (servers: lmserve, lmserve-eager = lmserve --enforce-eager, llama)

For each server, in turns (lmserve, llama.cpp, lmserve, ... for --rounds): start it on 127.0.0.1, time the command
to /health answering 200 ("ready"), read the resident memory of its processes then, run the two workloads, stop it.
  one stream: random 128-token prompts, 64 output tokens (ignore EOS), 4 requests one after another: TPOT p50;
  8 concurrent: random 256-token prompts, 64 output tokens, 32 requests at concurrency 8: output tok/s.
Prompts are the same token ids for both (the file's own tokenizer, seed 0). llama-server runs as the issue ran it:
`-t 2` (this machine's cores), continuous batching, 8 slots of 1,024 positions, `--no-repack` unless LLAMA_REPACK=1. lmserve runs with its defaults and
--max-model-len 4096 (plus --lmserve-args). Medians over rounds; the ratio is lmserve over llama.cpp.
--ready-only: the start-up alone (ready and RSS), for A/B runs of loading. --first-start: before each lmserve start, the file's converted tokenizer is removed from lmserve's cache, so that
every start is a first start of that file (the kernels stay built, as after any earlier run of lmserve).
--one-stream-only: ready, RSS and the one-stream workload, not the 8-concurrent one.
--prefill: also a 2,000-token prompt's prefill (TTFT p50 of three, one at a time): the mixture-of-experts targets.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from timing import wait_until_healthy

VENV_BIN = Path(sys.executable).parent
PEERS_DIR = Path(os.environ.get("PEERS_DIR", Path.home() / ".cache" / "lmserve-peers"))
# LLAMA_SERVER=...: another build (benchmarks/setup_peers.sh llama-avx2: the AVX2 kind's peer of a forced AVX2 lmserve).
LLAMA_SERVER = Path(os.environ.get("LLAMA_SERVER", PEERS_DIR / "llama.cpp" / "bin" / "llama-server"))
WORKLOADS = {
    "one stream": ["--random-input-len", "128", "--random-output-len", "64", "--num-prompts", "4",
                   "--max-concurrency", "1"],
    "8 concurrent": ["--random-input-len", "256", "--random-output-len", "64", "--num-prompts", "32",
                     "--max-concurrency", "8"],
    # --prefill: a 2,000-token prompt alone, three times: its time to the first token is the prompt's prefill.
    "prefill 2000": ["--random-input-len", "2000", "--random-output-len", "1", "--num-prompts", "3",
                     "--max-concurrency", "1"],
}

# lmserve as it runs by default, and with its decoder layers from Python (the layer program off) for an A/B in one run.
LMSERVE_VARIANTS = {"lmserve": [], "lmserve-eager": ["--enforce-eager"]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_rss_mib(pid: int) -> float:
    """Resident memory of a process and its children (lmserve's engine is a child of its API process)."""
    total, pids = 0, [pid]
    while pids:
        p = pids.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += int(status.split("VmRSS:")[1].split()[0])
            pids += [int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except (OSError, IndexError):
            continue
    return total / 1024


def start(server: str, model: str, port: int, lmserve_args: list[str], llama_threads: int = 2) -> subprocess.Popen:
    if server.startswith("lmserve"):
        command = [str(VENV_BIN / "lmserve"), "serve", model, "--port", str(port), "--max-model-len", "4096",
                   *lmserve_args, *LMSERVE_VARIANTS[server]]
    else:
        # --no-repack: on the AMX VM its repacking of weights for AVX-512 segfaults right after `llama threadpool
        # init` (docs/benchmarks.md, issue 22); elsewhere drop it with LLAMA_REPACK=1.
        repack = [] if os.environ.get("LLAMA_REPACK") == "1" else ["--no-repack"]
        # --kv-unified: the 8 slots share the 8,192 positions, so that --prefill's 2,000-token prompt fits one slot
        # (without it each slot holds 1,024); the cache's size is the same.
        command = [str(LLAMA_SERVER), "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t", str(llama_threads),
                   "-c", "8192", "--parallel", "8", "--cont-batching", "--kv-unified", *repack]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def wait_ready(port: int, proc: subprocess.Popen, started: float) -> float:
    wait_until_healthy(proc, f"http://127.0.0.1:{port}", poll_s=0.05, timeout_s=300)
    return time.perf_counter() - started


def bench(model: str, port: int, workload: list[str]) -> dict:
    served = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"][0]["id"]
    with tempfile.TemporaryDirectory() as out:
        command = [str(VENV_BIN / "lmserve"), "bench", "--base-url", f"http://127.0.0.1:{port}", "--model", served,
                   "--tokenizer", model, "--dataset-name", "random", "--ignore-eos", "--temperature", "0",
                   "--seed", "0", "--save-result", "--result-dir", out, "--result-filename", "r.json",
                   "--disable-tqdm", "--endpoint", "/v1/completions", *workload]
        subprocess.run(command, check=True, capture_output=True, text=True)
        result = json.loads(Path(out, "r.json").read_text())
        if result.get("completed", 0) == 0 or result.get("failed"):
            raise RuntimeError(f"requests failed: {json.dumps(result)[:2000]}")
        return result


def forget_tokenizer(model: str) -> None:
    """A first start of this file: its tokenizer converted again (lmserve.model_tokenizer's cache entries)."""
    from lmserve.config import cache_directory

    for entry in (cache_directory() / "tokenizers").glob(f"{Path(model).stem[:60]}-*"):
        shutil.rmtree(entry)


def run_once(server: str, model: str, lmserve_args: list[str], first_start: bool = False,
             ready_only: bool = False, one_stream_only: bool = False, prefill: bool = False) -> dict:
    if server.startswith("lmserve") and first_start:
        forget_tokenizer(model)
    port = free_port()
    started = time.perf_counter()
    proc = start(server, model, port, lmserve_args)
    try:
        ready = wait_ready(port, proc, started)
        result = {"ready_s": ready, "rss_mib": tree_rss_mib(proc.pid)}
        if ready_only:
            return result
        result["tpot_ms"] = bench(model, port, WORKLOADS["one stream"])["median_tpot_ms"]
        if not one_stream_only:
            result["tok_s_8"] = bench(model, port, WORKLOADS["8 concurrent"])["output_throughput"]
        if prefill:
            result["prefill_2000_ms"] = bench(model, port, WORKLOADS["prefill 2000"])["median_ttft_ms"]
        result["rss_after_mib"] = tree_rss_mib(proc.pid)
        return result
    finally:
        stop_server(proc)


def stop_server(proc: subprocess.Popen) -> None:
    """Ctrl-C to the server's process group (its engine and ranks too), then SIGKILL after 30 s."""
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--servers", default="lmserve,llama")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--lmserve-args", default="")
    parser.add_argument("--first-start", action="store_true", help="convert the file's tokenizer on every start")
    parser.add_argument("--ready-only", action="store_true", help="start, read ready and RSS, stop: no workloads")
    parser.add_argument("--one-stream-only", action="store_true",
                        help="no 8-concurrent workload (a 7B model's takes minutes a server on 2 cores)")
    parser.add_argument("--prefill", action="store_true", help="also a 2,000-token prompt's time to first token")
    args = parser.parse_args()
    servers = args.servers.split(",")
    results: dict[str, list[dict]] = {s: [] for s in servers}
    for _ in range(args.rounds):
        for server in servers:
            results[server].append(run_once(server, args.model, args.lmserve_args.split(), args.first_start,
                                            args.ready_only, args.one_stream_only, args.prefill))
            print(server, json.dumps(results[server][-1]), flush=True)
    keys = ("ready_s", "rss_mib") if args.ready_only else ("ready_s", "rss_mib", "rss_after_mib", "tpot_ms", "tok_s_8")
    if args.one_stream_only and not args.ready_only:
        keys = keys[:-1]
    if args.prefill and not args.ready_only:
        keys = (*keys, "prefill_2000_ms")
    medians = {s: {k: statistics.median(r[k] for r in results[s]) for k in keys} for s in servers}
    print(f"\n{'':<14}" + "".join(f"{k:>15}" for k in keys))
    for server in servers:
        print(f"{server:<14}" + "".join(f"{medians[server][k]:>15.2f}" for k in keys))
    for first, second in (("lmserve", "llama"), ("lmserve-eager", "llama"), ("lmserve", "lmserve-eager")):
        if first in medians and second in medians:
            print(f"{first + '/' + second:<14}"
                  + "".join(f"{medians[first][k] / medians[second][k]:>15.2f}" for k in keys))


if __name__ == "__main__":
    main()
