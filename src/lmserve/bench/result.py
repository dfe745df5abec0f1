"""The benchmark's record in `vllm bench serve`'s shape, with lmserve's extras, and one reader for both.

vLLM's keys (vllm/benchmarks/serve.py, main_async and benchmark): date (YYYYmmdd-HHMMSS), endpoint_type, backend,
label, model_id, tokenizer_id, num_prompts, [--metadata keys], request_rate ("inf" or a number), burstiness,
max_concurrency, duration, completed, failed, total_input_tokens, total_output_tokens, request_throughput,
request_goodput, output_throughput, total_token_throughput, [detailed: input_lens, output_lens, ttfts, itls,
start_times, generated_texts, errors], latencies, queue_times, max_output_tokens_per_s, max_concurrent_requests,
rtfx, then mean_/median_/std_/pXX_{metric}_ms for the selected metrics. lmserve adds the rest at the top level
(config, arrival pattern, machine, versions, timeouts, every statistic of the four latencies, the raw samples).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import math
import os
import platform
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lmserve.bench.client import Sample

# Top-level keys every result has (the metrics of metrics.compute_metrics come on top of these).
RESULT_KEYS = (
    "date", "base_url", "endpoint", "model", "tokenizer", "config", "arrival_pattern", "dataset", "lengths",
    "prefix_cache", "num_warmups", "token_count_source", "input_lens_approximate", "machine", "versions", "samples",
)
VLLM_KEYS = (
    "date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
    "burstiness", "max_concurrency", "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
    "request_throughput", "request_goodput", "output_throughput", "total_token_throughput", "latencies",
    "queue_times", "max_output_tokens_per_s", "max_concurrent_requests", "rtfx",
)
# What vLLM leaves out without --save-detailed (lmserve's samples with them).
DETAILED_KEYS = ("input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts", "errors", "samples")


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


def vllm_date(now: datetime.datetime | None = None) -> str:
    """vLLM's "date" and filename stamp: local time, YYYYmmdd-HHMMSS."""
    return (now or datetime.datetime.now()).strftime("%Y%m%d-%H%M%S")


def sample_dicts(samples: list[Sample]) -> list[dict[str, Any]]:
    return [asdict(s) for s in sorted(samples, key=lambda s: s.index)]


def per_request_lists(samples: list[Sample]) -> dict[str, list[Any]]:
    """vLLM's per-request lists, in request order; a failed request has 0 for its times and lengths, as there."""
    ordered = sorted(samples, key=lambda s: s.index)
    return {
        "input_lens": [s.input_len for s in ordered],
        "output_lens": [s.output_len if s.success else 0 for s in ordered],
        "ttfts": [s.ttft if s.success and s.ttft is not None else 0.0 for s in ordered],
        "itls": [list(s.itl) if s.success else [] for s in ordered],
        "latencies": [s.e2e if s.success and s.e2e is not None else 0.0 for s in ordered],
        "start_times": [s.start for s in ordered],
        "generated_texts": [s.generated_text for s in ordered],
        "errors": [s.error for s in ordered],
    }


def vllm_header(*, date: str, backend: str, label: str | None, model_id: str, tokenizer_id: str | None,
                num_prompts: int | None, request_rate: float, burstiness: float, max_concurrency: int | None,
                metadata: dict[str, str] | None = None) -> dict[str, Any]:
    """The keys vLLM's main_async writes before the benchmark's own, in its order."""
    header: dict[str, Any] = {
        "date": date, "endpoint_type": backend, "backend": backend, "label": label, "model_id": model_id,
        "tokenizer_id": tokenizer_id, "num_prompts": num_prompts,
    }
    header.update(metadata or {})
    header.update(request_rate=request_rate if math.isfinite(request_rate) else "inf", burstiness=burstiness,
                  max_concurrency=max_concurrency)
    return header


def parse_metadata(items: list[str] | None) -> dict[str, str]:
    out = {}
    for item in items or []:
        key, found, value = item.partition("=")
        if not found:
            raise ValueError(f"--metadata {item}: expected KEY=VALUE")
        out[key.strip()] = value.strip()
    return out


