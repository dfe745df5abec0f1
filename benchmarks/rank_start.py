"""Time to ready and memory of `lmserve serve -tp N` with its ranks forked from the engine's fork server against
ranks started as fresh interpreters (LMSERVE_FORK_RANKS=0), in alternating runs, one server at a time.

Reports per setting the median seconds from the command to /health answering 200, and the proportional set size
(PSS, /proc/PID/smaps_rollup) summed over the server's processes at that moment: forked ranks share the pages of
what the server imported, which RSS would count once per process.

    .venv/bin/python benchmarks/rank_start.py MODEL --tp 2 [--runs 5] [-- extra serve flags]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
from pathlib import Path

from timing import start_lmserve

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "api"))
from server_process import children

SETTINGS = {"forked": {}, "fresh": {"LMSERVE_FORK_RANKS": "0"}}


def tree(pid: int) -> list[int]:
    found, stack = [], [pid]
    while stack:
        current = stack.pop()
        found.append(current)
        stack += children(current)
    return found


def pss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) / 1024
    return 0.0


def start_once(args: list[str], env: dict[str, str]) -> tuple[float, float, int]:
    """(seconds to ready, PSS of every process of the server in MiB, how many processes)."""
    started = time.monotonic()
    process, _ = start_lmserve(*args, env={**os.environ, **env}, poll_s=0.02)
    try:
        ready = time.monotonic() - started
        pids = tree(process.pid)
        return ready, sum(pss_mib(pid) for pid in pids), len(pids)
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)
        time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--runs", type=int, default=5)
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []  # more `lmserve serve` flags
    options = parser.parse_args(argv[: len(argv) - len(extra) - (1 if extra else 0)])
    args = ["--model", options.model, "-tp", str(options.tp), *extra]
    results: dict[str, list[tuple[float, float, int]]] = {name: [] for name in SETTINGS}
    for run in range(options.runs):
        for name, env in SETTINGS.items():
            results[name].append(start_once(args, env))
            ready, pss, count = results[name][-1]
            print(f"run {run + 1} {name}: ready {ready:.2f} s, PSS {pss:.0f} MiB over {count} processes", flush=True)
    print(f"\nlmserve serve {' '.join(args)}, {options.runs} runs each, medians")
    print("| ranks | ready (s) | PSS of all processes (MiB) | processes |")
    print("|---|---|---|---|")
    for name, rows in results.items():
        print(f"| {name} | {statistics.median(r[0] for r in rows):.2f} | {statistics.median(r[1] for r in rows):.0f} "
              f"| {rows[0][2]} |")


if __name__ == "__main__":
    main()
