"""The real server (API process + engine process, default model) over real HTTP with the official openai client."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections import Counter

import httpx
import openai
import pytest
from server_process import HTTP, Server, alive, children, cpu_seconds, start_server

from lmserve import LLM, SamplingParams

MAX_MODEL_LEN = 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Server:
    srv = start_server(
        tmp_path_factory.mktemp("server"), "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", "256MiB",
        "--allowed-origins", "http://localhost:3000",  # the CLI's CORS flag reaches the app (tests/api/test_cors.py)
        "--served-model-name", MODEL, "smollm2",  # and a second name
    )
    yield srv
    srv.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(max_model_len=MAX_MODEL_LEN, kv_cache_memory="128MiB")


def engine(server: Server, *request_ids: str) -> dict:
    params = [("request_id", r) for r in request_ids]
    return HTTP.get(f"{server.base_url}/debug/engine", params=params, timeout=10).json()


def wait_until(predicate, timeout: float, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


def test_chat_and_completions_answer(client: openai.OpenAI) -> None:
    question = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model="smollm2-135m-instruct", messages=question, temperature=0, max_tokens=24)
    assert "Paris" in chat.choices[0].message.content
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.prompt_tokens > 10 and 0 < chat.usage.completion_tokens <= 24
    streamed = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=question, temperature=0, max_tokens=24, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == chat.choices[0].message.content

    done = client.completions.create(model="smollm2-135m-instruct", prompt="The capital of France is", max_tokens=8,
                                     temperature=0)
    assert "Paris" in done.choices[0].text
    assert done.usage.prompt_tokens == 5 and done.usage.completion_tokens == 8
    pieces = client.completions.create(model="smollm2-135m-instruct", prompt="The capital of France is", max_tokens=8,
                                       temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in pieces) == done.choices[0].text


def test_the_responses_api_answers_as_the_chat_does(client: openai.OpenAI) -> None:
    """/v1/responses on the real model: the same greedy answer as the chat request it means, whole and streamed."""
    question = "What is the capital of France?"
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "Answer briefly."},
                                                                 {"role": "user", "content": question}],
                                          temperature=0, max_tokens=24)
    response = client.responses.create(model=MODEL, instructions="Answer briefly.", input=question, temperature=0,
                                       max_output_tokens=24)
    assert response.output_text == chat.choices[0].message.content and response.output_text
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    with client.responses.stream(model=MODEL, instructions="Answer briefly.", input=question, temperature=0,
                                 max_output_tokens=24) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == response.output_text


STREAM_TOKENS = 48


def test_sixteen_concurrent_streams_are_batched(client: openai.OpenAI, server: Server) -> None:
    steps_before = engine(server)["num_steps"]
    results: dict[int, tuple[str, object]] = {}
    # All sixteen sent at once, and long enough to overlap: on a loaded machine, threads started one after another
    # let the first requests finish 24 tokens before the last arrived (11 of 16 in one step, once).
    start_together = threading.Barrier(16)

    def run(i: int) -> None:
        start_together.wait(60)
        stream = client.completions.create(
            model="smollm2-135m-instruct", prompt=f"Story number {i}: once upon a time", max_tokens=STREAM_TOKENS,
            temperature=0.8, seed=i, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, usage = "", None
        for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            if chunk.usage is not None:
                usage = chunk.usage
        results[i] = (text, usage)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert len(results) == 16
    # Which of the 16 requests each engine step served (their recorded timelines): decodes batched together, not
    # merely fewer steps than one at a time (which batches of two would also give).
    def burst() -> list[dict] | None:
        data = HTTP.get(f"{server.base_url}/dashboard/api/requests", params={"limit": 16}, timeout=10).json()["data"]
        return data if len(data) == 16 and all(t["num_output_tokens"] == STREAM_TOKENS for t in data) else None

    timelines = wait_until(burst, timeout=30)
    assert timelines, "the 16 requests were not recorded"
    served = Counter(span[0] for t in timelines for span in t["steps"] if not span[4])  # decode steps' indices
    assert max(served.values()) >= 12, served
    for i, (text, usage) in results.items():
        assert text
        one = client.completions.create(model="smollm2-135m-instruct", prompt=f"Story number {i}: once upon a time",
                                        max_tokens=1)
        assert usage.completion_tokens == STREAM_TOKENS
        assert usage.prompt_tokens == one.usage.prompt_tokens
        assert usage.total_tokens == usage.prompt_tokens + STREAM_TOKENS
    # 16 × 48 tokens one request at a time would need at least 768 steps; batched it takes far fewer.
    assert engine(server)["num_steps"] - steps_before < 16 * STREAM_TOKENS / 2


STOP_PROMPTS = [
    "Write a short poem about the sea.",
    "List three fruits and their colors.",
    "Translate 'good morning, my friend' into Japanese and Chinese.",
    "Reply with five emoji that describe happiness, then explain them.",
]


@pytest.mark.parametrize("prompt", STOP_PROMPTS)
def test_stop_strings_stream_equals_nonstream_equals_offline(client, offline: LLM, prompt: str) -> None:
    messages = [{"role": "user", "content": prompt}]
    full = offline.chat(messages, SamplingParams(temperature=0, max_tokens=48))[0].outputs[0].text
    assert len(full) > 12
    # Stops that start at several places and span several tokens (and, for CJK/emoji text, multi-byte characters).
    stops = {full[k : k + n] for k, n in ((3, 4), (len(full) // 2, 3), (len(full) - 6, 5), (1, 1))}
    for stop in sorted(s for s in stops if s.strip()):
        expected = full[: full.index(stop)]
        offline_text = offline.chat(messages, SamplingParams(temperature=0, max_tokens=48, stop=[stop]))[0]
        assert offline_text.outputs[0].text == expected
        plain = client.chat.completions.create(model="smollm2-135m-instruct", messages=messages, temperature=0,
                                               max_tokens=48, stop=[stop])
        assert plain.choices[0].message.content == expected, stop
        assert plain.choices[0].finish_reason == "stop"
        chunks = client.chat.completions.create(model="smollm2-135m-instruct", messages=messages, temperature=0,
                                                max_tokens=48, stop=[stop], stream=True)
        deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
        assert "".join(deltas) == expected, stop
        assert not any("\ufffd" in d for d in deltas)
        kept = client.chat.completions.create(model="smollm2-135m-instruct", messages=messages, temperature=0,
                                              max_tokens=48, stop=[stop], extra_body={"include_stop_str_in_output": True})
        assert kept.choices[0].message.content == expected + stop


def assert_aborted_and_freed(server: Server, request_id: str, idle_free: int) -> None:
    gone = wait_until(lambda: engine(server, request_id)["request_status"][request_id] == "gone", timeout=1.0)
    assert gone, engine(server, request_id)
    first = engine(server, request_id)["request_positions"][request_id]
    time.sleep(0.3)
    stats = engine(server, request_id)
    assert stats["request_positions"][request_id] == first, "positions kept growing after the abort"
    assert stats["kv_blocks_free"] == idle_free
    assert stats["num_requests_running"] == 0 and stats["num_requests_waiting"] == 0


def idle_free_blocks(server: Server) -> int:
    stats = wait_until(lambda: (s := engine(server))["num_requests_running"] == 0 and s, timeout=10)
    return stats["kv_blocks_free"]


def test_stream_closed_by_client_aborts_in_engine(client, server: Server) -> None:
    idle_free = idle_free_blocks(server)
    aborted_before = engine(server)["num_requests_aborted"]
    stream = client.completions.create(model="smollm2-135m-instruct", prompt="Count: 1, 2, 3,", max_tokens=900,
                                       stream=True, extra_body={"ignore_eos": True})
    for i, chunk in enumerate(stream):
        if i == 4:
            break
    stream.close()
    request_id = f"{chunk.id}-0"
    assert_aborted_and_freed(server, request_id, idle_free)
    assert engine(server)["num_requests_aborted"] == aborted_before + 1
    assert engine(server, request_id)["request_positions"][request_id] < 900


def test_non_streaming_client_timeout_aborts_in_engine(server: Server) -> None:
    idle_free = idle_free_blocks(server)
    aborted_before = engine(server)["num_requests_aborted"]
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.base_url}/v1/completions", timeout=1.0,
                   json={"prompt": "Count: 1, 2, 3,", "max_tokens": 900, "ignore_eos": True})
    assert wait_until(lambda: engine(server)["num_requests_aborted"] == aborted_before + 1, timeout=1.5)
    assert wait_until(lambda: engine(server)["kv_blocks_free"] == idle_free, timeout=1.0)
    assert engine(server)["num_requests_running"] == 0


def test_n3_stream_closed_aborts_every_child(client, server: Server) -> None:
    idle_free = idle_free_blocks(server)
    stream = client.completions.create(model="smollm2-135m-instruct", prompt="Count: 1, 2, 3,", max_tokens=900, n=3,
                                       stream=True, extra_body={"ignore_eos": True})
    seen = set()
    for i, chunk in enumerate(stream):
        seen.add(chunk.choices[0].index)
        if i == 8:
            break
    stream.close()
    assert len(seen) >= 2
    assert_aborted_and_freed(server, f"{chunk.id}-0", idle_free)


def test_errors_from_the_real_engine(server: Server) -> None:
    url = f"{server.base_url}/v1/completions"
    too_long = httpx.post(url, json={"prompt": "hello " * 1100, "max_tokens": 8})
    assert too_long.status_code == 400
    message = too_long.json()["error"]["message"]
    numbers = [int(n) for n in re.findall(r"\d+", message)]
    assert MAX_MODEL_LEN in numbers and any(n > MAX_MODEL_LEN for n in numbers), message
    fits_not = httpx.post(url, json={"prompt": "hello " * 500, "max_tokens": 600})
    assert fits_not.status_code == 400 and "600" in fits_not.json()["error"]["message"]
    assert httpx.post(url, json={"prompt": "hi", "max_tokens": 0}).status_code == 400
    assert httpx.post(url, json={"prompt": "hi", "model": "gpt-4"}).status_code == 404
    assert httpx.post(url, json={"prompt": [999999999]}).status_code == 400
    # The engine is unharmed.
    assert httpx.post(url, json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    alias = httpx.post(url, json={"prompt": "hi", "max_tokens": 2, "model": "smollm2"})
    assert alias.status_code == 200 and alias.json()["model"] == MODEL
    preflight = httpx.options(url, headers={"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"})
    assert preflight.headers.get("access-control-allow-origin") == "http://localhost:3000"
    # OpenAI's words, which LiteLLM matches to trim or fall back (tests/frontend/test_context_length_errors.py).
    assert message.startswith(f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However,")
    # vLLM's truncate_prompt_tokens: the same too-long prompt, cut to its last 100 tokens, is answered.
    cut = httpx.post(url, json={"prompt": "hello " * 1100, "max_tokens": 2, "truncate_prompt_tokens": 100})
    assert cut.status_code == 200 and cut.json()["usage"]["prompt_tokens"] == 100, cut.text
    ids = httpx.post(url, json={"prompt": list(range(1000, 1050)), "max_tokens": 1, "truncate_prompt_tokens": 7,
                                "echo": True, "logprobs": 0})
    assert ids.json()["usage"]["prompt_tokens"] == 7, ids.text


MODEL = "smollm2-135m-instruct"


def test_allowed_token_ids_limit_what_is_drawn(client: openai.OpenAI, server: Server) -> None:
    """vLLM's allowed_token_ids over HTTP: every drawn token is one of them, greedy or sampled, streamed or not."""
    ids = httpx.post(f"{server.base_url}/tokenize", json={"prompt": " yes no maybe"}).json()["tokens"]
    assert len(ids) == 3
    for temperature, stream in ((0, False), (1.5, True)):
        answer = client.completions.create(model=MODEL, prompt="Is the sky green?", max_tokens=6, temperature=temperature,
                                           seed=1, logprobs=0, stream=stream, extra_body={"allowed_token_ids": ids})
        chunks = list(answer) if stream else [answer]
        tokens = [t for c in chunks if c.choices for t in (c.choices[0].logprobs.tokens if c.choices[0].logprobs else [])]
        assert len(tokens) == 6 and set(tokens) <= {" yes", " no", " maybe"}, tokens
    for bad, message in (([], "must not be empty"), ([10**9], "vocabulary"), ([-1], ">= 0")):
        error = httpx.post(f"{server.base_url}/v1/completions",
                           json={"prompt": "hi", "max_tokens": 1, "allowed_token_ids": bad}).json()["error"]
        assert error["param"] == "allowed_token_ids" and message in error["message"], error


