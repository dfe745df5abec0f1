"""How long `lmserve serve` takes to stop: SIGTERM to the API process until it has exited (its engine stopped first).

Every test that starts a server pays this, as does every restart. Compares source trees in alternating rounds (export
another commit with `git archive COMMIT src | tar -x -C DIR`):

    .venv/bin/python benchmarks/server_stop.py --src src --src /tmp/old/src --rounds 5

Each round: start the default model's server from that tree, wait for /health, answer one completion, SIGTERM, time
the exit. A first round per tree, not counted, builds its kernels into a cache of its own. Prints each tree's
times and their median.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def healthy_within(url: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2) as client:  # one client: httpx.get builds a TLS context (~20 ms of CPU) each call
        while time.monotonic() < deadline:
            try:
                if client.get(url).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
    return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_stop(src: Path, extra: list[str]) -> float:
    port = free_port()
    # A cache of its own per tree: trees whose kernel sources differ would rebuild each other's kernels every round.
    cache = Path(tempfile.gettempdir()) / f"lmserve-stop-bench-{hashlib.sha256(str(src.resolve()).encode()).hexdigest()[:12]}"
    env = {**os.environ, "PYTHONPATH": str(src.resolve()), "LMSERVE_CACHE": str(cache)}
    with tempfile.TemporaryFile() as log:
        server = subprocess.Popen([sys.executable, "-m", "lmserve.cli", "serve", "--port", str(port), *extra],
                                  env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            if not healthy_within(f"http://127.0.0.1:{port}/health", 180):
                log.seek(0)
                raise RuntimeError(f"not healthy:\n{log.read().decode()[-2000:]}")
            answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                                json={"prompt": "Hello", "max_tokens": 4}, timeout=60)
            answer.raise_for_status()
            started = time.perf_counter()
            server.send_signal(signal.SIGTERM)
            code = server.wait(60)
            took = time.perf_counter() - started
            if code != 0:
                raise RuntimeError(f"exit code {code}")
            return took
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", type=Path, action="append", required=True, help="a tree's src folder (repeat)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--serve-args", default="--max-model-len 512", help="extra `lmserve serve` arguments")
    args = parser.parse_args()
    times: dict[Path, list[float]] = {src: [] for src in args.src}
    for src in args.src:  # not counted: builds each tree's kernels into its cache
        one_stop(src, args.serve_args.split())
    for _ in range(args.rounds):
        for src in args.src:
            times[src].append(one_stop(src, args.serve_args.split()))
    for src, taken in times.items():
        print(f"{src}: median {statistics.median(taken) * 1000:.0f} ms  "
              f"({', '.join(f'{t * 1000:.0f}' for t in taken)} ms)")


if __name__ == "__main__":
    main()
