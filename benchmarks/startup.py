"""Time to ready and resident memory of `lmserve serve` on the default model (issue 22's start-up targets: <= 5 s on
a warm machine, kernels built; <= 1.5 GiB).

Starts the server --runs times (one at a time), and reports for each: seconds from the command to /health answering
200, and the resident set size (RSS, from /proc) of the API process, of the engine process and their sum at that
moment, then again after a W1-like burst of 16 concurrent 256-token requests (the KV cache in use).

    .venv/bin/python benchmarks/startup.py [--runs 3] [-- extra serve flags]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from timing import start_lmserve

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "api"))
from server_process import children


def rss_gib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 2**20
    return 0.0


def tree_rss(pid: int) -> tuple[float, float]:
    """(API process, engine processes and their children) in GiB."""
    engine = 0.0
    stack = list(children(pid))
    while stack:
        child = stack.pop()
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        if b"resource_tracker" not in cmdline:
            engine += rss_gib(child)
        stack += children(child)
    return rss_gib(pid), engine


def burst(url: str) -> None:
    body = {"prompt": [100 + i for i in range(256)], "max_tokens": 32, "ignore_eos": True}
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda _: httpx.post(f"{url}/v1/completions", json=body, timeout=300), range(16)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("serve_args", nargs="*")
    args = parser.parse_args()
    ready, idle, busy = [], [], []
    for _ in range(args.runs):
        started = time.perf_counter()
        process, url = start_lmserve(*args.serve_args)
        try:
            ready.append(time.perf_counter() - started)
            idle.append(tree_rss(process.pid))
            burst(url)
            busy.append(tree_rss(process.pid))
        finally:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(30)
        print(f"ready {ready[-1]:.1f} s; RSS at ready api {idle[-1][0]:.2f} + engine {idle[-1][1]:.2f} GiB; "
              f"after a burst api {busy[-1][0]:.2f} + engine {busy[-1][1]:.2f} GiB", flush=True)
    print(f"median: ready {statistics.median(ready):.1f} s, RSS at ready {statistics.median(sum(r) for r in idle):.2f}"
          f" GiB, after a burst {statistics.median(sum(r) for r in busy):.2f} GiB")


if __name__ == "__main__":
    main()
