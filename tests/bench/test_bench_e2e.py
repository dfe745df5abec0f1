"""`lmserve bench` against a real `lmserve serve` (default model, CPU): one server for the whole module."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_process import Server, start_server

from lmserve.bench import cli
from lmserve.bench.metrics import METRICS, STATS
from lmserve.bench.result import RESULT_KEYS, read_result

LMSERVE = Path(sys.executable).parent / "lmserve"
METRIC_KEYS = (
    "duration", "completed", "failed", "timed_out", "total_input_tokens", "total_output_tokens",
    "request_throughput", "output_throughput", "total_token_throughput", "request_goodput",
    "max_output_tokens_per_s", "max_concurrent_requests",
    *(f"{stat}_{metric}_ms" for metric in METRICS for stat in STATS),
)
SAMPLE_KEYS = {"index", "start", "scheduled", "prompt_len", "output_len", "ttft", "itl", "e2e", "success", "error",
               "timed_out", "http_status"}


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Server:
    srv = start_server(tmp_path_factory.mktemp("bench-server"), "--max-num-seqs", "8")
    try:
        yield srv
    finally:
        srv.stop()


def test_cli_run_writes_every_field_and_a_plot(server, tmp_path):
    out, png = tmp_path / "out.json", tmp_path / "out.png"
    proc = subprocess.run(
        [str(LMSERVE), "bench", "--base-url", server.base_url, "--num-prompts", "6", "--max-concurrency", "2",
         "--random-input-len", "32", "--random-output-len", "8", "--output", str(out), "--plot", str(png),
         "--disable-tqdm", "--slo", "ttft=60000"],
        check=False, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Serving Benchmark Result" in proc.stdout and "Mean TTFT (ms):" in proc.stdout
    result = json.loads(out.read_text())
    missing = [k for k in (*RESULT_KEYS, *METRIC_KEYS) if k not in result]
    assert not missing
    assert (result["completed"], result["failed"], result["timed_out"]) == (6, 0, 0)
    assert len(result["samples"]) == 6 and all(SAMPLE_KEYS <= set(s) for s in result["samples"])
    assert result["arrival_pattern"] == {"kind": "closed", "request_rate": "inf", "burstiness": 1.0,
                                         "max_concurrency": 2}
    assert result["token_count_source"] == "usage" and result["prefix_cache"] == "cold"
    assert result["lengths"]["input"]["min"] == result["lengths"]["input"]["max"] == 32
    assert result["total_input_tokens"] == 6 * 32 and result["max_concurrent_requests"] <= 2
    assert result["versions"]["server"]["version"] and result["versions"]["python"]
    assert result["machine"]["logical_cores"] >= 1 and result["config"]["max_concurrency"] == 2
    assert result["request_goodput"] > 0 and result["mean_ttft_ms"] > 0 and result["p99_itl_ms"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert read_result(out).completed == 6 and len(result["ttfts"]) == 6  # --output: vLLM's detailed shape too


def running_requests(base_url: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        if family.name == "lmserve:num_requests_running":
            return max((s.value for s in family.samples), default=0.0)
    raise AssertionError("no lmserve:num_requests_running gauge in /metrics")


def test_closed_loop_keeps_the_server_at_its_concurrency(server, tmp_path):
    seen: list[float] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            try:
                seen.append(running_requests(server.base_url))
            except httpx.HTTPError:
                pass  # a slow scrape on a busy machine: the next one counts
            stop.wait(0.05)  # the bench shares this process (and its GIL): poll lightly

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    out = tmp_path / "closed.json"
    try:
        status = cli.main(["--base-url", server.base_url, "--num-prompts", "6", "--max-concurrency", "2",
                           # 40 tokens a request: at 10 the run could end within five 50 ms polls on a fast machine
                           "--random-input-len", "32", "--random-output-len", "40", "--ignore-eos",
                           "--tokenizer", "smollm2-135m-instruct", "--num-warmups", "1", "--disable-tqdm",
                           "--output", str(out)])
    finally:
        stop.set()
        poller.join(10)
    assert status == 0
    result = json.loads(out.read_text())
    assert (result["completed"], result["num_warmups"], result["tokenizer"]) == (6, 1, "smollm2-135m-instruct")
    assert all(s["output_len"] == 40 for s in result["samples"])  # ignore_eos: every request runs to max_tokens
    assert len(seen) > 5 and max(seen) == 2, seen  # the server saw 2 at a time, never more


def test_chat_endpoint_with_chat_dataset(server, tmp_path):
    out = tmp_path / "chat.json"
    status = cli.main(["--base-url", server.base_url, "--endpoint", "/v1/chat/completions", "--dataset-name",
                       "chat", "--num-prompts", "3", "--random-output-len", "4", "--request-rate", "20",
                       "--disable-tqdm", "--output", str(out)])
    assert status == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 3 and result["arrival_pattern"]["kind"] == "open"
    assert all(s["scheduled"] is not None and s["ttft"] is not None for s in result["samples"])
