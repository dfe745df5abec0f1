"""Hostile input against the real server (API process + engine process, default model), over real HTTP.

Every field is bounded before anything is allocated for it: a bad value is a 4xx with an OpenAI error body naming
the field, never a 5xx, a hang or a crash, and the server keeps serving. The fuzz test draws requests over every
field of both endpoints (typed right and wrong, in and out of range) and watches both processes' memory.
"""

from __future__ import annotations

import json
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_process import Server, start_server

from lmserve.sampling_params import MAX_STOP_CHARS, MAX_TOKEN_ID_ENTRIES

MAX_MODEL_LEN = 128
MAX_NUM_SEQS = 8
BODY_LIMIT = 1 << 20
FUZZ_EXAMPLES = 150  # per endpoint; each request is short (MAX_MODEL_LEN bounds every generation)
MAX_RSS_GROWTH = 200 << 20


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Server:
    srv = start_server(
        tmp_path_factory.mktemp("hostile"), "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs",
        str(MAX_NUM_SEQS), "--kv-cache-memory", "64MiB", "--max-request-body-bytes", str(BODY_LIMIT),
    )
    yield srv
    srv.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def http(server: Server) -> httpx.Client:
    with httpx.Client(base_url=f"{server.base_url}/v1", timeout=120) as client:
        yield client


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


STATUSES: Counter[int] = Counter()  # of the fuzz requests


def post(http: httpx.Client, path: str, body: bytes | dict) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = http.post(path, content=content, headers={"content-type": "application/json"})
    check_answer(response)
    return response


def check_answer(response: httpx.Response) -> None:
    """Never a 5xx; every error an OpenAI error body; every stream free of in-band errors."""
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"]
        assert isinstance(error["type"], str) and error["code"] == response.status_code
        return
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        for event in events[:-1]:
            assert "error" not in json.loads(event), event
    else:
        assert response.json()["choices"]


def assert_refused(response: httpx.Response, status: int, param: str | None, *words: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error


# ------------------------------------------------------------------------------------------- known cases

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "hi", "max_tokens": 2}