def offline_prompt_logprobs(offline: LLM, token_ids: list[int], k: int = 1) -> list:
    (out,) = offline.generate(token_ids, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=k))
    return out.prompt_logprobs


def test_lm_eval_loglikelihood_request_scores_the_continuation(client: openai.OpenAI, offline: LLM) -> None:
    # lm-eval's local-completions loglikelihood: context + continuation as token ids, echo, one token, logprobs 1;
    # it sums token_logprobs[len(context):-1] and checks each is the top token (is_greedy).
    context = offline.tokenizer.encode("The capital of France is")
    continuation = offline.tokenizer.encode(" Paris")
    tokens = context + continuation
    done = client.completions.create(model=MODEL, prompt=tokens, max_tokens=1, echo=True, logprobs=1,
                                     temperature=0, seed=1234)
    logprobs = done.choices[0].logprobs
    assert len(logprobs.token_logprobs) == len(tokens) + 1
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    scored = logprobs.token_logprobs[len(context):-1]
    expected = [e.logprob for e in offline_prompt_logprobs(offline, tokens)[len(context):]]
    assert scored == pytest.approx(expected, abs=1e-3)
    assert sum(scored) < 0
    # " Paris" is the model's greedy continuation: lm-eval's is_greedy holds.
    for token, top in zip(logprobs.tokens[len(context):-1], logprobs.top_logprobs[len(context):-1], strict=True):
        assert max(top, key=top.get) == token
    assert done.choices[0].text.startswith("The capital of France is Paris")

    streamed = client.completions.create(model=MODEL, prompt=tokens, max_tokens=1, echo=True, logprobs=1,
                                         temperature=0, seed=1234, stream=True)
    chunks = [c.choices[0] for c in streamed if c.choices]
    assert [lp for c in chunks for lp in c.logprobs.token_logprobs] == logprobs.token_logprobs
    assert "".join(c.text for c in chunks) == done.choices[0].text


