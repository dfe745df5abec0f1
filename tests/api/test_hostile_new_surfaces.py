"""Hostile input against the surfaces added after the first hostile suite (issue 68): /v1/responses whole and
streamed, tool-call history, /tokenize with messages, grammars from tools, the dashboard's parameters. A real server
(API + engine, default model) with `--enable-auto-tool-choice --tool-call-parser hermes`, its key taken from
LMSERVE_API_KEY. Every bad request is a 4xx naming the field, never a 5xx or a hang, and no request holds up
another client's /health.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_process import Server, start_server
from test_hostile_input import assert_refused, check_answer

from lmserve.api.protocol import MAX_METADATA_PAIRS

KEY = "issue-68-key"
MAX_MODEL_LEN = 256
USER = [{"role": "user", "content": "hi"}]
DEEP = "[" * 5000 + "]" * 5000  # tool-call arguments nested 5,000 deep


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Server:
    srv = start_server(
        tmp_path_factory.mktemp("hostile-new"), "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", "64MiB",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", env={"LMSERVE_API_KEY": KEY},
    )
    yield srv
    srv.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def http(server: Server) -> httpx.Client:
    with httpx.Client(base_url=server.base_url, timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as client:
        yield client


def post(http: httpx.Client, path: str, body: dict | str | bytes) -> httpx.Response:
    content = body if isinstance(body, str | bytes) else json.dumps(body)
    response = http.post(path, content=content, headers={"content-type": "application/json"})
    assert response.status_code < 500, response.text
    return response


def call(arguments: str) -> dict[str, Any]:
    return {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}


def tool(name: str, properties: int, description: str = "a parameter") -> dict[str, Any]:
    props = {f"p{i}": {"type": "string", "description": description} for i in range(properties)}
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": props}}}


def nested_schema(levels: int) -> str:
    return '{"type":"object","properties":{"a":' * levels + '{"type":"string"}' + "}}" * levels


TWO_40KB_TOOLS = [tool("a", 200, "x" * 180), tool("b", 200, "x" * 180)]
REFUSED: list[tuple[str, str, dict | str, str | None, str]] = [
    # (case, path, body, param, a word of the message)
    *[(f"responses text.format={fmt!r}{' streamed' if stream else ''}", "/v1/responses",
       {"input": "hi", "text": {"format": fmt}, "stream": stream}, "text", "text.format")
      for fmt in ("json_object", [1], 5, {"type": 5}) for stream in (False, True)],
    *[(f"{path} tool_calls=[{entry!r}]", path,
       {"messages": [{"role": "assistant", "content": None, "tool_calls": [entry]}, *USER]}, "messages", "tool_calls")
      for entry in (5, True, "x", {"function": 5}, {"function": {"name": 5}}) for path in ("/v1/chat/completions",
                                                                                               "/tokenize")],
    ("chat tool_calls not a list", "/v1/chat/completions",
     {"messages": [{"role": "assistant", "content": "x", "tool_calls": {"a": 1}}, *USER]}, "messages", "tool_calls"),
    *[(f"{path} arguments 5,000 deep", path,
       {"messages": [{"role": "assistant", "content": None, "tool_calls": [call(DEEP)]}, *USER]}, "messages", "64")
      for path in ("/v1/chat/completions", "/tokenize")],
    ("responses function_call arguments 5,000 deep", "/v1/responses",
     {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": DEEP}, *USER]}, "messages", "64"),
    ("required with two 40 KB schemas", "/v1/chat/completions",
     {"messages": USER, "tools": TWO_40KB_TOOLS, "tool_choice": "required"}, "tools", "65536"),
    ("responses required with two 40 KB schemas", "/v1/responses",
     {"input": "hi", "tool_choice": "required", "tools": [{"type": "function", **t["function"]} for t in TWO_40KB_TOOLS]},
     "tools", "65536"),
    ("schema 900 deep as text", "/v1/chat/completions",
     '{"messages":[{"role":"user","content":"hi"}],"structured_outputs":{"json":' + json.dumps(nested_schema(900))
     + "}}", "structured_outputs", "64"),
    ("schema 80 deep as an object", "/v1/chat/completions",
     '{"messages":[{"role":"user","content":"hi"}],"response_format":{"type":"json_schema","json_schema":'
     '{"name":"x","schema":' + nested_schema(40) + "}}}", "response_format", "64"),
    ("regex a{0,1000000000}", "/v1/chat/completions",
     {"messages": USER, "structured_outputs": {"regex": "a{0,1000000000}"}}, "structured_outputs", "1000"),
    ("schema pattern a{0,1000000000}", "/v1/chat/completions",
     {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
         "name": "x", "schema": {"type": "string", "pattern": "a{0,1000000000}"}}}}, "structured_outputs", "1000"),
    ("ebnf repeat {0,1000000000}", "/v1/chat/completions",
     {"messages": USER, "structured_outputs": {"grammar": 'root ::= "a"{0,1000000000}'}}, "structured_outputs",
     "1000"),
    ("schema with 1,400 optional properties", "/v1/chat/completions",
     {"messages": USER, "tools": [tool("a", 1400, "x x")], "tool_choice": {"type": "function", "function": {
         "name": "a"}}}, "structured_outputs", "properties"),
    *[(f"{path} metadata of {what}", path, {**body, "metadata": metadata}, "metadata", "metadata")
      for path, body in (("/v1/responses", {"input": "hi"}), ("/v1/chat/completions", {"messages": USER}))
      for what, metadata in (("2,000 pairs", {f"k{i}": "v" for i in range(2000)}), ("a 65-character key",
                             {"k" * 65: "v"}), ("a 513-character value", {"k": "v" * 513}))],
    ("responses tools entry 5", "/v1/responses", {"input": "hi", "tools": [5]}, "tools", "tools"),
    ("responses input item 5", "/v1/responses", {"input": [5]}, "input", "input"),
    ("responses reasoning effort 5", "/v1/responses", {"input": "hi", "reasoning": {"effort": 5}}, "reasoning_effort",
     "effort"),
    ("responses input item type []", "/v1/responses", {"input": [{"type": []}]}, "input", "type"),
    ("chat_template_kwargs 100 deep", "/v1/chat/completions",
     '{"messages":[{"role":"user","content":"hi"}],"chat_template_kwargs":{"a":' + "[" * 100 + "]" * 100 + "}}",
     "chat_template_kwargs", "64"),
]


@pytest.mark.parametrize(("path", "body", "param", "word"), [case[1:] for case in REFUSED],
                         ids=[case[0] for case in REFUSED])
def test_hostile_request_is_a_400_naming_the_field(http: httpx.Client, path: str, body: dict | str,
                                                    param: str | None, word: str) -> None:
    response = post(http, path, body)
    assert_refused(response, 400, param, word)


def test_a_64_kib_named_tool_spaced_out_is_served_within_its_limit(http: httpx.Client) -> None:
    """Its parameters are under 64 KiB as compact JSON (the documented measure) but over it with json.dumps'
    spaces: the forced call's grammar is measured the same way, so it is served instead of a 500."""
    named = tool("a", 250, "x" * 216)
    parameters = named["function"]["parameters"]
    assert len(json.dumps(parameters, separators=(",", ":"))) < 64 * 1024 < len(json.dumps(parameters))
    response = post(http, "/v1/chat/completions", {"messages": USER, "tools": [named], "max_tokens": 4,
                                                   "tool_choice": {"type": "function", "function": {"name": "a"}}})
    assert response.status_code == 200, response.text


