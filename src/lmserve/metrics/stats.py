"""Per-request timelines: the stamps of one request's life, and the intervals derived from them.

Stamps are `lmserve.metrics.clock.now()` readings, taken where the event happens:
  arrival          API: the HTTP request arrived (before the body was parsed)
  input_processed  front-end: templated and tokenized
  queued           engine: the engine core took the request in
  scheduled        engine: start of the first step that computed any of its positions
  first_token      engine: end of the step that sampled its first token
  first_chunk      front-end: the first text chunk was ready to send (after the detokenizer's hold-back)
  finished         front-end: its final output was processed (or it was aborted)
  last_byte        API: the response's last byte was written (absent for aborted requests)
`steps` holds every engine step that computed positions for it; `preemptions` the start of each step that
preempted it. A timeline kept after its request is done (the dashboard's window of recent requests) is `compacted`:
its first and last spans stay as they were, the steps between are merged into one span per run of the same kind.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Any

import msgspec

from lmserve.metrics.clock import wall_time_of

STAMPS = ("arrival", "input_processed", "queued", "scheduled", "first_token", "first_chunk", "finished", "last_byte")


@dataclass
class StepSpan:
    """One engine step's work on one request."""

    index: int  # the engine's step counter
    start: float
    end: float
    positions: int
    prefill: bool
    new_tokens: int = 0  # tokens this step sampled for the request (0 for a non-final prefill chunk)
    merged: int = 1  # engine steps this span stands for (> 1 only in a compacted timeline): their sums, first to last


def merge_runs(spans: list[StepSpan]) -> list[StepSpan]:
    """One span per run of consecutive spans of the same kind (prefill or decode): positions and tokens summed."""
    runs: list[StepSpan] = []
    for span in spans:
        last = runs[-1] if runs else None
        if last is not None and last.prefill == span.prefill:
            last.end = span.end
            last.positions += span.positions
            last.new_tokens += span.new_tokens
            last.merged += span.merged
        else:
            runs.append(dataclasses.replace(span))
    return runs


