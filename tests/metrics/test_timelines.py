"""Timelines from synthetic engine messages: intervals, preemptions, aborts, n > 1, and Prometheus observation."""

from __future__ import annotations

import json

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from lmserve.engine.messages import StepOutputs
from lmserve.engine.outputs import EngineCoreOutput
from lmserve.frontend.timelines import KEPT_FINISHED, TimelineTracker
from lmserve.metrics.prometheus import PrometheusMetrics
from lmserve.metrics.recorder import KEPT_SPANS, StatsRecorder
from lmserve.metrics.stats import RequestTimeline, StepRecord, StepSpan


def step(index: int, start: float, end: float, prefill=None, decode=None, preempted=()) -> StepRecord:
    return StepRecord(index, start, end, forward_s=(end - start) / 2, prefill=prefill or {}, decode=decode or {},
                      preempted=list(preempted), num_running=1, num_waiting=0)


def out(request_id: str, tokens: int = 1, finish: str | None = None) -> EngineCoreOutput:
    return EngineCoreOutput(request_id, list(range(tokens)), finish_reason=finish)


def test_intervals_by_hand() -> None:
    t = RequestTimeline("r", "r", arrival=10.0, input_processed=10.01, queued=10.02, scheduled=10.5,
                        first_token=11.0, first_chunk=11.1, finished=12.2, num_output_tokens=4)
    t.steps = [StepSpan(0, 10.5, 11.0, 20, True, 1), StepSpan(1, 11.2, 11.4, 1, False, 1),
               StepSpan(2, 11.4, 11.5, 0, True, 0),  # a step without a token is no ITL sample
               StepSpan(3, 11.6, 11.8, 1, False, 1), StepSpan(4, 11.9, 12.0, 1, False, 1)]
    assert t.input_processing_time == pytest.approx(0.01)
    assert t.queue_time == pytest.approx(0.48)
    assert t.ttft == pytest.approx(1.0)
    assert t.prefill_time == pytest.approx(0.5)
    assert t.decode_time == pytest.approx(1.0)  # first token 11.0 -> last token 12.0
    assert t.tpot == pytest.approx(1.0 / 3)
    assert t.e2e_latency == pytest.approx(2.2)
    assert t.inter_token_latencies == pytest.approx([0.4, 0.4, 0.2])
    d = t.to_dict()
    assert d["stamps"]["first_token"] == pytest.approx(1.0) and d["stamps"]["last_byte"] is None
    assert d["steps"][0] == [0, 0.5, 1.0, 20, 1, 1]


def test_tracker_fills_stamps_from_steps_and_outputs() -> None:
    tracker = TimelineTracker()
    tracker.add("p", ["p"], arrival=1.0, input_processed=1.1, num_prompt_tokens=20)
    tracker.on_engine_message(StepOutputs([], queued={"p": 1.2}))
    tracker.on_engine_message(StepOutputs([], step=step(0, 1.3, 1.4, prefill={"p": 16})))
    tracker.on_engine_message(StepOutputs([out("p")], step=step(1, 1.5, 1.6, prefill={"p": 4})))
    tracker.on_text("p", has_text=False, num_output_tokens=1, finish_reason=None)  # held back
    tracker.on_engine_message(StepOutputs([out("p")], step=step(2, 1.7, 1.8, decode={"p": 1}, preempted=["x"])))
    tracker.on_text("p", has_text=True, num_output_tokens=2, finish_reason=None)
    tracker.on_engine_message(StepOutputs([], step=step(3, 1.9, 2.0, preempted=["p"])))
    tracker.on_engine_message(StepOutputs([out("p", finish="length")], step=step(4, 2.1, 2.3, prefill={"p": 22})))
    tracker.on_text("p", has_text=True, num_output_tokens=3, finish_reason="length")
    [t] = tracker.get("p")
    assert (t.queued, t.scheduled, t.first_token) == (1.2, 1.3, 1.6)
    assert t.first_chunk is not None and t.first_chunk >= t.first_token
    assert t.finished >= t.first_chunk and t.finish_reason == "length"
    assert t.preemptions == [1.9]
    assert [(s.index, s.positions, s.prefill, s.new_tokens) for s in t.steps] == [
        (0, 16, True, 0), (1, 4, True, 1), (2, 1, False, 1), (4, 22, True, 1)]
    assert t.num_output_tokens == 3
    assert tracker.pop("p") == [t] and tracker.get("p") == []


