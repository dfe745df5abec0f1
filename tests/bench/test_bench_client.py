"""The streaming client on canned SSE responses (httpx.MockTransport): vLLM's request bodies and chunk timing; the
CLI's flags and exit statuses without a server."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from lmserve.bench import cli
from lmserve.bench.client import BenchClient, Sample
from lmserve.bench.dataset_types import BenchRequest


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
    # vLLM's events: every chunk with choices, the role-only and the content-less ones too: five, four gaps.
    assert sample.ttft is not None and len(sample.itl) == 4
    assert (sample.output_len, sample.output_len_source, sample.usage_prompt_tokens) == (4, "usage", 9)
    assert (sample.index, sample.scheduled, sample.prompt_len, sample.max_tokens) == (3, 0.5, 4, 8)
    assert sample.input_len == 9 and sample.generated_text == "Hello you"  # the server's prompt count, as vLLM
    # vLLM's chat body, key for key: no temperature, max_completion_tokens rather than max_tokens.
    assert set(seen) == {"model", "messages", "max_completion_tokens", "stream", "stream_options", "ignore_eos",
                         "auth"}
    assert seen["stream"] is True and seen["stream_options"] == {"include_usage": True}
    assert (seen["max_completion_tokens"], seen["ignore_eos"], seen["auth"]) == (8, True, "Bearer k")
    assert seen["messages"] == [{"role": "user", "content": "hi"}]


def capture(bodies: list[dict]):
    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(200, content=sse({"choices": [{"index": 0, "text": "x"}]}, "[DONE]"))

    return handler


def test_bodies_send_temperature_only_when_given_and_extra_body_last():
    bodies: list[dict] = []
    run(capture(bodies), "/v1/completions")
    assert bodies[-1] == {"model": "m", "prompt": [1, 2, 3, 4], "repetition_penalty": 1.0, "max_tokens": 8,
                          "logprobs": None, "stream": True, "stream_options": {"include_usage": True}}
    run(capture(bodies), "/v1/completions", temperature=0.0, logprobs=2)
    assert (bodies[-1]["temperature"], bodies[-1]["logprobs"]) == (0.0, 2)
    # --extra-body merges into the body and wins over the sampling flags (vLLM: {**sampling, **extra_body}).
    run(capture(bodies), "/v1/completions", temperature=0.5,
        extra_body={"temperature": 0.7, "top_k": 5, "chat_template_kwargs": {"x": 1}})
    assert (bodies[-1]["temperature"], bodies[-1]["top_k"], bodies[-1]["chat_template_kwargs"]) == (0.7, 5, {"x": 1})
    # openai-chat wraps a lone prompt as vLLM does: one user message of text parts.
    run(capture(bodies), "/v1/chat/completions", request=BenchRequest(1, 3, prompt="hello"), backend="openai-chat")
    assert bodies[-1]["messages"] == [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]
    assert "temperature" not in bodies[-1] and bodies[-1]["max_completion_tokens"] == 3


def test_latency_ends_at_the_last_chunk_with_choices():
    async def slow_tail():
        yield sse({"choices": [{"index": 0, "text": "a"}]})
        yield sse({"choices": [{"index": 0, "text": "b", "finish_reason": "length"}]})
        await asyncio.sleep(0.3)  # a late usage chunk and [DONE]: not part of vLLM's latency
        yield sse({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}}, "[DONE]")

    sample = run(lambda r: httpx.Response(200, content=slow_tail()), "/v1/completions")
    assert sample.success and sample.output_len == 2 and len(sample.itl) == 1
    assert sample.e2e < 0.2 and sample.e2e >= sample.ttft

    sample = run(lambda r: httpx.Response(200, content=sse({"choices": [], "usage": {"completion_tokens": 0}},
                                                            "[DONE]")))
    assert not sample.success and "no chunk with choices" in sample.error


def test_completions_without_usage_counts_chunks_or_tokens(default_tokenizer):
    def handler(request: httpx.Request) -> httpx.Response:
        assert json.loads(request.content)["prompt"] == [1, 2, 3, 4]
        chunks = [{"choices": [{"index": 0, "text": t}]} for t in ("The", " cat", "", " sat")]
        return httpx.Response(200, content=sse(*chunks, "[DONE]"))

    # Four chunks with choices (one held back, empty): four token events, three gaps.
    sample = run(handler, "/v1/completions")
    assert sample.success and (sample.output_len, sample.output_len_source) == (4, "chunks") and len(sample.itl) == 3
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
                 ["--dataset-name", "jsonl", "--dataset-path", str(bad)], ["--request-rate", "0"],
                 ["--backend", "openai-audio"], ["--backend", "openai-chat", "--endpoint", "/v1/completions"],
                 ["--dataset-name", "sharegpt"], ["--dataset-name", "custom", "--dataset-path", str(bad)],
                 ["--dataset-path", str(bad)], ["--percentile-metrics", "ttft,foo"], ["--metadata", "novalue"]):
        assert cli.main(["--base-url", "http://127.0.0.1:9", *argv]) == 2, argv
    err = capsys.readouterr().err
    assert "bad.jsonl:1" in err and "not supported by lmserve bench" in err
    for argv in (["--dataset-name", "nope"], ["--extra-body", "[1]"], ["--extra-body", "{oops"]):
        with pytest.raises(SystemExit) as exc:
            cli.main(argv)
        assert exc.value.code == 2


def test_lmserve_bench_subcommand_parses_the_same_flags():
    from lmserve.cli import build_parser

    args = build_parser().parse_args(["bench", "--max-concurrency", "3", "--goodput", "ttft:5", "tpot:1"])
    assert args.func is cli.run and args.max_concurrency == 3 and cli.validate(args) == {"ttft": 5.0, "tpot": 1.0}
    assert cli.arrival_pattern(args)["kind"] == "closed"


def parse(*argv: str):
    args = cli.build_parser().parse_args(list(argv))
    cli.validate(args)
    return args


def test_flags_parse_with_vllms_meanings():
    args = parse()
    assert (args.base_url, args.backend, args.endpoint) == ("http://127.0.0.1:8000", "openai", "/v1/completions")
    assert args.request_body == {} and args.temperature is None  # nothing sent: the server's defaults apply
    assert args.ignore_eos  # vLLM forces it for the random dataset
    assert (args.selected_metrics, args.selected_percentiles) == (["ttft", "tpot", "itl"], [99.0])
    assert args.num_prompts is None and args.custom_output_len == 256 and args.sharegpt_output_len is None

    args = parse("--host", "::1", "--port", "9000", "--backend", "openai-chat", "--temperature", "0", "--top-k", "5",
                 "--min-p", "0.1", "--extra-body", '{"top_k": 7, "seed": 3}', "--output-len", "33",
                 "--input-len", "64", "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,99.9",
                 "--dataset-name", "chat")
    assert (args.base_url, args.endpoint) == ("http://[::1]:9000", "/v1/chat/completions")
    assert args.request_body == {"temperature": 0.0, "top_k": 7, "min_p": 0.1, "seed": 3}
    assert (args.random_input_len, args.random_output_len, args.custom_output_len, args.sharegpt_output_len) == (
        64, 33, 33, 33)
    assert not args.ignore_eos and args.selected_percentiles == [50.0, 99.9]
    # --base-url wins over --host/--port; the chat endpoint alone picks the chat backend.
    args = parse("--base-url", "http://h:1/", "--host", "x", "--endpoint", "/v1/chat/completions")
    assert (args.base_url, args.backend) == ("http://h:1", "openai-chat")
    assert parse("--backend", "vllm").endpoint == "/v1/completions"
