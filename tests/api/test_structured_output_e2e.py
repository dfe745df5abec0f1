"""Structured output and forced tool calls on the real server (default model, official openai client).

The server runs with a small KV cache, so the concurrent constrained requests below are also preempted and resumed:
their outputs must still follow their grammars.
"""

from __future__ import annotations

import collections
import json
import re
import signal
import threading
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from server_process import HTTP, Server, start_server

MODEL = "smollm2-135m-instruct"

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 9999},
            "email": {"type": "string", "maxLength": 30}}, "required": ["id", "email"], "additionalProperties": False},
        "active": {"type": "boolean"}}, "required": ["user", "active"], "additionalProperties": False},
    "bounded_array": {"type": "object", "properties": {
        "items": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1, "maxItems": 3}},
        "required": ["items"], "additionalProperties": False},
    "enums": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "size": {"type": "string", "enum": ["S", "M", "L"]}},
        "required": ["color", "size"], "additionalProperties": False},
    "number_range": {"type": "object", "properties": {
        "celsius": {"type": "number", "minimum": -50, "maximum": 60}}, "required": ["celsius"],
        "additionalProperties": False},
    "array_of_objects": {"type": "object", "properties": {
        "points": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
            "x": {"type": "integer", "minimum": -9, "maximum": 9}, "y": {"type": "integer", "minimum": -9, "maximum": 9}},
            "required": ["x", "y"], "additionalProperties": False}}}, "required": ["points"],
        "additionalProperties": False},
    "optional_fields": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 30}, "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "genre": {"type": "string", "maxLength": 15}}, "required": ["title"], "additionalProperties": False},
    "nullable": {"type": "object", "properties": {
        "ok": {"type": "boolean"}, "note": {"type": ["string", "null"], "maxLength": 20}},
        "required": ["ok", "note"], "additionalProperties": False},
    "top_level_array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                        "minItems": 2, "maxItems": 5},
    "pattern": {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
        "count": {"type": "integer", "minimum": 1, "maximum": 5}}, "required": ["code", "count"],
        "additionalProperties": False},
}

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 10}}, "required": ["zone"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Server:
    # About 450 positions of KV: ten constrained requests at once do not fit, so some are preempted.
    srv = start_server(tmp_path_factory.mktemp("structured"), "--max-model-len", "512", "--kv-cache-memory", "10MiB")
    yield srv
    srv.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def engine_stats(server: Server) -> dict:
    return HTTP.get(f"{server.base_url}/debug/engine", timeout=10).json()


def ask_json(client: openai.OpenAI, name: str, stream: bool, seed: int | None) -> str:
    sampling = {"temperature": 1.0, "seed": seed} if seed is not None else {"temperature": 0.0}
    response_format = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}
    messages = [{"role": "user", "content": f"Answer with a JSON value for '{name.replace('_', ' ')}'."}]
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=200, stream=stream,
                                              response_format=response_format, **sampling)
    if stream:
        return "".join(c.choices[0].delta.content or "" for c in response if c.choices)
    assert response.choices[0].finish_reason == "stop"
    return response.choices[0].message.content


def run_concurrently(client: openai.OpenAI, jobs: list[tuple]) -> dict[tuple, str]:
    results: dict[tuple, str] = {}

    def run(job: tuple) -> None:
        results[job] = ask_json(client, *job)

    threads = [threading.Thread(target=run, args=(job,)) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert len(results) == len(jobs)
    for (name, stream, seed), text in results.items():
        jsonschema.validate(json.loads(text), SCHEMAS[name]), (name, stream, seed, text)
    return results


def num_tokens(server: Server, texts: Any) -> int:
    return sum(httpx.post(f"{server.base_url}/tokenize", json={"prompt": text, "add_special_tokens": False},
                          timeout=10).json()["count"] for text in texts)


def test_every_schema_validates_greedy_seeded_streamed_and_not(client: openai.OpenAI, server: Server) -> None:
    before = engine_stats(server)
    results: dict[tuple, str] = {}
    for stream, seed in ((False, None), (True, 7), (True, None), (False, 11)):  # ten schemas at a time
        results |= run_concurrently(client, [(name, stream, seed) for name in SCHEMAS])
    for name in SCHEMAS:  # greedy answers do not depend on streaming
        assert results[(name, False, None)] == results[(name, True, None)]
    assert engine_stats(server)["num_preemptions"] > before["num_preemptions"], "meant to preempt some requests"


def test_sixteen_requests_with_different_schemas_share_engine_steps(client: openai.OpenAI, server: Server) -> None:
    jobs = [(name, True, seed) for seed in (21, 22) for name in SCHEMAS][:16]
    run_concurrently(client, [(name, False, None) for name in SCHEMAS])  # grammars compiled and cached
    run_concurrently(client, jobs)
    # Which engine steps each of the sixteen ran in (their timelines): one request at a time, no step would hold two.
    # (Counting all steps against all tokens instead failed once in a full run: when the sixteen arrive spread out
    # over a loaded machine's API process, the first ones finish before the last ones start.)
    timelines = HTTP.get(f"{server.base_url}/dashboard/api/requests", params={"limit": len(jobs)}, timeout=10)
    per_step = collections.Counter(span[0] for t in timelines.json()["data"] for span in t["steps"])  # [index, ...]
    assert max(per_step.values()) >= len(jobs) // 2, per_step


def test_json_object_regex_and_choice(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a cat as a JSON object."}], max_tokens=400,
        temperature=0, response_format={"type": "json_object"},
    )
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].message.content), dict)
    for seed in (1, 2, 3):
        text = client.completions.create(model=MODEL, prompt="A phone number:", max_tokens=20, temperature=1.0,
                                         seed=seed, extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}})
        assert re.fullmatch(r"\d{3}-\d{4}", text.choices[0].text)
        choice = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Is the sky green?"}], max_tokens=5, temperature=1.0,
            seed=seed, extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe not"]}})
        assert choice.choices[0].message.content in ("yes", "no", "maybe not")