def test_abort_before_scheduling_and_n_children() -> None:
    tracker = TimelineTracker()
    tracker.add("q", ["q-0", "q-1"], arrival=1.0, input_processed=1.0, num_prompt_tokens=5)
    tracker.on_engine_message(StepOutputs([out("q-0"), out("q-1")], step=step(0, 1.1, 1.2, prefill={"q-0": 5})))
    tracker.on_text("q-0", True, 1, "stop")
    tracker.abort("q")
    first, second = tracker.get("q")
    assert first.finish_reason == "stop" and second.finish_reason == "abort"
    assert first.counts_prompt and not second.counts_prompt
    assert second.scheduled is None and second.finished is not None


def test_finished_timelines_nobody_takes_are_bounded() -> None:
    tracker = TimelineTracker()
    for i in range(KEPT_FINISHED + 50):
        tracker.add(f"r{i}", [f"r{i}"], 0.0, 0.0, 1)
        tracker.abort(f"r{i}")
    tracker.add("live", ["live"], 0.0, 0.0, 1)
    assert len(tracker.by_parent) <= KEPT_FINISHED + 1
    assert tracker.get("live") and not tracker.get("r0")


def test_prometheus_observes_requests_and_steps() -> None:
    metrics = PrometheusMetrics("m")
    t = RequestTimeline("r", "r", arrival=0.0, input_processed=0.001, queued=0.002, scheduled=0.003,
                        first_token=0.1, first_chunk=0.11, finished=0.5, num_prompt_tokens=7, num_output_tokens=3,
                        finish_reason="stop")
    t.steps = [StepSpan(0, 0.003, 0.1, 7, True, 1), StepSpan(1, 0.2, 0.3, 1, False, 1),
               StepSpan(2, 0.35, 0.45, 1, False, 1)]
    child = RequestTimeline("r-1", "r", arrival=0.0, num_prompt_tokens=7, num_output_tokens=2, finish_reason="abort",
                            counts_prompt=False)
    metrics.observe_request(t)
    metrics.observe_request(child)
    metrics.observe_step(step(0, 0.0, 0.25, prefill={"a": 30}, decode={"b": 1, "c": 1}))
    samples = {
        (s.name, s.labels.get("finished_reason")): s.value
        for family in text_string_to_metric_families(generate_latest(metrics.registry).decode())
        for s in family.samples
        if "le" not in s.labels
    }
    assert samples[("lmserve:prompt_tokens_total", None)] == 7  # once per prompt
    assert samples[("lmserve:generation_tokens_total", None)] == 5
    assert samples[("lmserve:request_success_total", "stop")] == 1
    assert samples[("lmserve:request_success_total", "abort")] == 1
    assert samples[("lmserve:inter_token_latency_seconds_count", None)] == 2
    assert samples[("lmserve:inter_token_latency_seconds_sum", None)] == pytest.approx(0.35)
    assert samples[("lmserve:request_time_per_output_token_seconds_sum", None)] == pytest.approx(0.175)
    assert samples[("lmserve:time_to_first_token_seconds_count", None)] == 1  # the aborted child had none
    assert samples[("lmserve:iteration_tokens_total_sum", None)] == 32
    assert samples[("lmserve:engine_step_seconds_sum", None)] == pytest.approx(0.25)


def test_request_size_histograms_count_each_request_once() -> None:
    """vLLM's request_prompt_tokens, request_generation_tokens, request_params_n, request_params_max_tokens and
    request_inference_time_seconds: an n=2 request is one observation of its prompt, n and max_tokens."""
    metrics = PrometheusMetrics("m")
    first = RequestTimeline("r-0", "r", arrival=0.0, scheduled=0.1, finished=0.6, num_prompt_tokens=7,
                            num_output_tokens=3, n=2, max_tokens=16)
    second = RequestTimeline("r-1", "r", arrival=0.0, scheduled=0.2, finished=0.4, num_prompt_tokens=7,
                             num_output_tokens=5, counts_prompt=False, n=2, max_tokens=16)
    metrics.observe_request(first)
    metrics.observe_request(second)
    samples = {
        s.name: s.value
        for family in text_string_to_metric_families(generate_latest(metrics.registry).decode())
        for s in family.samples
        if "le" not in s.labels
    }
    assert samples["lmserve:request_prompt_tokens_count"] == 1 and samples["lmserve:request_prompt_tokens_sum"] == 7
    assert samples["lmserve:request_params_n_sum"] == 2 and samples["lmserve:request_params_n_count"] == 1
    assert samples["lmserve:request_params_max_tokens_sum"] == 16
    assert samples["lmserve:request_generation_tokens_sum"] == 8
    assert samples["lmserve:request_generation_tokens_count"] == 2
    assert samples["lmserve:request_inference_time_seconds_sum"] == pytest.approx(0.7)