# (endpoint, request body, param named in the error, words in the message)
REFUSED = [
    ("completions", {**COMPLETION, "n": 1_000_000}, "n", "1024"),
    ("completions", {**COMPLETION, "n": MAX_NUM_SEQS + 1}, "n", "max_num_seqs"),
    ("completions", {**COMPLETION, "prompt": ["hi"] * 200, "n": 8}, "prompt", "1024"),
    ("completions", {**COMPLETION, "stop": ["x" * 1_000_000]}, "stop", str(MAX_STOP_CHARS)),
    ("completions", {**COMPLETION, "stop": ["s"] * 1000}, "stop", "32"),
    ("completions", {**COMPLETION, "seed": 2**64}, "seed", "integer"),
    ("completions", {**COMPLETION, "seed": -(2**63) - 1}, "seed", "integer"),
    ("completions", {**COMPLETION, "temperature": 1e308}, "temperature", "finite"),
    ("completions", {**COMPLETION, "temperature": -1}, "temperature", "finite"),
    ("completions", {**COMPLETION, "max_tokens": "10"}, "max_tokens", "integer"),
    ("completions", {**COMPLETION, "max_tokens": True}, "max_tokens", "integer"),
    ("completions", {**COMPLETION, "max_tokens": 0}, "max_tokens", "[1, "),
    ("completions", {**COMPLETION, "max_tokens": 10**30}, "max_tokens", "integer"),
    ("completions", {**COMPLETION, "temperature": "1"}, "temperature", "number"),
    ("completions", {**COMPLETION, "stream": "yes"}, "stream", "boolean"),
    ("completions", {**COMPLETION, "top_p": 0}, "top_p", "(0.0, 1.0]"),
    ("completions", {**COMPLETION, "top_k": 10**20}, "top_k", "positive integer"),
    ("completions", {**COMPLETION, "presence_penalty": 3}, "presence_penalty", "[-2.0, 2.0]"),
    ("completions", {**COMPLETION, "repetition_penalty": 0}, "repetition_penalty", "> 0.0"),
    ("completions", {**COMPLETION, "logit_bias": {"-1": 1}}, "logit_bias", "token ids"),
    ("completions", {**COMPLETION, "logit_bias": {"999999999": 1}}, "logit_bias", "vocabulary"),
    ("completions", {**COMPLETION, "logit_bias": {"1": 101}}, "logit_bias", "100"),
    ("completions", {**COMPLETION, "logit_bias": {str(i): 1 for i in range(50_000)}}, "logit_bias",
     str(MAX_TOKEN_ID_ENTRIES)),
    ("completions", {**COMPLETION, "stop_token_ids": [49152]}, "stop_token_ids", "vocabulary"),
    ("completions", {**COMPLETION, "stop_token_ids": [-1]}, "stop_token_ids", ">= 0"),
    ("completions", {**COMPLETION, "prompt": [1, -5]}, None, "vocabulary"),
    ("completions", {**COMPLETION, "prompt": [[]]}, "prompt", "empty"),
    ("completions", {**COMPLETION, "prompt": "hi " * 5000}, None, "max_model_len"),
    ("completions", {**COMPLETION, "prompt": "x" * 600_000}, None, "characters"),
    ("completions", {**COMPLETION, "priority": 5}, "priority", "priority scheduling"),
    ("completions", {**COMPLETION, "priority": 2**70}, "priority", "64-bit"),
    ("completions", {**COMPLETION, "logprobs": 6}, "logprobs", "5"),
    ("completions", {**COMPLETION, "min_tokens": 3}, "min_tokens", "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": None, "min_tokens": 10_000}, None, "min_tokens"),
    ("chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "hi"}]}, "messages", "role"),
    ("chat/completions", {**CHAT, "messages": [{"role": "user"}]}, "messages", "content"),
    ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": None}]}, "messages", "content"),
    ("chat/completions", {**CHAT, "messages": []}, "messages", "at least 1"),
    ("chat/completions", {**CHAT, "messages": "hi"}, "messages", "array"),
    ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages", "text"),
    ("chat/completions", {**CHAT, "top_logprobs": 3}, "top_logprobs", "logprobs"),
    ("chat/completions", {**CHAT, "top_logprobs": 21, "logprobs": True}, "top_logprobs", "20"),
    ("chat/completions", {**CHAT, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, "chat_template_kwargs",
     "chat_template"),
    ("chat/completions", {**CHAT, "temperature": float("nan")}, "temperature", "finite"),
    ("chat/completions", {**CHAT, "frequency_penalty": float("inf")}, "frequency_penalty", "finite"),
]


@pytest.mark.parametrize(("path", "body", "param", "words"), [(p, b, q, w) for p, b, q, *w in REFUSED])
def test_bad_field_is_a_400_naming_it(http: httpx.Client, path: str, body: dict, param: str | None,
                                      words: list[str]) -> None:
    # json.dumps writes NaN and Infinity as JavaScript does; strict JSON parsers (and this server) refuse them.
    assert_refused(post(http, path, json.dumps(body).encode()), 400, param, *words)


@pytest.mark.parametrize("body", [
    b'{"prompt": "\\ud800", "max_tokens": 2}',  # a lone surrogate
    b'{"prompt": "\\udc00\\ud800", "max_tokens": 2}',  # surrogates in the wrong order
    b'{"prompt": "\\ud800\\u0041", "max_tokens": 2}',  # a high surrogate without its low half
    b'{"prompt": "\xed\xa0\x80\xed\xb0\x80", "max_tokens": 2}',  # CESU-8: a surrogate pair as two 3-byte codes
    b'{"prompt": "\xff", "max_tokens": 2}',  # not UTF-8
    b'{"prompt": "hi", "max_tokens": 2',  # cut short
    b'{"prompt": "hi", "max_tokens": 2}{"x": 1}',  # trailing data
    b"[1, 2]",
    b"",
    b"null",
])
def test_malformed_body_is_a_400(http: httpx.Client, body: bytes) -> None:
    response = post(http, "completions", body)
    assert response.status_code == 400, response.text


def test_body_over_the_limit_is_a_413(http: httpx.Client) -> None:
    response = post(http, "completions", {"prompt": "x" * (BODY_LIMIT + 1), "max_tokens": 1})
    assert_refused(response, 413, None, str(BODY_LIMIT), "--max-request-body-bytes")


def test_valid_pairing_surrogate_escapes_are_served(http: httpx.Client) -> None:
    response = post(http, "completions", b'{"prompt": "smile \\ud83d\\ude00", "max_tokens": 2}')
    assert response.status_code == 200, response.text


def test_largest_seeds_are_served(http: httpx.Client) -> None:
    for seed in (2**64 - 1, -(2**63)):
        response = post(http, "completions", {**COMPLETION, "seed": seed, "temperature": 1.0, "n": 2})
        assert response.status_code == 200, response.text
        assert len(response.json()["choices"]) == 2


# ------------------------------------------------------------------------------------------------- fuzz

def _json_values() -> st.SearchStrategy[Any]:
    scalars = st.one_of(
        st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8),
        st.sampled_from([2**63, 2**64, -(2**63) - 1, 10**40, 1e308, -1e308]),
    )
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.text(max_size=5), inner, max_size=3), max_leaves=6)


