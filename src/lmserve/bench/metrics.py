"""Serving metrics from raw samples, with the definitions of `vllm bench serve` so results compare one to one.

- TTFT: time to the first chunk with choices. E2E latency (e2el): time to the last chunk with choices.
- TPOT per request: (e2el - ttft) / (output tokens - 1), for requests with more than one output token.
- ITL: every gap between successive chunks with choices, pooled over all requests.
- Input tokens: the server's usage.prompt_tokens when it sends them, else the dataset's count (as vLLM).
- Only successful requests enter latencies and token totals; "failed" counts every other request (as vLLM),
  "timed_out" the part of them that ran out of --timeout.
- Throughputs divide by the duration: benchmark start to the last completion.
- Peak output tokens/s and peak concurrency: vLLM's, over the successful requests (one token per chunk, in
  one-second buckets from the first start; half-open [start, end) intervals).
- Goodput: successful requests meeting every given SLO (ms) per second; like vLLM, a request with a single output
  token counts as TPOT 0 there.
Percentiles are numpy's (linear interpolation); std is the population std (numpy's default, as vLLM).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

from lmserve.bench.client import Sample

METRICS = ("ttft", "tpot", "itl", "e2el")
STATS = ("mean", "median", "p90", "p95", "p99", "std", "min", "max")
SLO_KEYS = ("ttft", "tpot", "e2el")


def percentile_key(p: float) -> str:
    """vLLM's spelling: 99 -> "p99", 99.9 -> "p99.9"."""
    return f"p{int(p)}" if int(p) == p else f"p{p}"


def distribution(values: Sequence[float]) -> dict[str, float | None]:
    """The statistics of a list of seconds, in milliseconds; all None for an empty list (not a fake 0)."""
    if len(values) == 0:
        return dict.fromkeys(STATS)
    ms = np.asarray(values, dtype=np.float64) * 1000.0
    p50, p90, p95, p99 = np.percentile(ms, [50, 90, 95, 99])
    return {
        "mean": float(ms.mean()), "median": float(p50), "p90": float(p90), "p95": float(p95), "p99": float(p99),
        "std": float(ms.std()), "min": float(ms.min()), "max": float(ms.max()),
    }


def tpot(sample: Sample) -> float | None:
    if sample.output_len <= 1 or sample.ttft is None or sample.e2e is None:
        return None
    return (sample.e2e - sample.ttft) / (sample.output_len - 1)


def parse_slo(text: str, sep: str = "=") -> dict[str, float]:
    """'ttft=500,tpot=50' (or vLLM's 'ttft:500' items with sep=':') -> {'ttft': 500.0, 'tpot': 50.0}, in ms."""
    slo: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, found, value = item.partition(sep)
        key = key.strip().lower()
        if not found or key not in SLO_KEYS:
            raise ValueError(f"bad SLO '{item}': expected KEY{sep}MS with KEY one of {', '.join(SLO_KEYS)}")
        try:
            slo[key] = float(value)
        except ValueError:
            raise ValueError(f"bad SLO '{item}': '{value}' is not a number of milliseconds") from None
        if slo[key] <= 0 or math.isnan(slo[key]):
            raise ValueError(f"bad SLO '{item}': must be > 0 ms")
    return slo


def meets_slo(sample: Sample, slo: dict[str, float]) -> bool:
    observed = {
        "ttft": sample.ttft if sample.ttft is not None else math.inf,
        "tpot": tpot(sample) or 0.0,  # vLLM: one output token means no TPOT, which meets any TPOT SLO
        "e2el": sample.e2e if sample.e2e is not None else math.inf,
    }
    return all(observed[key] * 1000.0 <= limit for key, limit in slo.items())


def token_timeline(samples: Iterable[Sample], duration: float, bin_s: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Output tokens/s in bins of bin_s from the chunks' arrival times (a chunk's tokens: output_len / chunks)."""
    times: list[float] = []
    weights: list[float] = []
    for s in samples:
        chunks = s.chunk_times() if s.success else []
        if chunks:
            times += chunks
            weights += [s.output_len / len(chunks)] * len(chunks)
    edges = np.arange(0.0, max(duration, bin_s) + bin_s, bin_s)
    counts, _ = np.histogram(times, bins=edges, weights=weights)
    return edges[:-1], counts / bin_s


def max_concurrent(samples: Iterable[Sample]) -> int:
    """The most requests in flight at once, from the samples' start and end times."""
    events = []
    for s in samples:
        if s.e2e is not None:
            events += [(s.start, 1), (s.start + s.e2e, -1)]
    events.sort(key=lambda e: (e[0], e[1]))  # an end before a start at the same instant
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    return peak


