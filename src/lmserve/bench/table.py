"""The printed summary: vLLM's "Serving Benchmark Result" rows, then lmserve's few more."""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

from lmserve.bench.metrics import percentile_key

_TITLES = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
    "client_queue_time": ("Client-side Queueing", "Client Queue Time"),
    "e2el_including_client_queue": ("Queue-inclusive End-to-end Latency", "E2EL incl. Client Queue"),
}


def _fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def render_table(result: dict[str, Any], metrics: Sequence[str] = ("ttft", "tpot", "itl"),
                 percentiles: Sequence[float] = (99,)) -> str:
    pattern = result["arrival_pattern"]
    rows: list[tuple[str, Any]] = [
        ("Successful requests:", result["completed"]),
        ("Failed requests:", result["failed"]),
    ]
    if pattern["max_concurrency"] is not None:
        rows.append(("Maximum request concurrency:", pattern["max_concurrency"]))
    if math.isfinite(pattern["request_rate"]):
        rows.append(("Request rate configured (RPS):", float(pattern["request_rate"])))
    rows += [
        ("Benchmark duration (s):", result["duration"]),
        ("Total input tokens:", result["total_input_tokens"]),
        ("Total generated tokens:", result["total_output_tokens"]),
        ("Request throughput (req/s):", result["request_throughput"]),
    ]
    if result.get("request_goodput") is not None:
        rows.append(("Request goodput (req/s):", result["request_goodput"]))
    rows += [
        ("Output token throughput (tok/s):", result["output_throughput"]),
        ("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"]),
        ("Peak concurrent requests:", float(result["max_concurrent_requests"])),
        ("Total Token throughput (tok/s):", result["total_token_throughput"]),
        # lmserve's own rows.
        ("Timed out requests (of the failed):", result["timed_out"]),
        ("Arrival pattern:", pattern["kind"]),
    ]
    if pattern["kind"] == "open":
        rows.append(("Burstiness:", pattern["burstiness"]))
    lines = [f"{' Serving Benchmark Result ':=^50}"]
    lines += [f"{label:<40} {_fmt(value):<10}" for label, value in rows]
    for metric in metrics:
        if f"mean_{metric}_ms" not in result:
            continue  # the client queue exists only with --max-concurrency, as in vLLM
        title, short = _TITLES[metric]
        lines.append(f"{title:-^50}")
        stats = [("Mean", "mean"), ("Median", "median")]
        stats += [(percentile_key(p).upper(), percentile_key(p)) for p in percentiles]
        for label, stat in stats:
            lines.append(f"{f'{label} {short} (ms):':<40} {_fmt(result.get(f'{stat}_{metric}_ms')):<10}")
    lines.append("=" * 50)
    return "\n".join(lines)


def print_table(result: dict[str, Any], metrics: Sequence[str] = ("ttft", "tpot", "itl"),
                percentiles: Sequence[float] = (99,)) -> None:
    print(render_table(result, metrics, percentiles), file=sys.stdout, flush=True)
