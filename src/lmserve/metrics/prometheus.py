"""Prometheus export with vLLM's metric names under the `lmserve:` prefix, so dashboards built for vLLM port.

Two kinds of series: the engine's gauges and counters as of the scrape (asked of the engine on each scrape, so
nothing goes stale), and per-request / per-step histograms and counters observed as requests finish and steps run.
docs/metrics.md says what each one measures, between which timeline stamps.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from lmserve.metrics.stats import RequestTimeline, StepRecord

ENGINE_GAUGES = {
    "num_requests_running": "Requests in the engine's running set.",
    "num_requests_waiting": "Requests waiting to be scheduled.",
    "kv_cache_usage_perc": "Fraction of KV cache blocks in use (1 = full).",
    "kv_blocks_used": "KV cache blocks held by requests.",
    "kv_blocks_free": "KV cache blocks free (cached prefixes included).",
    "kv_blocks_total": "KV cache blocks in the pool.",
}
ENGINE_COUNTERS = {
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "prefix_cache_hits": "Prompt tokens found in the prefix cache.",
    "num_preemptions": "Requests preempted to free KV cache blocks.",
    "num_requests_aborted": "Requests aborted before they finished.",
    "spec_decode_num_drafts": "Speculative decoding: steps in which a request verified drafts.",
    "spec_decode_num_draft_tokens": "Speculative decoding: draft tokens proposed.",
    "spec_decode_num_accepted_tokens": "Speculative decoding: draft tokens accepted.",
    "kv_transfer_loaded_tokens": "Disaggregation: prompt tokens whose KV was loaded from a prefill instance.",
    "kv_transfer_saved_blocks": "Disaggregation: KV blocks stored for a decode instance.",
    "kv_transfer_failed_loads": "Disaggregation: requests whose stored KV blocks could not be read (computed instead).",
    "kv_transfer_failed_saves": "Disaggregation: KV blocks that could not be stored (a full or failing disk).",
}
PER_POSITION_COUNTER = ("spec_decode_num_accepted_tokens_per_pos",
                        "Speculative decoding: draft tokens accepted, by their position among a step's drafts.")

# vLLM's buckets, so that histogram_quantile over both servers compares like with like.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
INPUT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# vLLM's 1-2-5 series for request sizes (tokens, n, max_tokens), up to 1e6.
SIZE_BUCKETS = tuple(float(m * 10**e) for e in range(7) for m in (1, 2, 5) if m * 10**e <= 10**6)


class EngineStatsCollector:
    """The engine's gauges and counters as of the current scrape; /metrics refreshes `stats` just before rendering.

    A custom collector rather than Gauge objects: the values live in the engine, so there is nothing to keep in
    sync between scrapes. One series per engine replica, labelled `engine` ("0", "1", ...) as vLLM's: the replicas'
    own values are in `stats["engines"]`; stats without it are one engine's, "0".
    """

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: dict[str, Any] = {}

    def collect(self) -> Iterator[Metric]:
        stats = dict(self.stats)
        replicas = stats.get("engines") or [stats]
        for names, family in ((ENGINE_GAUGES, GaugeMetricFamily), (ENGINE_COUNTERS, CounterMetricFamily)):
            for name, documentation in names.items():
                present = [r for r in replicas if name in r]
                if not present:
                    continue
                metric = family(f"lmserve:{name}", documentation, labels=["model_name", "engine"])
                for replica in present:
                    metric.add_metric([self.model_name, str(replica.get("engine", "0"))], float(replica[name]))
                yield metric
        name, documentation = PER_POSITION_COUNTER
        present = [r for r in replicas if r.get(name)]
        if present:
            metric = CounterMetricFamily(f"lmserve:{name}", documentation, labels=["model_name", "engine", "position"])
            for replica in present:
                for position, count in enumerate(replica[name]):
                    metric.add_metric([self.model_name, str(replica.get("engine", "0")), str(position)], float(count))
            yield metric
        present = [r for r in replicas if r.get("moe_expert_tokens")]
        if present:
            metric = CounterMetricFamily(
                "lmserve:moe_expert_tokens", "Tokens routed to each expert of each mixture-of-experts layer (a token "
                "once for each of its top-k experts).", labels=["model_name", "engine", "layer", "expert"])
            for replica in present:
                for layer, counts in sorted(replica["moe_expert_tokens"].items(), key=lambda item: int(item[0])):
                    for expert, count in enumerate(counts):
                        metric.add_metric([self.model_name, str(replica.get("engine", "0")), layer, str(expert)],
                                          float(count))
            yield metric


class PrometheusMetrics:
    """Every `lmserve:` series, in a registry of its own (tests build many servers in one process)."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.engine = EngineStatsCollector(model_name)
        self.registry.register(self.engine)
        labels = {"model_name": model_name}

        def histogram(name: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
            metric = Histogram(f"lmserve:{name}", documentation, ["model_name"], registry=self.registry,
                               buckets=buckets)
            return metric.labels(**labels)

        def counter(name: str, documentation: str) -> Counter:
            return Counter(f"lmserve:{name}", documentation, ["model_name"], registry=self.registry).labels(**labels)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests (once per prompt).")
        self.generation_tokens = counter("generation_tokens", "Tokens generated for finished requests.")
        self._success = Counter("lmserve:request_success", "Finished requests, by finish reason.",
                                ["model_name", "finished_reason"], registry=self.registry)
        self._model_name = model_name
        self.ttft = histogram("time_to_first_token_seconds",
                              "Arrival at the API to the end of the step that sampled the first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds",
                             "Gap between consecutive engine steps that produced tokens for a request.", ITL_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds",
                              "Decode time divided by (output tokens - 1), per request.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds",
                             "Arrival at the API to the final output processed in the front-end.", REQUEST_BUCKETS)
        self.queue = histogram("request_queue_time_seconds",
                               "Taken in by the engine to first scheduled.", REQUEST_BUCKETS)
        self.prefill = histogram("request_prefill_time_seconds",
                                 "First scheduled to the first token sampled.", REQUEST_BUCKETS)
        self.decode = histogram("request_decode_time_seconds",
                                "First token to last token sampled.", REQUEST_BUCKETS)
        self.input_processing = histogram("request_input_processing_seconds",
                                          "Arrival at the API to templated and tokenized.", INPUT_BUCKETS)
        self.iteration_tokens = histogram("iteration_tokens_total",
                                          "Positions computed per engine step (prefill and decode).",
                                          ITERATION_TOKEN_BUCKETS)
        self.step_time = histogram("engine_step_seconds", "Duration of one engine step (schedule, forward, update).",
                                   STEP_BUCKETS)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens of each finished request.",
                                               SIZE_BUCKETS)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Tokens generated for each finished request.", SIZE_BUCKETS)
        self.request_params_n = histogram("request_params_n", "The n of each finished request.", SIZE_BUCKETS)
        self.request_params_max_tokens = histogram("request_params_max_tokens",
                                                   "The max_tokens of each finished request.", SIZE_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds",
                                        "First scheduled to finished: the time a request spent being computed.",
                                        REQUEST_BUCKETS)

    def observe_step(self, step: StepRecord) -> None:
        self.iteration_tokens.observe(step.num_positions)
        self.step_time.observe(step.duration_s)

    def observe_request(self, timeline: RequestTimeline) -> None:
        if timeline.counts_prompt:  # once per request, not once per choice
            self.prompt_tokens.inc(timeline.num_prompt_tokens)
            self.request_prompt_tokens.observe(timeline.num_prompt_tokens)
            self.request_params_n.observe(timeline.n)
            if timeline.max_tokens is not None:
                self.request_params_max_tokens.observe(timeline.max_tokens)
        self.generation_tokens.inc(timeline.num_output_tokens)
        self.request_generation_tokens.observe(timeline.num_output_tokens)
        self._success.labels(self._model_name, timeline.finish_reason or "unknown").inc()
        for histogram, value in (
            (self.ttft, timeline.ttft), (self.tpot, timeline.tpot), (self.e2e, timeline.e2e_latency),
            (self.queue, timeline.queue_time), (self.prefill, timeline.prefill_time),
            (self.decode, timeline.decode_time), (self.input_processing, timeline.input_processing_time),
            (self.inference_time, timeline.inference_time),
        ):
            if value is not None:
                histogram.observe(value)
        for gap in timeline.inter_token_latencies:
            self.itl.observe(gap)


class MergedRegistries:
    """Several models' registries as one scrape: a family that more than one model has (every `lmserve:` series)
    once, with each model's samples under its own model_name label; Prometheus' text format allows a family once."""

    def __init__(self, registries: Sequence[CollectorRegistry]) -> None:
        self.registries = list(registries)

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for registry in self.registries:
            for family in registry.collect():
                known = families.get(family.name)
                if known is None:
                    families[family.name] = family  # collect() builds each family afresh: ours to extend
                else:
                    known.samples.extend(family.samples)
        yield from families.values()


def merged_registry(registries: Sequence[CollectorRegistry]) -> CollectorRegistry:
    """One registry to scrape: the only one, or the models' merged (MergedRegistries)."""
    if len(registries) == 1:
        return registries[0]
    merged = CollectorRegistry(auto_describe=False)
    merged.register(MergedRegistries(registries))
    return merged