def result_filename(*, label: str | None, backend: str, request_rate: float, max_concurrency: int | None,
                    model_id: str, date: str, result_dir: str | None, result_filename: str | None) -> str:
    """vLLM's compute_result_filename: {label}-{rate}qps[-concurrency{C}]-{model basename}-{date}.json."""
    concurrency = f"-concurrency{max_concurrency}" if max_concurrency is not None else ""
    name = result_filename or f"{label or backend}-{request_rate}qps{concurrency}-{model_id.split('/')[-1]}-{date}.json"
    if result_dir:
        os.makedirs(result_dir, exist_ok=True)
        name = os.path.join(result_dir, name)
    return name


def without_details(result: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in result.items() if k not in DETAILED_KEYS}


def write_json(result: dict[str, Any], path: str | Path, *, append: bool = False) -> None:
    """One JSON document; with append, after a newline at the end of what is there (vLLM's --append-result)."""
    text = json.dumps(jsonable(result), indent=None if append else 2)
    path = Path(path)
    if append and path.exists() and path.stat().st_size:
        with path.open("a", encoding="utf-8") as f:
            f.write("\n" + text)
    else:
        path.write_text(text + ("" if append else "\n"), encoding="utf-8")




# --------------------------------------------------------------------------------------------------- reader


@dataclass
class BenchResult:
    """What both clients' result files say, in one shape. Latency statistics are ms, keyed metric -> stat."""

    source: str  # "lmserve" or "vllm"
    date: str
    backend: str | None
    model_id: str | None
    num_prompts: int | None
    request_rate: float
    burstiness: float | None
    max_concurrency: int | None
    duration: float
    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    request_goodput: float | None
    latency_ms: dict[str, dict[str, float | None]]
    per_request: dict[str, list[Any]]  # vLLM's detailed lists, where the file has them
    raw: dict[str, Any]


_STAT_KEY = re.compile(r"^(mean|median|std|min|max|p\d+(?:\.\d+)?)_(.+)_ms$")
_PER_REQUEST = ("input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times", "generated_texts",
                "errors")


def read_result(path: str | Path) -> BenchResult:
    """A result file of `lmserve bench` (--output, --save-result) or of `vllm bench serve --save-result`.

    A file grown by --append-result holds several documents, one after another: the last one is read.
    """
    text = Path(path).read_text(encoding="utf-8")
    decoder, documents, at = json.JSONDecoder(), [], 0
    while at < len(text.rstrip()):
        while text[at].isspace():
            at += 1
        document, at = decoder.raw_decode(text, at)
        documents.append(document)
    if not documents or not isinstance(documents[-1], dict):
        raise ValueError(f"{path}: not a benchmark result (expected a JSON object)")
    raw = documents[-1]
    missing = [k for k in ("duration", "completed", "total_input_tokens", "output_throughput") if k not in raw]
    if missing:
        raise ValueError(f"{path}: not a benchmark result (no {', '.join(missing)})")
    latency: dict[str, dict[str, float | None]] = {}
    for key, value in raw.items():
        match = _STAT_KEY.match(key)
        if match and (value is None or isinstance(value, (int, float))):
            latency.setdefault(match.group(2), {})[match.group(1)] = value
    rate = raw.get("request_rate", raw.get("arrival_pattern", {}).get("request_rate", "inf"))
    return BenchResult(
        source="lmserve" if "arrival_pattern" in raw else "vllm",
        date=str(raw.get("date", "")),
        backend=raw.get("backend"),
        model_id=raw.get("model_id", raw.get("model")),
        num_prompts=raw.get("num_prompts"),
        request_rate=float(rate),  # "inf" included
        burstiness=raw.get("burstiness"),
        max_concurrency=raw.get("max_concurrency"),
        duration=float(raw["duration"]),
        completed=int(raw["completed"]),
        failed=int(raw.get("failed", 0)),
        total_input_tokens=int(raw["total_input_tokens"]),
        total_output_tokens=int(raw.get("total_output_tokens", 0)),
        request_throughput=float(raw.get("request_throughput", 0.0)),
        output_throughput=float(raw["output_throughput"]),
        total_token_throughput=float(raw.get("total_token_throughput", 0.0)),
        request_goodput=raw.get("request_goodput"),
        latency_ms=latency,
        per_request={k: raw[k] for k in _PER_REQUEST if k in raw},
        raw=raw,
    )