def many_turns(count: int) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "hi"}] * count, "max_tokens": 1}).encode()


def many_items(count: int) -> bytes:
    return json.dumps({"input": [{"role": "user", "content": "hi"}] * count, "max_output_tokens": 1}).encode()


@pytest.mark.parametrize(("path", "body", "word"), [
    ("/v1/chat/completions", many_turns(200_000), "JSON strings"),
    ("/v1/responses", many_items(200_000), "JSON strings"),
    ("/v1/chat/completions", many_turns(5000), "4096"),
    ("/v1/responses", many_items(5000), "4096"),
    ("/tokenize", many_turns(5000), "4096"),
], ids=["200k messages", "200k items", "5k messages", "5k items", "5k tokenize messages"])
def test_too_many_turns_are_refused(http: httpx.Client, path: str, body: bytes, word: str) -> None:
    response = post(http, path, body)
    assert response.status_code == 400 and word in response.json()["error"]["message"], response.text


def test_health_answers_while_large_requests_are_parsed_rendered_or_refused(server: Server,
                                                                             http: httpx.Client) -> None:
    """Before: the body parsed and the template rendered on the event loop, and /health waited 2-2.5 s behind a
    200,000-message request. The bound is generous for a loaded 2-core machine; the issue's target is 100 ms."""
    bodies = [("/v1/chat/completions", many_turns(200_000)), ("/v1/responses", many_items(200_000)),
              ("/v1/chat/completions", many_turns(4000)), ("/v1/responses", many_items(4000)),
              ("/tokenize", many_turns(4000))]
    done = threading.Event()

    def send() -> None:
        with httpx.Client(base_url=server.base_url, timeout=120, headers=http.headers) as sender:
            for _ in range(3):
                for path, body in bodies:
                    sender.post(path, content=body, headers={"content-type": "application/json"})
        done.set()

    latencies = []
    sender = threading.Thread(target=send)
    sender.start()
    with httpx.Client(base_url=server.base_url, timeout=30) as probe:
        while not done.is_set():
            start = time.monotonic()
            assert probe.get("/health").status_code == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.02)
    sender.join()
    assert len(latencies) > 20 and max(latencies) < 0.5, sorted(latencies)[-5:]


