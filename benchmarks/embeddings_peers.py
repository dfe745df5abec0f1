"""Embeddings through the server: lmserve against llama.cpp's `llama-server --embedding` on the same GGUF (issue 73).

    ../shared/models/get_embedding_models.sh                     # once: nomic-embed-text-v1.5.f16.gguf
    benchmarks/setup_peers.sh llama                              # once: llama-server (outside the repo)
    .venv/bin/python benchmarks/embeddings_peers.py ~/.cache/lmserve/embedding-models/nomic-embed-text-v1.5.f16.gguf

A by-hand benchmark, not a test (CI has neither the file nor llama-server). The issue's workload: --docs documents
(default 256) of 100-500 tokens, each one /v1/embeddings request, sent by --clients concurrent clients (default 8):
documents per second; then one short query at a time (--queries of them): median and p90 latency. One server at a
time, lmserve and llama.cpp alternately (--rounds, default 2), since runs minutes apart differ on a shared CPU. The
vectors of every document from both servers are compared: the lowest cosine (correctness on long and short inputs,
batched as each server batches them). Prints a JSON summary (--json FILE writes it too).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
from gguf_peers import LLAMA_SERVER, VENV_BIN, free_port, stop_server
from timing import wait_until_healthy

# Ordinary words, most of them one WordPiece token each: a document of n words is about n tokens (+ the prefix).
WORDS = ["the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at", "from", "it", "an", "be", "this", "are", "which", "or", "his", "had", "not", "but", "have", "were", "they", "one", "all", "been", "their", "has", "more", "when", "there", "can", "who", "time", "new", "some", "would", "other", "about", "into", "its", "than", "first", "also", "after", "only", "two", "over", "most", "city", "used", "state", "school", "world", "where", "many", "these", "may", "between", "system", "during", "such", "under", "known", "well", "people", "later", "both", "then", "group", "year", "those", "while", "made", "several", "work", "part", "government", "number", "music", "team", "including", "company", "since", "high", "series", "early", "same", "three", "because", "each", "life", "national", "called", "university", "war", "found", "area", "best", "family", "name", "different", "water", "public", "small", "main"]


def documents(count: int, low: int, high: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["search_document: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))
            for _ in range(count)]


def start(server: str, model: str, port: int) -> subprocess.Popen:
    if server == "lmserve":
        command = [str(VENV_BIN / "lmserve"), "serve", model, "--port", str(port)]
    else:
        # Every input whole in one ubatch (a bidirectional model needs it), 8 slots sharing the positions.
        command = [str(LLAMA_SERVER), "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t", "2",
                   "--embedding", "--pooling", "mean", "-c", "8192", "-b", "2048", "-ub", "2048", "--parallel", "8",
                   "--kv-unified"]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def embed(client: httpx.Client, url: str, text: str) -> tuple[np.ndarray, int]:
    body = client.post(f"{url}/v1/embeddings", json={"input": text}).json()
    vector = np.asarray(body["data"][0]["embedding"], dtype=np.float64)
    return vector, int(body["usage"]["prompt_tokens"])


def run(server: str, model: str, docs: list[str], clients: int, queries: int) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    started = time.perf_counter()
    proc = start(server, model, port)
    try:
        wait_until_healthy(proc, url, poll_s=0.1, timeout_s=300)
        ready_s = time.perf_counter() - started
        with httpx.Client(timeout=600) as client:
            for text in docs[:4]:  # warm-up
                embed(client, url, text)
            began = time.perf_counter()
            with ThreadPoolExecutor(clients) as pool:
                results = list(pool.map(lambda text: embed(client, url, text), docs))
            elapsed = time.perf_counter() - began
            latencies = []
            for i in range(queries):
                t0 = time.perf_counter()
                embed(client, url, f"search_query: what is the {WORDS[i % len(WORDS)]} of the world?")
                latencies.append(time.perf_counter() - t0)
    finally:
        stop_server(proc)
    latencies.sort()
    return {"server": server, "ready_s": round(ready_s, 1), "docs_per_s": round(len(docs) / elapsed, 2),
            "tokens": sum(t for _, t in results), "query_median_ms": round(1000 * statistics.median(latencies), 1),
            "query_p90_ms": round(1000 * latencies[int(0.9 * (len(latencies) - 1))], 1),
            "vectors": [v for v, _ in results]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a nomic-bert (or other embedding) GGUF file both servers run")
    parser.add_argument("--docs", type=int, default=256)
    parser.add_argument("--min-words", type=int, default=95)
    parser.add_argument("--max-words", type=int, default=490)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--queries", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    docs = documents(args.docs, args.min_words, args.max_words)
    runs = []
    for _ in range(args.rounds):
        for server in ("lmserve", "llama.cpp"):
            runs.append(run(server, args.model, docs, args.clients, args.queries))
            print(json.dumps({k: v for k, v in runs[-1].items() if k != "vectors"}), flush=True)
    ours = next(r for r in runs if r["server"] == "lmserve")["vectors"]
    theirs = next(r for r in runs if r["server"] == "llama.cpp")["vectors"]
    cosines = [float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)) for a, b in zip(ours, theirs, strict=True)]
    summary = {
        "model": Path(args.model).name, "docs": args.docs, "clients": args.clients,
        "runs": [{k: v for k, v in r.items() if k != "vectors"} for r in runs],
        "min_cosine_lmserve_vs_llama_cpp": round(min(cosines), 7),
        "docs_per_s_ratio_median": round(
            statistics.median(r["docs_per_s"] for r in runs if r["server"] == "lmserve")
            / statistics.median(r["docs_per_s"] for r in runs if r["server"] == "llama.cpp"), 2),
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
