"""The helpers the benchmark scripts share (they run as scripts, so `from timing import median_ms`)."""

from __future__ import annotations

import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx


def median_ms(fn: Callable[[], object], repeats: int = 30) -> float:
    """Median wall time of fn in milliseconds, after one untimed warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def wait_until_healthy(process: subprocess.Popen, url: str, poll_s: float = 0.5, timeout_s: float = 200.0,
                       path: str = "/health") -> None:
    """Returns once `url` + `path` answers 200; raises RuntimeError if the server exits or the time runs out. One
    client for every poll: `httpx.get` builds a TLS context each call (~20 ms of CPU), which every 50 ms took a
    third of a core from the server starting beside it on 2 cores."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"server exited with {process.returncode}")
            try:
                if client.get(f"{url}{path}").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(poll_s)
    raise RuntimeError(f"server not ready in {timeout_s:.0f} s")


def start_lmserve(*args: str, env: dict[str, str] | None = None,
                  poll_s: float = 0.5) -> tuple[subprocess.Popen, str]:
    """`lmserve serve ARGS` on a free port, in its own process group (stop it with os.killpg); (process, base URL)
    once /health answers 200."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    lmserve = Path(sys.executable).parent / "lmserve"
    process = subprocess.Popen([str(lmserve), "serve", *args, "--port", str(port)], start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_until_healthy(process, url, poll_s)
    return process, url