def _field(valid: st.SearchStrategy[Any], edge: st.SearchStrategy[Any] | None = None) -> st.SearchStrategy[Any]:
    """Mostly valid values (so that the serving path runs too), then edge values of the right type, then anything:
    with a dozen fields in a request, about one in four requests is valid."""
    choices = (valid, edge if edge is not None else valid, _json_values())
    return st.integers(0, 21).flatmap(lambda i: choices[0 if i < 20 else i - 19])


SURROGATES = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
PLAIN = st.text(st.characters(min_codepoint=32, max_codepoint=0x2FFF, exclude_categories=("Cs",)), min_size=1,
                max_size=30)
TEXT = st.one_of(st.text(max_size=40), st.text(st.one_of(st.characters(), SURROGATES), max_size=10))
VALID_IDS = st.lists(st.integers(0, 49151), min_size=1, max_size=8)
TOKEN_IDS = st.lists(st.integers(), max_size=8)

SAMPLING_FIELDS = {
    "model": _field(st.just("smollm2-135m-instruct"), st.sampled_from(["other", ""])),
    "n": _field(st.integers(1, 3), st.integers(-1, MAX_NUM_SEQS + 2)),
    "max_tokens": _field(st.integers(1, 6), st.integers(-1, 0) | st.just(None)),
    "min_tokens": _field(st.integers(0, 2), st.integers(-1, 10)),
    "temperature": _field(st.floats(0, 2), st.floats(-1, 150)),
    "top_p": _field(st.floats(0.05, 1), st.floats(-0.5, 1.5)),
    "top_k": _field(st.integers(-1, 100), st.integers(-2, 60000)),
    "min_p": _field(st.floats(0, 1), st.floats(-0.5, 1.5)),
    "presence_penalty": _field(st.floats(-2, 2), st.floats(-3, 3)),
    "frequency_penalty": _field(st.floats(-2, 2), st.floats(-3, 3)),
    "repetition_penalty": _field(st.floats(0.5, 2), st.floats(-1, 3)),
    "seed": _field(st.integers(0, 2**64 - 1), st.integers(-(2**64), 2**65)),
    "stop": _field(st.one_of(PLAIN, st.lists(PLAIN, max_size=4)), st.one_of(TEXT, st.lists(TEXT, max_size=40))),
    "stop_token_ids": _field(st.lists(st.integers(0, 49151), max_size=4), TOKEN_IDS),
    "logit_bias": _field(st.dictionaries(st.integers(0, 49151).map(str), st.floats(-100, 100), max_size=4),
                         st.dictionaries(st.one_of(st.integers(-2, 60000).map(str), TEXT), st.floats(-150, 150),
                                         max_size=4)),
    "ignore_eos": _field(st.booleans()),
    "include_stop_str_in_output": _field(st.booleans()),
    "skip_special_tokens": _field(st.booleans()),
    "stream": _field(st.booleans()),
    "stream_options": _field(st.fixed_dictionaries({"include_usage": st.booleans()},
                                                   optional={"continuous_usage_stats": st.booleans()})),
    "priority": _field(st.just(0), st.integers(-2, 2)),
    "user": _field(PLAIN, TEXT),
    "return_timeline": _field(st.booleans()),
    "cache_salt": _field(PLAIN, TEXT),
}
COMPLETION_FIELDS = {
    **SAMPLING_FIELDS,
    "logprobs": _field(st.integers(0, 5), st.integers(-1, 7)),
    "echo": _field(st.booleans()),
}
MESSAGE = st.fixed_dictionaries({
    "role": _field(st.sampled_from(["system", "user", "assistant", "developer"]), st.sampled_from(["tool", "bot"])),
    "content": _field(PLAIN, st.one_of(st.none(), TEXT, st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url"])}, optional={"text": TEXT}), max_size=2))),
}, optional={"name": PLAIN})
CHAT_FIELDS = {
    **SAMPLING_FIELDS,
    "max_completion_tokens": _field(st.integers(1, 6), st.integers(-1, 0)),
    "logprobs": _field(st.booleans()),
    "top_logprobs": _field(st.integers(0, 20), st.integers(-1, 22)),
    "add_generation_prompt": _field(st.booleans()),
    "chat_template_kwargs": _field(st.dictionaries(st.just("enable_thinking"), st.booleans(), max_size=1),
                                   st.dictionaries(st.sampled_from(["x", "tokenize", "chat_template"]),
                                                   st.booleans(), max_size=2)),
}
PROMPT = _field(st.one_of(PLAIN, VALID_IDS, st.lists(PLAIN, min_size=1, max_size=3)),
                st.one_of(TEXT, TOKEN_IDS, st.lists(TEXT, max_size=3), st.lists(TOKEN_IDS, max_size=3)))


def _request(required: dict[str, st.SearchStrategy[Any]], fields: dict[str, st.SearchStrategy[Any]]):
    return st.fixed_dictionaries(required, optional=fields)


def _dump(body: dict) -> bytes:
    # ensure_ascii writes lone surrogates as \\ud800 escapes, as a hostile client would send them.
    return json.dumps(body, allow_nan=True).encode()


@pytest.fixture(scope="module")
def memory_watch(server: Server, http: httpx.Client) -> dict[str, int]:
    """Resident memory once the server is warm: a prompt of more than 64 tokens makes the engine build its block
    layers' float16 copies for large batches (otherwise built on a background thread after start-up), which is
    memory the server holds by design, not growth caused by the requests that follow."""
    post(http, "completions", {"prompt": "Once upon a time, " * 16, "max_tokens": 1, "temperature": 0})
    return {"api": rss_bytes(server.process.pid), "engine": rss_bytes(server.engine_pid)}


FUZZ = settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@FUZZ
# max_tokens always sent, as in the chat fuzz below: an answer without it runs to the context length, which only costs
# time (None is still among its edge values; an absent one: test_api_fake_engine's default max_tokens test).
@given(body=_request({"prompt": PROMPT, "max_tokens": SAMPLING_FIELDS["max_tokens"]},
                     {k: v for k, v in COMPLETION_FIELDS.items() if k != "max_tokens"}))
def test_fuzz_completions(http: httpx.Client, memory_watch: dict[str, int], body: dict) -> None:
    STATUSES[post(http, "completions", _dump(body)).status_code] += 1


@FUZZ
@given(body=_request({"messages": _field(st.lists(MESSAGE, min_size=1, max_size=3), st.lists(MESSAGE, max_size=0)),
                      # Always sent: without it a chat answer may run to the context length, which only costs time.
                      "max_tokens": SAMPLING_FIELDS["max_tokens"]},
                     {k: v for k, v in CHAT_FIELDS.items() if k != "max_tokens"}))
def test_fuzz_chat_completions(http: httpx.Client, memory_watch: dict[str, int], body: dict) -> None:
    STATUSES[post(http, "chat/completions", _dump(body)).status_code] += 1


def test_after_the_fuzz_memory_is_bounded_and_the_server_still_answers(
    server: Server, http: httpx.Client, memory_watch: dict[str, int], request: pytest.FixtureRequest
) -> None:
    """Runs after the fuzz tests (file order): neither process grew past the bound, nothing is left running, and
    when the fuzz ran, it reached the serving path too, not only the validation."""
    response = post(http, "completions", {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0})
    assert "Paris" in response.json()["choices"][0]["text"]
    growth = {
        "api": rss_bytes(server.process.pid) - memory_watch["api"],
        "engine": rss_bytes(server.engine_pid) - memory_watch["engine"],
    }
    print(f"\nresident memory growth over the hostile tests: {growth}; fuzz answers by status: {dict(STATUSES)}")
    fuzz_ran = any(item.name.startswith("test_fuzz_") for item in request.session.items)
    if fuzz_ran:  # selected in this session (a `-k` run may leave it out): it must have sent requests, a tenth served
        assert STATUSES.total() > 0 and STATUSES[200] >= 0.1 * STATUSES.total(), STATUSES
    assert all(g < MAX_RSS_GROWTH for g in growth.values()), growth
    stats = httpx.get(f"{server.base_url}/debug/engine", timeout=10).json()
    assert stats["num_requests_running"] == 0 and stats["num_requests_waiting"] == 0
    assert stats["kv_blocks_used"] == 0


# ---------------------------------------------------------------------------------------- tokenize / detokenize


def test_tokenize_and_detokenize_in_vllms_shapes(server: Server) -> None:
    url = server.base_url
    prompt = "The capital of France is"
    tokens = httpx.post(f"{url}/tokenize", json={"prompt": prompt}, timeout=10).json()
    assert tokens["count"] == len(tokens["tokens"]) == 5 and tokens["max_model_len"] == MAX_MODEL_LEN
    text = httpx.post(f"{url}/detokenize", json={"tokens": tokens["tokens"]}, timeout=10).json()
    assert text == {"prompt": prompt}
    chat = httpx.post(f"{url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=10).json()
    usage = httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "max_tokens": 1}, timeout=60).json()["usage"]
    assert chat["count"] == usage["prompt_tokens"]  # the same template and tokens as a chat request
    # Tools go into the template as a chat request puts them, so they count; token_strs spell the text.
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    messages = [{"role": "user", "content": "hi"}]
    with_tools = httpx.post(f"{url}/tokenize", json={"messages": messages, "tools": [weather]}, timeout=10).json()
    chat_usage = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        **CHAT, "messages": messages, "tools": [weather], "tool_choice": "none", "max_tokens": 1}).json()["usage"]
    assert with_tools["count"] == chat_usage["prompt_tokens"]  # (SmolLM2's template shows no tools: see the fake's)
    pieces = httpx.post(f"{url}/tokenize", json={"prompt": prompt, "return_token_strs": True}, timeout=10).json()
    assert pieces["tokens"] == tokens["tokens"] and "".join(pieces["token_strs"]) == prompt
    assert tokens.get("token_strs") is None