@pytest.mark.parametrize(("interval", "status", "kept"), [
    ("nan", 400, None), ("inf", 400, None), ("-inf", 400, None), ("-1", 200, 0.2), ("0", 200, 0.2),
    ("1e308", 200, 10.0), ("abc", 400, None),
])
def test_dashboard_interval_is_finite_and_clamped(http: httpx.Client, interval: str, status: int,
                                                  kept: float | None) -> None:
    with http.stream("GET", "/dashboard/api/events", params={"interval": interval}) as response:
        assert response.status_code == status
        if status == 200:
            first = next(line for line in response.iter_lines() if line.startswith("data: "))
            assert json.loads(first[6:])["interval_s"] == kept
        else:
            assert response.read() and "interval" in response.json()["error"]["message"]


def test_the_key_comes_from_the_environment_and_guards_the_api_docs(server: Server) -> None:
    cmdline = Path(f"/proc/{server.process.pid}/cmdline").read_bytes()
    assert KEY.encode() not in cmdline
    with httpx.Client(base_url=server.base_url, timeout=10) as anonymous:
        for path in ("/docs", "/redoc", "/openapi.json", "/v1/models"):
            assert anonymous.get(path).status_code == 401, path
        assert anonymous.get("/health").status_code == 200
        for path in ("/rerank", "/v1/rerank", "/v1/score", "/v1/embeddings"):  # the retrieval routes too
            assert anonymous.post(path, json={}).status_code == 401, path
    with httpx.Client(base_url=server.base_url, timeout=10, headers={"Authorization": f"Bearer {KEY}"}) as keyed:
        assert keyed.get("/openapi.json").json()["info"]["title"] == "lmserve"


# ------------------------------------------------------------------------------------------------ fuzz

_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.text(max_size=8)
    | st.sampled_from(["", "function", "message", "json_schema", "json_object", "text", "user", "assistant",
                       "required", "auto", "none", "function_call", "function_call_output", "input_text"]),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(
        st.sampled_from(["type", "name", "role", "content", "text", "format", "schema", "arguments", "call_id",
                         "output", "parameters", "function", "effort", "strict"]), children, max_size=4),
    max_leaves=12,
)
_RESPONSE_FIELDS = ["input", "instructions", "tools", "tool_choice", "text", "reasoning", "metadata",
                    "max_output_tokens", "temperature", "top_p", "parallel_tool_calls", "max_tool_calls", "include",
                    "truncation", "stream", "store", "user"]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(fields=st.dictionaries(st.sampled_from(_RESPONSE_FIELDS), _VALUES, max_size=5), stream=st.booleans())
def test_fuzz_responses_never_a_5xx(http: httpx.Client, fields: dict[str, Any], stream: bool) -> None:
    body = {"input": "hi", "max_output_tokens": 2, **fields, "stream": stream}
    response = post(http, "/v1/responses", body)
    if response.status_code >= 400:
        check_answer(response)
    elif response.headers["content-type"].startswith("text/event-stream"):
        assert "response.completed" in response.text and '"error"' not in response.text.split("response.created")[0]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(message=st.dictionaries(st.sampled_from(["role", "content", "tool_calls", "tool_call_id", "name"]), _VALUES,
                               max_size=4), path=st.sampled_from(["/v1/chat/completions", "/tokenize"]))
def test_fuzz_chat_history_never_a_5xx(http: httpx.Client, message: dict[str, Any], path: str) -> None:
    response = post(http, path, {"messages": [{"role": "assistant", **message}, *USER], "max_tokens": 2})
    if response.status_code >= 400:
        check_answer(response)


def test_metadata_within_openais_bounds_is_accepted(http: httpx.Client) -> None:
    metadata = {f"{i:064d}": "v" * 512 for i in range(MAX_METADATA_PAIRS)}
    response = post(http, "/v1/responses", {"input": "hi", "max_output_tokens": 2, "metadata": metadata})
    assert response.status_code == 200 and response.json()["metadata"] == metadata
