"""The result file: `lmserve bench` writes vLLM's keys and file name, and one reader takes either client's file.

fixtures/vllm_serve_result.json is written by hand from vllm/benchmarks/serve.py (main_async and benchmark, commit
009e6d4a1cd6ba3fb2a9fc00f4ec06f5297232a1): what `vllm bench serve --backend openai --max-concurrency 16
--save-result` writes without --save-detailed (the per-request lists deleted, latencies and queue_times kept), with
the default --percentile-metrics ttft,tpot,itl and --metric-percentiles 99. The values are made up.

The CLI runs here against a fake OpenAI server (httpx.MockTransport under httpx.AsyncClient): no sockets.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import httpx
import pytest

from lmserve.bench import cli
from lmserve.bench.result import VLLM_KEYS, read_result

FIXTURE = Path(__file__).parent / "fixtures" / "vllm_serve_result.json"
VLLM_FIXTURE_KEYS = set(json.loads(FIXTURE.read_text()))


def test_vllm_fixture_reads():
    result = read_result(FIXTURE)
    assert result.source == "vllm" and (result.backend, result.model_id) == ("openai", "HuggingFaceTB/SmolLM2-135M-Instruct")
    assert math.isinf(result.request_rate) and (result.max_concurrency, result.completed, result.failed) == (16, 4, 0)
    assert (result.output_throughput, result.total_input_tokens, result.request_goodput) == (256.0, 1024, None)
    assert result.latency_ms["ttft"] == {"mean": 120.5, "median": 118.0, "std": 5.1, "p99": 128.9}
    assert set(result.latency_ms) == {"ttft", "tpot", "itl"} and set(result.per_request) == {"latencies"}
    assert set(VLLM_KEYS) <= VLLM_FIXTURE_KEYS  # what result.py calls vLLM's keys is what vLLM writes


def test_appended_file_reads_the_last_run(tmp_path):
    one = json.loads(FIXTURE.read_text())
    path = tmp_path / "appended.json"
    path.write_text(json.dumps(one) + "\n" + json.dumps({**one, "completed": 3}))  # vLLM's --append-result
    assert read_result(path).completed == 3
    path.write_text('{"date": "x"}')
    with pytest.raises(ValueError, match="not a benchmark result"):
        read_result(path)


class FakeServer:
    """GET /v1/models and a streaming POST /v1/completions; remembers every request body."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "org/fake-model", "root": "org/fake-model"}]})
        if request.url.path != "/v1/completions":
            return httpx.Response(404)
        body = json.loads(request.content)
        self.bodies.append(body)
        chunks = [{"choices": [{"index": 0, "text": t}]} for t in ("a", " b", " c")]
        usage = {"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": 3}}
        return httpx.Response(200, content=b"".join(f"data: {json.dumps(c)}\n\n".encode()
                                                     for c in (*chunks, usage)) + b"data: [DONE]\n\n")


@pytest.fixture
def fake(monkeypatch) -> FakeServer:
    server = FakeServer()
    real = httpx.AsyncClient

    def client(*args, **kwargs):
        kwargs["transport"] = httpx.MockTransport(server)
        return real(*args, **kwargs)

    monkeypatch.setattr(httpx, "AsyncClient", client)
    return server


def bench(*argv: str) -> int:
    return cli.main(["--num-prompts", "3", "--random-input-len", "8", "--random-output-len", "3",
                     "--max-concurrency", "2", "--disable-tqdm", *argv])


def test_save_result_has_vllms_keys_and_name(fake, tmp_path):
    assert bench("--save-result", "--result-dir", str(tmp_path / "out"), "--metadata", "run=a") == 0
    (path,) = (tmp_path / "out").iterdir()
    # vLLM's name: {backend}-{request_rate}qps-concurrency{C}-{model basename}-{YYYYmmdd-HHMMSS}.json
    assert re.fullmatch(r"openai-infqps-concurrency2-fake-model-\d{8}-\d{6}\.json", path.name), path.name
    saved = json.loads(path.read_text())
    assert VLLM_FIXTURE_KEYS <= set(saved), VLLM_FIXTURE_KEYS - set(saved)
    assert not {"ttfts", "itls", "generated_texts", "samples"} & set(saved)  # no --save-detailed
    assert saved["date"] == path.name[-20:-5] and saved["run"] == "a" and saved["request_rate"] == "inf"
    assert (saved["completed"], saved["total_input_tokens"], saved["total_output_tokens"]) == (3, 24, 9)
    result = read_result(path)
    assert result.source == "lmserve" and result.latency_ms["itl"]["p99"] is not None
    assert set(read_result(FIXTURE).latency_ms["ttft"]) <= set(result.latency_ms["ttft"])
    # The bodies: vLLM's completions body; random forces ignore_eos; no temperature since none was given.
    assert all("temperature" not in b and b["ignore_eos"] is True and b["repetition_penalty"] == 1.0
               for b in fake.bodies)


def test_detailed_result_extra_body_and_filename(fake, tmp_path):
    out = tmp_path / "detail.json"
    assert bench("--save-result", "--save-detailed", "--result-filename", str(out), "--label", "mine",
                 "--temperature", "0.3", "--extra-body", '{"top_k": 4, "temperature": 0.6}',
                 "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,90") == 0
    saved = json.loads(out.read_text())
    assert saved["label"] == "mine" and len(saved["ttfts"]) == len(saved["itls"]) == len(saved["errors"]) == 3
    assert saved["generated_texts"] == ["a b c"] * 3 and saved["output_lens"] == [3, 3, 3]
    assert saved["p50_e2el_ms"] is not None and saved["p90_ttft_ms"] is not None and "p50_tpot_ms" not in saved
    assert all((b["temperature"], b["top_k"]) == (0.6, 4) for b in fake.bodies)  # --extra-body wins, as vLLM