@pytest.mark.parametrize(("path", "body", "param"), [
    ("tokenize", {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, None),
    ("tokenize", {}, None),
    ("tokenize", {"prompt": "x" * 600_000}, None),
    ("tokenize", {"prompt": "\ud800"}, None),
    ("tokenize", {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"tokenize": True}},
     "chat_template_kwargs"),
    ("detokenize", {"tokens": [49152]}, "tokens"),
    ("detokenize", {"tokens": [-1]}, "tokens"),
    ("detokenize", {"tokens": "1 2"}, "tokens"),
])
def test_bad_tokenize_requests_are_400(server: Server, path: str, body: dict, param: str | None) -> None:
    response = httpx.post(f"{server.base_url}/{path}", content=json.dumps(body).encode(), timeout=10,
                          headers={"content-type": "application/json"})
    check_answer(response)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


# ------------------------------------------------------------------------------------------------ cache_salt


def test_cache_salt_separates_tenants_prefix_caches(server: Server, http: httpx.Client) -> None:
    prompt = list(range(1000, 1064))  # four full blocks of 16

    def hits_after(salt: str | None) -> int:
        before = httpx.get(f"{server.base_url}/debug/engine", timeout=10).json()["prefix_cache_hits"]
        body = {"prompt": prompt, "max_tokens": 1, **({"cache_salt": salt} if salt is not None else {})}
        assert post(http, "completions", body).status_code == 200
        return httpx.get(f"{server.base_url}/debug/engine", timeout=10).json()["prefix_cache_hits"] - before

    assert hits_after("tenant-a") == 0
    assert hits_after("tenant-b") == 0  # the same prompt under another salt shares no block
    assert hits_after(None) == 0  # nor without one
    assert hits_after("tenant-a") == 48  # the same salt does: every full block but the last position's
    assert hits_after(None) == 48


@pytest.mark.parametrize("salt", ["", "s" * 257, 5])
def test_bad_cache_salt_is_a_400(http: httpx.Client, salt: object) -> None:
    assert_refused(post(http, "completions", {**COMPLETION, "cache_salt": salt}), 400, "cache_salt")
