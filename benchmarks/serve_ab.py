"""The served path of two commits side by side: the working tree against `--base REV`, on the default model.

Each side's server runs from its own checkout (a temporary git worktree for the base), one server at a time, the two
taking turns for --rounds rounds (so both see the same machine state through this VM's drift). The same `lmserve
bench` client (this tree's) measures each turn:
  W1: 256-token prompts, 128 output tokens (ignore EOS), 32 requests, 16 concurrent: output tokens/s, median TTFT;
  W4: 128-token prompts, 128 output tokens, 3 requests one at a time: 1/TPOT (tokens/s).
It reports the median of each over the rounds, and the ratio working tree / base.

    .venv/bin/python benchmarks/serve_ab.py --base dffb348 [--rounds 3] [--workloads W4] \
        [--bench-args "--temperature 1 --top-p 0.95"]   (later flags win over the greedy default)
        [--serve-args "--async-scheduling"] [--base-serve-args "..."]   (server flags of each side)

`--base HEAD --serve-args X` compares one setting against the defaults on the same code.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "api"))
import httpx
from server_process import free_port, wait_for

WORKLOADS = {
    "W1": ["--random-input-len", "256", "--random-output-len", "128", "--num-prompts", "32",
           "--max-concurrency", "16"],
    "W4": ["--random-input-len", "128", "--random-output-len", "128", "--num-prompts", "3", "--max-concurrency", "1"],
}


def serve(source: Path, port: int, log: Path, serve_args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(source)}  # before site-packages: this side's lmserve
    cmd = [sys.executable, "-c", "import sys; from lmserve.cli import main; sys.exit(main())", "serve",
           "--port", str(port), "--max-model-len", "1024", *serve_args]
    with open(log, "w") as out:
        process = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def healthy() -> bool:
        try:
            return client.get(f"http://127.0.0.1:{port}/health").status_code == 200
        except httpx.HTTPError:
            return False

    with httpx.Client(timeout=2) as client:  # one client: httpx.get builds a TLS context (~20 ms of CPU) each call
        started = wait_for(healthy, timeout=180, interval=0.5)
    if not started:
        process.kill()
        raise RuntimeError(f"server from {source} did not start:\n{log.read_text()[-2000:]}")
    return process


def bench(port: int, workload: str, result: Path, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "lmserve.bench", "--base-url", f"http://127.0.0.1:{port}", "--ignore-eos",
           "--temperature", "0", "--disable-tqdm", "--seed", "0", "--output", str(result), *WORKLOADS[workload],
           *extra]
    subprocess.run(cmd, check=True, capture_output=True, cwd=REPO)
    return json.loads(result.read_text())


def measure(source: Path, tmp: Path, tag: str, workloads: list[str], extra: list[str],
            serve_args: list[str]) -> dict[str, float]:
    port = free_port()
    process = serve(source, port, tmp / f"{tag}.log", serve_args)
    results = {}
    try:
        for workload in workloads:
            result = bench(port, workload, tmp / f"{tag}-{workload}.json", extra)
            if workload == "W1":
                results["W1 output tok/s"] = result["output_throughput"]
                results["W1 TTFT p50 ms"] = result["median_ttft_ms"]
            else:
                results["W4 1/TPOT tok/s"] = 1000.0 / result["median_tpot_ms"]
    finally:
        process.terminate()
        process.wait(30)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the git revision to compare against")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workloads", default="W1,W4", help="comma-separated: W1, W4")
    parser.add_argument("--bench-args", default="", help="extra lmserve bench flags, e.g. sampling settings")
    parser.add_argument("--serve-args", default="", help="extra lmserve serve flags of the working tree's server")
    parser.add_argument("--base-serve-args", default="", help="extra lmserve serve flags of the base's server")
    args = parser.parse_args()
    workloads, extra = args.workloads.split(","), args.bench_args.split()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        worktree = tmp / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(worktree), args.base], cwd=REPO, check=True,
                       capture_output=True)
        try:
            sides = {"base": worktree / "src", "tree": REPO / "src"}
            serve_args = {"base": args.base_serve_args.split(), "tree": args.serve_args.split()}
            results: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
            for round_index in range(args.rounds):
                order = list(sides) if round_index % 2 == 0 else list(reversed(sides))
                for side in order:
                    results[side].append(
                        measure(sides[side], tmp, f"{side}-{round_index}", workloads, extra, serve_args[side]))
                    print(f"round {round_index} {side}: {results[side][-1]}", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=REPO, check=False)
    print(f"\n{platform.machine()}, python {platform.python_version()}, base {args.base}, {args.rounds} rounds, "
          f"bench args {args.bench_args!r}, serve args: base {args.base_serve_args!r}, tree {args.serve_args!r}")
    print("| metric | base (median) | working tree (median) | ratio |")
    print("|---|---|---|---|")
    for metric in results["base"][0]:
        base = statistics.median(r[metric] for r in results["base"])
        tree = statistics.median(r[metric] for r in results["tree"])
        print(f"| {metric} | {base:.1f} | {tree:.1f} | {tree / base:.3f} |")


if __name__ == "__main__":
    main()
