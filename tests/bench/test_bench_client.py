"""The streaming client on canned SSE responses (httpx.MockTransport), and the CLI's exit statuses without a server."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from lmserve.bench import cli
from lmserve.bench.client import BenchClient, Sample
from lmserve.bench.datasets import BenchRequest


def sse(*chunks: dict | str) -> bytes:
    return b"".join(f"data: {c if isinstance(c, str) else json.dumps(c)}\n\n".encode() for c in chunks)


def chat_chunk(content: str | None) -> dict:
    return {"choices": [{"index": 0, "delta": {"content": content}}]}


def run(handler, endpoint: str = "/v1/chat/completions", request: BenchRequest | None = None, **kwargs) -> Sample:
    async def go() -> Sample:
        client = BenchClient("http://bench.test", endpoint, "m", transport=httpx.MockTransport(handler), **kwargs)
        try:
            default = BenchRequest(4, 8, prompt=[1, 2, 3, 4] if endpoint == "/v1/completions" else "hi")
            return await client.send(3, request or default, scheduled=0.5)
        finally:
            await client.aclose()

    return asyncio.run(go())


def test_chat_stream_timing_and_usage():
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen.update(json.loads(request.content), auth=request.headers.get("authorization"))
        body = sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},  # not content
                   chat_chunk("Hel"), chat_chunk("lo"), chat_chunk(None), chat_chunk(" you"),
                   {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}}, "[DONE]")
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    sample = run(handler, request=BenchRequest(4, 8, messages=[{"role": "user", "content": "hi"}]), api_key="k",
                 ignore_eos=True)
    assert sample.success and sample.http_status == 200 and not sample.error
    assert sample.ttft is not None and len(sample.itl) == 2  # three chunks with text: two gaps
    assert (sample.output_len, sample.output_len_source, sample.usage_prompt_tokens) == (4, "usage", 9)
    assert (sample.index, sample.scheduled, sample.prompt_len, sample.max_tokens) == (3, 0.5, 4, 8)
    assert seen["stream"] is True and seen["stream_options"] == {"include_usage": True}
    assert (seen["max_tokens"], seen["temperature"], seen["ignore_eos"], seen["auth"]) == (8, 0.0, True, "Bearer k")
    assert seen["messages"] == [{"role": "user", "content": "hi"}]


def test_completions_without_usage_counts_chunks_or_tokens(default_tokenizer):
    def handler(request: httpx.Request) -> httpx.Response:
        assert json.loads(request.content)["prompt"] == [1, 2, 3, 4]
        chunks = [{"choices": [{"index": 0, "text": t}]} for t in ("The", " cat", "", " sat")]
        return httpx.Response(200, content=sse(*chunks, "[DONE]"))

    sample = run(handler, "/v1/completions")
    assert sample.success and (sample.output_len, sample.output_len_source) == (3, "chunks") and len(sample.itl) == 2
    sample = run(handler, "/v1/completions", tokenizer=default_tokenizer)
    expected = len(default_tokenizer.encode("The cat sat", add_special_tokens=False))
    assert (sample.output_len, sample.output_len_source) == (expected, "tokenizer")


def test_failures_and_timeouts_are_reported_apart():
    sample = run(lambda r: httpx.Response(503, text="overloaded"))
    assert not sample.success and not sample.timed_out and sample.http_status == 503
    assert sample.error == "HTTP 503: overloaded"

    sample = run(lambda r: httpx.Response(200, content=sse(chat_chunk("a"), {"error": {"message": "engine died"}})))
    assert not sample.success and sample.error == "error in stream: engine died"

    async def slow(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(5)
        return httpx.Response(200, content=b"")

    sample = run(slow, timeout=0.2)
    assert sample.timed_out and not sample.success and sample.e2e < 2


def test_dead_port_request_fails():
    from server_process import free_port  # tests/api, put on sys.path by conftest

    async def go() -> Sample:
        client = BenchClient(f"http://127.0.0.1:{free_port()}", "/v1/completions", "m", timeout=5)
        try:
            return await client.send(0, BenchRequest(1, 1, prompt="x"))
        finally:
            await client.aclose()

    sample = asyncio.run(go())
    assert not sample.success and not sample.timed_out and "ConnectError" in sample.error


def test_cli_exit_statuses(tmp_path, capsys):
    from server_process import free_port

    # The whole run against a server that does not answer: 1 (and nothing was measured).
    assert cli.main(["--base-url", f"http://127.0.0.1:{free_port()}", "--num-prompts", "1", "--disable-tqdm"]) == 1
    assert "cannot reach" in capsys.readouterr().err
    # Bad arguments: 2, before the server is contacted.
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n")
    for argv in (["--random-range-ratio", "1.5"], ["--slo", "ttft=fast"], ["--dataset-name", "jsonl"],
                 ["--dataset-name", "jsonl", "--dataset-path", str(bad)], ["--request-rate", "0"]):
        assert cli.main(["--base-url", "http://127.0.0.1:9", *argv]) == 2, argv
    assert "bad.jsonl:1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli.main(["--dataset-name", "nope"])
    assert exc.value.code == 2


def test_lmserve_bench_subcommand_parses_the_same_flags():
    from lmserve.cli import build_parser

    args = build_parser().parse_args(["bench", "--max-concurrency", "3", "--goodput", "ttft:5", "tpot:1"])
    assert args.func is cli.run and args.max_concurrency == 3 and cli.validate(args) == {"ttft": 5.0, "tpot": 1.0}
    assert cli.arrival_pattern(args)["kind"] == "closed"
