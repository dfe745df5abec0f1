"""What running across "machines" costs against the same layout on one: ranks or replicas on the other side of this
machine's network address (TCP and ZMQ heartbeats, a `--headless` process) against the same processes on ipc sockets.

    .venv/bin/python benchmarks/multi_machine.py [MODEL] [--rounds 2]

Layouts (the default model: 9 heads / 3 KV heads, so pipeline stages rather than -tp 2):
  pp2: `-pp 2` (two rank processes, ipc) against `-pp 2 --nnodes 2` with node 1 `--headless`;
  dp2: `-dp 2` against `-dp 2 --data-parallel-size-local 1` with replica 1 `--headless`.
Each in turns, one server at a time, `lmserve bench` as the client: one stream (random 128-token prompts, 64 output
tokens, 4 requests: TPOT p50) and 8 concurrent (256 / 64, 32 requests: output tok/s). Medians over rounds; the ratio
is across machines over one machine. This measures the code paths, not a network: both sides share this machine,
each "machine" pinned to a CPU of its own (--engine-cpus 0 and 1), as one machine's ranks or replicas split its CPUs.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from gguf_peers import WORKLOADS, bench, free_port, stop_server, wait_ready

VENV_BIN = Path(sys.executable).parent


def network_address() -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def layouts(host: str, port: int) -> dict[str, tuple[list[str], list[str] | None]]:
    """name -> (the server's flags, the headless node's flags or None)."""
    nodes = ["--nnodes", "2", "--master-addr", host, "--master-port", str(port)]
    replicas = ["--data-parallel-address", host, "--data-parallel-rpc-port", str(port + 20)]
    # The "machines" share this one: each gets a CPU of its own, as the one-machine layouts give each rank or replica.
    first, second = ["--engine-cpus", "0"], ["--engine-cpus", "1"]
    return {
        "pp2 one machine": (["-pp", "2"], None),
        "pp2 two machines": (["-pp", "2", *nodes, *first],
                             ["-pp", "2", *nodes, "--node-rank", "1", "--headless", *second]),
        "dp2 one machine": (["-dp", "2"], None),
        "dp2 two machines": (["-dp", "2", "--data-parallel-size-local", "1", *replicas, *first],
                             ["-dp", "2", *replicas, "--data-parallel-start-rank", "1", "--headless", *second]),
    }


def run_once(model: list[str], tokenizer: str, server_flags: list[str], node_flags: list[str] | None) -> dict:
    port = free_port()
    lmserve = str(VENV_BIN / "lmserve")
    node = None
    if node_flags is not None:
        node = subprocess.Popen([lmserve, "serve", *model, *node_flags], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
    started = time.perf_counter()
    proc = subprocess.Popen([lmserve, "serve", *model, "--port", str(port), *server_flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        result = {"ready_s": wait_ready(port, proc, started)}
        result["tpot_ms"] = bench(tokenizer, port, WORKLOADS["one stream"])["median_tpot_ms"]
        result["tok_s_8"] = bench(tokenizer, port, WORKLOADS["8 concurrent"])["output_throughput"]
        return result
    finally:
        stop_server(proc)
        if node is not None:
            stop_server(node)  # after the server: a clean shutdown ends it by itself


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default=None, help="default: lmserve's default model")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    from lmserve.models import DEFAULT_MODEL, resolve_model

    model = [args.model] if args.model else []
    tokenizer = str(resolve_model(args.model or DEFAULT_MODEL).path)
    host = network_address()
    results: dict[str, list[dict]] = {}
    for _ in range(args.rounds):
        for name, (server_flags, node_flags) in layouts(host, 29600 + 40 * len(results)).items():
            results.setdefault(name, []).append(run_once(model, tokenizer, server_flags, node_flags))
            print(name, json.dumps(results[name][-1]), flush=True)
    keys = ("ready_s", "tpot_ms", "tok_s_8")
    medians = {n: {k: statistics.median(r[k] for r in rs) for k in keys} for n, rs in results.items()}
    print(f"\nnetwork address {host}\n{'':<20}" + "".join(f"{k:>12}" for k in keys))
    for name, values in medians.items():
        print(f"{name:<20}" + "".join(f"{values[k]:>12.2f}" for k in keys))
    for layout in ("pp2", "dp2"):
        two, one = medians[f"{layout} two machines"], medians[f"{layout} one machine"]
        print(f"{layout + ' two/one':<20}" + "".join(f"{two[k] / one[k]:>12.2f}" for k in keys))


if __name__ == "__main__":
    main()