def test_echo_with_max_tokens_zero_returns_the_scored_prompt_only(client: openai.OpenAI, offline: LLM) -> None:
    prompt = "Paris is the capital of"
    for stream in (False, True):
        response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=2,
                                             stream=stream, stream_options={"include_usage": True} if stream else None)
        if stream:
            chunks = list(response)
            choices = [c.choices[0] for c in chunks if c.choices]
            text = "".join(c.text for c in choices)
            token_logprobs = [lp for c in choices for lp in (c.logprobs.token_logprobs if c.logprobs else [])]
            usage, finish = chunks[-1].usage, choices[-1].finish_reason
        else:
            choice = response.choices[0]
            text, token_logprobs = choice.text, choice.logprobs.token_logprobs
            usage, finish = response.usage, choice.finish_reason
        assert text == prompt
        assert usage.completion_tokens == 0 and finish == "length"
        expected = offline_prompt_logprobs(offline, offline.tokenizer.encode(prompt))
        assert token_logprobs[0] is None
        assert token_logprobs[1:] == pytest.approx([e.logprob for e in expected[1:]], abs=1e-3)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=0)


def test_vllm_prompt_logprobs_field_on_both_endpoints(client: openai.OpenAI, offline: LLM) -> None:
    done = client.completions.create(model=MODEL, prompt="One, two, three", max_tokens=2,
                                     extra_body={"prompt_logprobs": 3})
    tokens = offline.tokenizer.encode("One, two, three")
    expected = offline_prompt_logprobs(offline, tokens, 3)
    served = done.choices[0].model_extra["prompt_logprobs"]
    assert served[0] is None and len(served) == len(tokens)
    for token_id, entry, reference in zip(tokens[1:], served[1:], expected[1:], strict=True):
        assert entry[str(token_id)]["logprob"] == pytest.approx(reference.logprob, abs=1e-3)
        assert entry[str(token_id)]["rank"] == reference.rank
        assert 3 <= len(entry) <= 4 and all(v["decoded_token"] is not None for v in entry.values())
    plain = client.completions.create(model=MODEL, prompt="One, two, three", max_tokens=2)
    assert "prompt_logprobs" not in plain.choices[0].model_extra

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                          extra_body={"prompt_logprobs": 0})
    served = chat.model_extra["prompt_logprobs"]
    assert served[0] is None and len(served) == chat.usage.prompt_tokens
    assert all(len(entry) == 1 for entry in served[1:])
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body={"prompt_logprobs": 21})