def test_disable_any_whitespace_false_lets_the_json_have_free_whitespace(client: openai.OpenAI) -> None:
    """vLLM's `structured_outputs.disable_any_whitespace`: lmserve's JSON is compact unless a request sets it to
    false (then the model may write newlines and indentation between tokens), and it shapes response_format's
    constraint when structured_outputs asks for none itself."""
    def answer(structured: dict | None) -> str:
        out = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Describe a cat as a JSON object."}], max_tokens=60,
            temperature=0, response_format={"type": "json_object"},
            extra_body={"structured_outputs": structured} if structured is not None else None)
        return out.choices[0].message.content

    compact = answer(None)
    assert "\n" not in compact and json.loads(compact)
    assert answer({"disable_any_whitespace": True}) == compact
    assert re.match(r"\{\s*\n\s*\"", answer({"disable_any_whitespace": False}))  # this model's habit: pretty JSON


def tool_call(client: openai.OpenAI, tool_choice: Any, stream: bool) -> tuple[list[tuple[str, str]], str]:
    messages = [{"role": "user", "content": "What is the weather in Paris, and the time in Tokyo?"}]
    response = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME], max_tokens=200,
                                              temperature=0, tool_choice=tool_choice, stream=stream)
    if not stream:
        message = response.choices[0].message
        assert message.content is None
        return [(c.function.name, c.function.arguments) for c in message.tool_calls], response.choices[0].finish_reason
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in response:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or ():
                if delta.id is not None:
                    calls[delta.index] = [delta.function.name, ""]
                calls[delta.index][1] += delta.function.arguments or ""
    return [(name, arguments) for name, arguments in (calls[i] for i in sorted(calls))], finish


def test_parallel_tool_calls_false_bounds_required_to_one_call(client: openai.OpenAI) -> None:
    """parallel_tool_calls false reaches the grammar of "required" (maxItems 1, tests/api/test_tools.py): one call,
    whole and streamed alike."""
    messages = [{"role": "user", "content": "What is the weather in Paris, and the time in Tokyo?"}]
    for stream in (False, True):
        response = client.chat.completions.create(
            model=MODEL, messages=messages, tools=[WEATHER, TIME], max_tokens=200, temperature=0,
            tool_choice="required", parallel_tool_calls=False, stream=stream)
        if stream:
            indices = {d.index for chunk in response for c in chunk.choices for d in c.delta.tool_calls or ()}
            assert indices == {0}
        else:
            (call,) = response.choices[0].message.tool_calls
            assert call.function.name in ("get_weather", "get_time")
            assert response.choices[0].finish_reason == "tool_calls"


def test_forced_tool_calls_validate_and_stream_the_same(client: openai.OpenAI) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    named = {"type": "function", "function": {"name": "get_weather"}}
    for tool_choice, finish in ((named, "stop"), ("required", "tool_calls")):
        calls, finish_reason = tool_call(client, tool_choice, stream=False)
        assert finish_reason == finish and calls
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), schemas[name])
        if tool_choice is named:
            assert [name for name, _ in calls] == ["get_weather"]
        assert tool_call(client, tool_choice, stream=True) == (calls, finish_reason)
    # A tool result goes back in as a "tool" message after the assistant's call.
    follow_up = client.chat.completions.create(model=MODEL, max_tokens=20, temperature=0, tools=[WEATHER],
                                               tool_choice="none", messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees and sunny"},
    ])
    assert follow_up.choices[0].message.content


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     None, "nonsense"),
    ({"structured_outputs": {"regex": "(["}}, None, "regex"),
    ({"structured_outputs": {"json": {"type": "string", "maxLength": 10**9}}}, None, "maxLength"),
    ({"structured_outputs": {"grammar": "root ::= "}}, None, "grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"disable_any_whitespace": False}}, "structured_outputs", "got only options"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "send one"),
    ({"response_format": {"type": "yaml"}}, "response_format", "type"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "tools"),
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice", "--enable-auto-tool-choice"),
    ({"suffix": "x"}, "suffix", "unsupported"),
])
def test_bad_constraints_are_400s_naming_the_problem(server: Server, body: dict, param: str | None,
                                                     words: str) -> None:
    request = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body}
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=request, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert words in error["message"]
    if param is not None:
        assert error["param"] == param