def peak_output_tokens_per_s(ok: Sequence[Sample]) -> float:
    """vLLM's max_output_tokens_per_s: chunk arrivals counted in one-second buckets from the first start."""
    if not ok:
        return 0.0
    first = min(s.start for s in ok)
    last = max(s.start + (s.e2e or 0.0) for s in ok)
    buckets = np.zeros(int(np.ceil(last - first)) + 1)
    for s in ok:
        for t in s.chunk_times():
            bucket = int(t - first)
            if 0 <= bucket < len(buckets):
                buckets[bucket] += 1
    return float(buckets.max())


def queue_times(samples: Iterable[Sample]) -> list[float]:
    """vLLM's client_queue_time: send time minus arrival time (the schedule's, or the start in a closed loop)."""
    return [s.start - (s.scheduled if s.scheduled is not None else 0.0) for s in samples]


def compute_metrics(
    samples: Sequence[Sample], duration: float, slo: dict[str, float] | None = None, *,
    selected_metrics: Sequence[str] = (), selected_percentiles: Sequence[float] = (),
    max_concurrency: int | None = None, request_rate: float = math.inf,
) -> dict:
    """The flat metrics dict of the result (vLLM's key names: mean_ttft_ms, p99_itl_ms, ...).

    Every result has lmserve's STATS for the four latencies; the selected metrics get vLLM's pXX keys for the
    selected percentiles on top (and the client-queue ones exist only where vLLM writes them).
    """
    ok = [s for s in samples if s.success]
    ttfts = [s.ttft for s in ok if s.ttft is not None]
    tpots = [t for t in (tpot(s) for s in ok) if t is not None]
    itls = [gap for s in ok for gap in s.itl]
    e2els = [s.e2e for s in ok if s.e2e is not None]
    total_input = sum(s.input_len for s in ok)
    total_output = sum(s.output_len for s in ok)
    per_s = 1.0 / duration if duration > 0 else 0.0
    out: dict = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(samples) - len(ok),
        "timed_out": sum(1 for s in samples if s.timed_out),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) * per_s,
        "output_throughput": total_output * per_s,
        "total_token_throughput": (total_input + total_output) * per_s,
        "max_output_tokens_per_s": peak_output_tokens_per_s(ok),
        "max_concurrent_requests": max_concurrent(ok),
        "slo_ms": slo or {},
        "good_completed": None,
        "request_goodput": None,
    }
    if slo:
        good = sum(1 for s in ok if meets_slo(s, slo))
        out["good_completed"], out["request_goodput"] = good, good * per_s
    series: dict[str, list[float]] = {"ttft": ttfts, "tpot": tpots, "itl": itls, "e2el": e2els}
    for name, values in series.items():
        for stat, value in distribution(values).items():
            out[f"{stat}_{name}_ms"] = value
    if max_concurrency is not None:
        series["client_queue_time"] = queue_times(ok)
        if math.isfinite(request_rate):
            series["e2el_including_client_queue"] = [q + (s.e2e or 0.0) for q, s in zip(queue_times(ok), ok)]
    for name in selected_metrics:
        values = series.get(name)
        if values is None:
            continue  # vLLM reports the client queue only with --max-concurrency (and a finite rate)
        ms = np.asarray(values, dtype=np.float64) * 1000.0
        stats = distribution(values)
        out.update({f"mean_{name}_ms": stats["mean"], f"median_{name}_ms": stats["median"],
                    f"std_{name}_ms": stats["std"]})
        for p in selected_percentiles:
            out[f"{percentile_key(p)}_{name}_ms"] = float(np.percentile(ms, p)) if len(ms) else None
    return out


def length_stats(values: Sequence[int]) -> dict[str, float | int | None]:
    if not values:
        return {"count": 0, "mean": None, "median": None, "min": None, "max": None}
    arr = np.asarray(values)
    return {"count": len(values), "mean": float(arr.mean()), "median": float(np.median(arr)), "min": int(arr.min()),
            "max": int(arr.max())}