@dataclass
class RequestTimeline:
    request_id: str  # the engine request (one per choice when n > 1)
    parent_id: str  # the front-end request it belongs to
    arrival: float
    input_processed: float | None = None
    queued: float | None = None
    scheduled: float | None = None
    first_token: float | None = None
    first_chunk: float | None = None
    finished: float | None = None
    last_byte: float | None = None
    steps: list[StepSpan] = field(default_factory=list)
    preemptions: list[float] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    counts_prompt: bool = True  # False for the 2nd..nth choice of a prompt: its prompt is counted once
    n: int = 1  # the request's sampling parameters, for the request-size histograms
    max_tokens: int | None = None

    # ---- derived intervals (seconds; None when a stamp is missing) --------------------------------------------
    @staticmethod
    def _between(start: float | None, end: float | None) -> float | None:
        return None if start is None or end is None else end - start

    @property
    def input_processing_time(self) -> float | None:
        return self._between(self.arrival, self.input_processed)

    @property
    def inference_time(self) -> float | None:
        return self._between(self.scheduled, self.finished)

    @property
    def queue_time(self) -> float | None:
        return self._between(self.queued, self.scheduled)

    @property
    def ttft(self) -> float | None:
        return self._between(self.arrival, self.first_token)

    @property
    def prefill_time(self) -> float | None:
        return self._between(self.scheduled, self.first_token)

    @property
    def decode_time(self) -> float | None:
        return self._between(self.first_token, self.last_token)

    @property
    def e2e_latency(self) -> float | None:
        return self._between(self.arrival, self.finished)

    @property
    def last_token(self) -> float | None:
        ends = [s.end for s in self.steps if s.new_tokens]
        return ends[-1] if ends else None

    @property
    def tpot(self) -> float | None:
        """Decode time per output token after the first (vLLM's request_time_per_output_token)."""
        decode = self.decode_time
        if decode is None or self.num_output_tokens < 2:
            return None
        return decode / (self.num_output_tokens - 1)

    @property
    def inter_token_latencies(self) -> list[float]:
        """Gaps between the steps that produced its tokens (one per step, however many tokens a step gave)."""
        ends = [s.end for s in self.steps if s.new_tokens]
        return [b - a for a, b in itertools.pairwise(ends)]

    # ---- memory -----------------------------------------------------------------------------------------------
    def compacted(self, kept_spans: int) -> RequestTimeline:
        """This timeline with at most about 2 * kept_spans + runs spans: a request of 32k decode steps holds 32k spans
        while it runs; kept afterwards (hundreds of them), it holds its first and last `kept_spans` spans and the
        steps between merged into one span per run of the same kind (at most `kept_spans` runs, else one). Positions
        and tokens keep their totals, so the waterfall's stages and the intervals read the same."""
        if len(self.steps) <= 2 * kept_spans + 1:
            return self
        middle = merge_runs(self.steps[kept_spans:-kept_spans])
        if len(middle) > kept_spans:  # preempted over and over: one span for all of it
            first, last = middle[0], middle[-1]
            middle = [StepSpan(first.index, first.start, last.end, sum(s.positions for s in middle), False,
                               sum(s.new_tokens for s in middle), sum(s.merged for s in middle))]
        steps = self.steps[:kept_spans] + middle + self.steps[-kept_spans:]
        return dataclasses.replace(self, steps=steps, preemptions=list(self.preemptions))

    # ---- export --------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: stamps in seconds since arrival, steps as [index, start, end, positions, prefill, tokens]
        (and a seventh, the number of engine steps, for a span that merges several: see `compacted`)."""

        def offset(stamp: float | None) -> float | None:
            return None if stamp is None else round(stamp - self.arrival, 6)

        return {
            "request_id": self.request_id,
            "parent_id": self.parent_id,
            "arrival_unix": round(wall_time_of(self.arrival), 6),
            "stamps": {name: offset(getattr(self, name)) for name in STAMPS},
            "steps": [
                [s.index, offset(s.start), offset(s.end), s.positions, int(s.prefill), s.new_tokens]
                + ([s.merged] if s.merged > 1 else [])
                for s in self.steps
            ],
            "preemptions": [offset(t) for t in self.preemptions],
            "num_preemptions": len(self.preemptions),
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_output_tokens": self.num_output_tokens,
            "num_cached_tokens": self.num_cached_tokens,
            "finish_reason": self.finish_reason,
            "intervals": {
                "input_processing": self.input_processing_time,
                "queue": self.queue_time,
                "prefill": self.prefill_time,
                "decode": self.decode_time,
                "ttft": self.ttft,
                "tpot": self.tpot,
                "e2e": self.e2e_latency,
            },
        }


# ---- engine records (stamped in the engine process, read by the dashboard, Prometheus and the planner)


class EngineStats(msgspec.Struct):
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    kv_blocks_cached_free: int = 0
    kv_cache_usage_perc: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_requests_aborted: int = 0
    num_steps: int = 0
    # Speculative decoding (vLLM's spec_decode_* counters): steps that verified drafts, drafts proposed and kept,
    # and how often the draft at each position (0 = the first) was kept.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = []
    # Prefill/decode disaggregation (--kv-transfer-config): prompt tokens whose KV a consumer loaded instead of
    # computing, and blocks a producer stored.
    kv_transfer_loaded_tokens: int = 0
    kv_transfer_saved_blocks: int = 0
    # ... and what went wrong without ending the engine: requests whose stored blocks could not be read (they
    # computed them), blocks that could not be stored (a full or failing disk).
    kv_transfer_failed_loads: int = 0
    kv_transfer_failed_saves: int = 0
    # Mixtures of experts: tokens routed to each expert so far, by MoE layer index (each token once for each of its
    # top-k experts): an expert-parallel layout's imbalance shows here.
    moe_expert_tokens: dict[str, list[int]] = {}
    # Only for the request ids a GetStats asked about: positions handed to the model so far (computed, or in a step
    # under way), and status; once a request is "gone" its positions no longer change.
    request_positions: dict[str, int] = {}
    request_status: dict[str, str] = {}
    # Under data parallel, each replica's own (the fields above are then their sums); empty for one engine.
    engines: list[EngineStats] = []


# Counts that add up across data-parallel replicas (kv_cache_usage_perc is recomputed from the block counts).
SUMMED_STATS = ("num_requests_running", "num_requests_waiting", "kv_blocks_total", "kv_blocks_used", "kv_blocks_free",
                "kv_blocks_cached_free", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions",
                "num_requests_aborted", "num_steps", "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                "spec_decode_num_accepted_tokens", "kv_transfer_loaded_tokens", "kv_transfer_saved_blocks",
                "kv_transfer_failed_loads", "kv_transfer_failed_saves")


def sum_engine_stats(replicas: list[EngineStats]) -> EngineStats:
    """One view of several replicas: the counts summed, each replica's own stats under `engines`."""
    total = EngineStats(**{name: sum(getattr(r, name) for r in replicas) for name in SUMMED_STATS})
    total.kv_cache_usage_perc = total.kv_blocks_used / total.kv_blocks_total if total.kv_blocks_total else 0.0
    for replica in replicas:  # each replica's own experts' counts, added up
        for layer, counts in replica.moe_expert_tokens.items():
            so_far = total.moe_expert_tokens.setdefault(layer, [0] * len(counts))
            total.moe_expert_tokens[layer] = [a + b for a, b in zip(so_far, counts, strict=True)]
    per_position = [r.spec_decode_num_accepted_tokens_per_pos for r in replicas]
    total.spec_decode_num_accepted_tokens_per_pos = [sum(c) for c in zip(*per_position, strict=True)] \
        if all(per_position) else []
    for replica in replicas:
        # A request lives on one replica; the others report it "gone" with no positions.
        for request_id, positions in replica.request_positions.items():
            total.request_positions[request_id] = total.request_positions.get(request_id, 0) + positions
        for request_id, status in replica.request_status.items():
            if total.request_status.get(request_id, "gone") == "gone":
                total.request_status[request_id] = status
    total.engines = [msgspec.structs.replace(r, request_positions={}, request_status={}) for r in replicas]
    return total


class StepRecord(msgspec.Struct):
    """What one engine step did, stamped with the engine's clock (lmserve.metrics.clock)."""

    index: int
    start: float
    end: float
    forward_s: float  # of end - start, the time inside the model runner (forward + sampling)
    prefill: dict[str, int]  # request id -> prompt positions computed (recomputation after preemption included)
    decode: dict[str, int]  # request id -> positions computed while generating (1 each without speculation)
    preempted: list[str]
    num_running: int
    num_waiting: int
    num_sampled: int = 0  # tokens sampled (one per request whose last scheduled position was its newest token)
    draft_tokens: int = 0  # speculative decoding: drafts this step verified (among the decode positions)
    accepted_tokens: int = 0  # and those it kept (each one a token beyond num_sampled)
    engine: int = 0  # the data-parallel replica that ran it (set by the front-end's client, not the engine)

    @property
    def num_positions(self) -> int:
        return sum(self.prefill.values()) + sum(self.decode.values())

    @property
    def duration_s(self) -> float:
        return self.end - self.start