def test_idle_server_uses_almost_no_cpu(server: Server) -> None:
    # The engine is the server's only process beside its own (no resource tracker: 12 MiB resident, doing nothing).
    assert children(server.process.pid) == [server.engine_pid]
    pids = [server.process.pid, server.engine_pid]
    idle_free_blocks(server)
    before = sum(cpu_seconds(p) for p in pids)
    time.sleep(2.0)
    used = sum(cpu_seconds(p) for p in pids) - before
    assert used < 0.1, f"idle server used {used:.2f} CPU-seconds in 2 s"


def test_sigterm_shuts_down_cleanly(server: Server) -> None:
    engine_pid = server.engine_pid
    assert server.stop(signal.SIGTERM) == 0
    assert wait_until(lambda: not alive(engine_pid), timeout=5), "engine process outlived the server"


def test_engine_death_fails_requests_and_server_exits(tmp_path) -> None:
    srv = start_server(tmp_path, "--max-model-len", "512", "--kv-cache-memory", "64MiB")
    try:
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="x", max_retries=0, timeout=30)
        stream = client.completions.create(model="smollm2-135m-instruct", prompt="Count: 1, 2,", max_tokens=400,
                                           stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))
        socket_directory = srv.socket_directory
        os.kill(srv.engine_pid, signal.SIGKILL)
        with pytest.raises((openai.APIError, httpx.HTTPError)):
            for _ in stream:
                pass
        assert wait_until(lambda: HTTP.get(f"{srv.base_url}/health", timeout=2).status_code == 503, timeout=3)
        new = httpx.post(f"{srv.base_url}/v1/completions", json={"prompt": "hi"}, timeout=5)
        assert new.status_code == 503
        assert srv.process.wait(20) != 0
        assert not socket_directory.exists(), "the engine's sockets and temporary files outlived the server"
    finally:
        srv.stop(signal.SIGKILL)
