"""Timelines, the request log and /metrics on the real server (default model), with a KV cache small enough to
force preemptions."""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_process import Server, start_server, wait_for

from lmserve.metrics.stats import STAMPS

MODEL = "smollm2-135m-instruct"
ORDERED = ("arrival", "input_processed", "queued", "scheduled", "first_token", "first_chunk", "finished", "last_byte")
HISTOGRAMS = (
    "time_to_first_token_seconds", "inter_token_latency_seconds", "request_time_per_output_token_seconds",
    "e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
    "request_decode_time_seconds", "request_input_processing_seconds", "iteration_tokens_total", "engine_step_seconds",
    "request_prompt_tokens", "request_generation_tokens", "request_params_n", "request_params_max_tokens",
    "request_inference_time_seconds",
)
GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "prompt_tokens", "generation_tokens",
            "request_success")


@pytest.fixture(scope="module")
def request_log(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("log") / "requests.jsonl"


@pytest.fixture(scope="module")
def server(tmp_path_factory, request_log: Path) -> Server:
    # 8 MiB of float32 KV is 11 blocks (176 positions): four 120-token requests cannot all fit.
    srv = start_server(tmp_path_factory.mktemp("server"), "--kv-cache-memory", "8MiB", "--request-log",
                       str(request_log))
    yield srv
    srv.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def scrape(server: Server) -> dict[str, float]:
    """Every sample of /metrics, keyed by name plus labels other than model_name and engine (one engine here)."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k not in ("model_name", "engine", "le"))
            key = sample.name + (f"{{{labels}}}" if labels else "")
            if "le" in sample.labels:
                continue
            samples[key] = sample.value
    return samples


def log_lines(path: Path) -> dict[str, dict]:
    if not path.exists():
        return {}
    return {line["request_id"]: line for line in map(json.loads, path.read_text().splitlines())}


def assert_ordered(line: dict) -> None:
    stamps = line["stamps"]
    present = [(name, stamps[name]) for name in ORDERED if stamps[name] is not None]
    values = [v for _, v in present]
    assert values == sorted(values), f"stamps out of order: {present}"
    assert stamps["arrival"] == 0.0
    steps = line["steps"]
    starts = [s[1] for s in steps]
    assert starts == sorted(starts)
    if stamps["scheduled"] is not None:
        assert steps and steps[0][1] == stamps["scheduled"]
    assert line["num_preemptions"] == len(line["preemptions"])


def test_metrics_move_by_the_responses_usage(client: openai.OpenAI, server: Server, request_log: Path) -> None:
    before = scrape(server)
    names = {k.split("{")[0] for k in before}
    for name in GAUGES:
        assert f"lmserve:{name}" in names
    for name in COUNTERS:
        if name != "request_success":  # a labelled counter has no sample before its first request
            assert f"lmserve:{name}_total" in names

    usages, ids = [], []
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                          temperature=0)
    usages.append(chat.usage)
    ids.append(chat.id)
    done = client.completions.create(model=MODEL, prompt="One two three", max_tokens=5, temperature=0, n=2, seed=1)
    usages.append(done.usage)
    ids += [f"{done.id}-0-0", f"{done.id}-0-1"]
    stream = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=7, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    usages.append(chunks[-1].usage)
    ids.append(f"{chunks[-1].id}-0")
    prompt_tokens = sum(u.prompt_tokens for u in usages)
    completion_tokens = sum(u.completion_tokens for u in usages)

    # Recorded after the last byte is written: the scrape may come a moment before it.
    def moved() -> dict | None:
        after = scrape(server)
        delta = after["lmserve:prompt_tokens_total"] - before["lmserve:prompt_tokens_total"]
        return after if delta == prompt_tokens else None

    after = wait_for(moved)
    assert after, "prompt_tokens_total did not move by the usage's prompt tokens"
    assert after["lmserve:generation_tokens_total"] - before["lmserve:generation_tokens_total"] == completion_tokens
    finished = sum(v for k, v in after.items() if k.startswith("lmserve:request_success_total"))
    assert finished - sum(v for k, v in before.items() if k.startswith("lmserve:request_success_total")) == 4
    assert after["lmserve:e2e_request_latency_seconds_count"] - before.get(
        "lmserve:e2e_request_latency_seconds_count", 0) == 4
    for name in HISTOGRAMS:
        assert after[f"lmserve:{name}_count"] > 0, name
    # One ITL sample per gap between token-producing steps: (tokens - 1) per request without speculation.
    itl = after["lmserve:inter_token_latency_seconds_count"] - before.get("lmserve:inter_token_latency_seconds_count", 0)
    assert itl == completion_tokens - 4

    lines = wait_for(lambda: (found := log_lines(request_log)) and all(i in found for i in ids) and found)
    for request_id in ids:
        line = lines[request_id]
        assert set(line["stamps"]) == set(STAMPS)
        assert line["finish_reason"] in ("stop", "length")
        assert line["stamps"]["last_byte"] is not None
        assert_ordered(line)
    assert lines[chat.id]["num_output_tokens"] == chat.usage.completion_tokens


def test_preempted_requests_keep_ordered_timelines(client: openai.OpenAI, server: Server, request_log: Path) -> None:
    before = scrape(server)["lmserve:num_preemptions_total"]
    ids: list[str] = []

    def run(i: int) -> None:
        out = client.completions.create(model=MODEL, prompt=f"Story number {i}: once upon a time", max_tokens=110,
                                        temperature=0, extra_body={"ignore_eos": True})
        ids.append(f"{out.id}-0")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert scrape(server)["lmserve:num_preemptions_total"] > before
    lines = wait_for(lambda: (found := log_lines(request_log)) and all(i in found for i in ids) and found)
    preempted = [lines[i] for i in ids if lines[i]["num_preemptions"] > 0]
    assert preempted, "the small KV cache should have preempted a request"
    for request_id in ids:
        line = lines[request_id]
        assert_ordered(line)
        assert line["num_output_tokens"] == 110 and line["finish_reason"] == "length"
    for line in preempted:
        # Recomputed positions after a preemption: the steps cover more than prompt + output - 1.
        computed = sum(step[3] for step in line["steps"])
        assert computed > line["num_prompt_tokens"] + line["num_output_tokens"] - 1
        assert all(0 <= t <= line["stamps"]["finished"] for t in line["preemptions"])


def test_aborted_stream_is_logged_with_ordered_stamps(server: Server, request_log: Path) -> None:
    body = {"model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": 150, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        request_id = json.loads(first[len("data: "):])["id"] + "-0"
        for _ in range(3):
            next(lines)
    line = wait_for(lambda: log_lines(request_log).get(request_id))
    assert line, "the aborted request was not logged"
    assert line["finish_reason"] == "abort"
    assert line["stamps"]["last_byte"] is None and line["stamps"]["first_chunk"] is not None
    assert 0 < line["num_output_tokens"] < 150
    assert_ordered(line)
    assert scrape(server).get("lmserve:request_success_total{finished_reason=abort}", 0) >= 1


def test_timeline_in_the_response_when_asked(client: openai.OpenAI) -> None:
    done = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=4,
                                          temperature=0, extra_body={"return_timeline": True})
    timelines = done.model_extra["timelines"]
    assert len(timelines) == 1 and timelines[0]["request_id"] == done.id
    stamps = timelines[0]["stamps"]
    assert stamps["finished"] is not None and stamps["last_byte"] is None  # the body cannot hold its own last byte
    assert timelines[0]["num_output_tokens"] == done.usage.completion_tokens

    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=2)
    assert "timelines" not in (plain.model_extra or {})

    chunks = list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, stream=True,
                                            extra_body={"return_timeline": True}))
    assert "timelines" not in (chunks[0].model_extra or {})
    last = chunks[-1].model_extra["timelines"]
    assert last[0]["request_id"] == f"{chunks[-1].id}-0" and last[0]["stamps"]["first_token"] is not None