def test_kept_timelines_hold_a_bounded_number_of_spans(tmp_path) -> None:
    """A 32k-step request once kept 32k spans in the dashboard's window (512 of them: ~2 GB). The kept copy holds its
    first and last KEPT_SPANS spans and merges the rest; Prometheus and the request log still see every step."""
    decode_steps = 32_000
    t = RequestTimeline("long", "long", arrival=0.0, input_processed=0.0, queued=0.0, scheduled=0.0, first_token=0.2,
                        first_chunk=0.2, finished=decode_steps * 0.01 + 0.3, num_prompt_tokens=300,
                        num_output_tokens=decode_steps + 1, finish_reason="length")
    t.steps = [StepSpan(0, 0.0, 0.1, 256, True, 0), StepSpan(1, 0.1, 0.2, 44, True, 1)]
    t.steps += [StepSpan(2 + i, 0.2 + i * 0.01, 0.21 + i * 0.01, 1, False, 1) for i in range(decode_steps)]
    full = t.to_dict()
    recorder = StatsRecorder("m", request_log=str(tmp_path / "log.jsonl"))
    recorder.record([t])
    [kept] = recorder.recent_requests
    assert len(kept.steps) <= 2 * KEPT_SPANS + 1
    d = kept.to_dict()
    assert d["steps"][:KEPT_SPANS] == full["steps"][:KEPT_SPANS]
    assert d["steps"][-KEPT_SPANS:] == full["steps"][-KEPT_SPANS:]
    [merged] = [s for s in d["steps"] if len(s) == 7]
    assert merged[6] == len(full["steps"]) - 2 * KEPT_SPANS and merged[4] == 0
    assert sum(s[3] for s in d["steps"]) == sum(s[3] for s in full["steps"])  # positions
    assert sum(s[5] for s in d["steps"]) == sum(s[5] for s in full["steps"])  # tokens
    assert d["intervals"] == full["intervals"] and d["stamps"] == full["stamps"]
    assert len(t.steps) == decode_steps + 2  # the original is untouched
    recorder.close()
    [line] = (tmp_path / "log.jsonl").read_text().splitlines()
    assert json.loads(line)["steps"] == full["steps"]
    itl = {s.name: s.value for f in text_string_to_metric_families(generate_latest(recorder.prometheus.registry)
                                                                   .decode()) for s in f.samples}
    assert itl["lmserve:inter_token_latency_seconds_count"] == decode_steps


def test_compaction_merges_runs_of_each_kind() -> None:
    """Preempted mid-way: the merged middle keeps one span per run, so the waterfall still shows the recompute."""
    t = RequestTimeline("p", "p", arrival=0.0)
    t.steps = [StepSpan(i, i, i + 1, 1, False, 1) for i in range(10)]
    t.steps += [StepSpan(10, 10, 11, 30, True, 1)]  # recomputed after a preemption
    t.steps += [StepSpan(11 + i, 11 + i, 12 + i, 1, False, 1) for i in range(10)]
    ends = [(False, 1, 1)] * 3
    assert [(s.prefill, s.merged, s.positions) for s in t.compacted(3).steps] == [
        *ends, (False, 7, 7), (True, 1, 30), (False, 7, 7), *ends]
    # More runs than kept spans (preempted over and over): the middle becomes one span.
    assert [(s.prefill, s.merged, s.positions) for s in t.compacted(2).steps] == [
        (False, 1, 1), (False, 1, 1), (False, 17, 46), (False, 1, 1), (False, 1, 1)]
    assert t.compacted(20) is t  # short timelines are kept as they are
