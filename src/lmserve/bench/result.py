"""The benchmark's record: what was run (config, machine, versions), what it measured, and every raw sample."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import math
import os
import platform
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from lmserve.bench.client import Sample
from lmserve.bench.metrics import METRICS, STATS

# Top-level keys every result has (the metrics of metrics.compute_metrics come on top of these).
RESULT_KEYS = (
    "date", "base_url", "endpoint", "model", "tokenizer", "config", "arrival_pattern", "dataset", "lengths",
    "prefix_cache", "num_warmups", "token_count_source", "input_lens_approximate", "machine", "versions", "samples",
)


def jsonable(value: Any) -> Any:
    """JSON has no infinity or NaN: write them as strings (vLLM writes an infinite rate as "inf")."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpu": _cpu_model(), "logical_cores": os.cpu_count(), "memory_bytes": _memory_bytes(),
        "platform": platform.platform(), "gpu": None,
    }
    try:  # torch is optional here (another machine may run only the load generator) and slow to import
        import torch

        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["gpu_count"] = torch.cuda.device_count()
    except Exception as exc:  # noqa: BLE001 - no torch, or a broken CUDA setup: the record just has no GPU
        info["gpu_error"] = f"{type(exc).__name__}: {exc}"
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def versions(server_version: dict | None) -> dict[str, Any]:
    def version_of(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    from lmserve import __version__

    return {
        "lmserve": __version__, "torch": version_of("torch"), "httpx": version_of("httpx"),
        "python": platform.python_version(), "server": server_version,
    }


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).astimezone().isoformat(timespec="seconds")


def sample_dicts(samples: list[Sample]) -> list[dict[str, Any]]:
    return [asdict(s) for s in sorted(samples, key=lambda s: s.index)]


def write_json(result: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(jsonable(result), indent=2) + "\n")


# ---------------------------------------------------------------------------------------------------- table

_TITLES = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}
_STAT_LABELS = {"mean": "Mean", "median": "Median", "p90": "P90", "p95": "P95", "p99": "P99", "std": "Std",
                "min": "Min", "max": "Max"}


def _fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def render_table(result: dict[str, Any]) -> str:
    """vLLM's "Serving Benchmark Result" layout, plus the timeouts, p90/p95/min/max and the arrival pattern."""
    pattern = result["arrival_pattern"]
    rows = [
        ("Arrival pattern:", pattern["kind"]),
        ("Request rate (req/s):", pattern["request_rate"]),
        ("Burstiness:", pattern["burstiness"] if pattern["kind"] == "open" else None),
        ("Max concurrency:", pattern["max_concurrency"]),
        ("Successful requests:", result["completed"]),
        ("Failed requests:", result["failed"]),
        ("Timed out requests:", result["timed_out"]),
        ("Benchmark duration (s):", result["duration"]),
        ("Total input tokens:", result["total_input_tokens"]),
        ("Total generated tokens:", result["total_output_tokens"]),
        ("Request throughput (req/s):", result["request_throughput"]),
        ("Output token throughput (tok/s):", result["output_throughput"]),
        ("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"]),
        ("Peak concurrent requests:", result["max_concurrent_requests"]),
        ("Total Token throughput (tok/s):", result["total_token_throughput"]),
    ]
    if result.get("request_goodput") is not None:
        rows.append(("Request goodput (req/s):", result["request_goodput"]))
    lines = [f"{' Serving Benchmark Result ':=^50}"]
    lines += [f"{label:<40} {_fmt(value):<10}" for label, value in rows]
    for metric in METRICS:
        title, short = _TITLES[metric]
        lines.append(f"{title:-^50}")
        for stat in STATS:
            label = f"{_STAT_LABELS[stat]} {short} (ms):"
            lines.append(f"{label:<40} {_fmt(result[f'{stat}_{metric}_ms']):<10}")
    lines.append("=" * 50)
    return "\n".join(lines)


def print_table(result: dict[str, Any]) -> None:
    print(render_table(result), file=sys.stdout, flush=True)
