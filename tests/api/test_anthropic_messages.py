"""/v1/messages and /v1/messages/count_tokens through the official `anthropic` client: system prompts, text,
tool_use and tool_result blocks, tools and tool_choice, thinking, stop reasons, usage, Anthropic's typed stream
events in their documented order, its error shape, and x-api-key (a fake engine whose answer is the rendered chat's
last message; test_anthropic_real.py runs the default model)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest
from test_api_fake_engine import MODEL, FakeEngine, ServerThread

from lmserve.api.server import build_app
from lmserve.api.serving import ToolConfig


class RenderingEngine(FakeEngine):
    """Answers with the last message's words, and remembers every rendered conversation."""

    def __init__(self) -> None:
        super().__init__()
        self.rendered: list[list[dict]] = []

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kw: Any) -> str:
        self.rendered.append(messages)
        return messages[-1]["content"] or "empty"


@pytest.fixture(scope="module")
def engine() -> RenderingEngine:
    return RenderingEngine()


@pytest.fixture(scope="module")
def server(engine: RenderingEngine) -> Iterator[str]:
    tools = ToolConfig(enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3")
    with ServerThread(build_app(engine, tools=tools)) as running:
        yield running.url


@pytest.fixture(scope="module")
def client(server: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0, timeout=10)


WEATHER = {"name": "get_weather", "description": "the weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = '<tool_call> {"name": "get_weather", "arguments": {"city": "Paris"}} </tool_call>'

# Anthropic's documented order: message_start, then per block start, deltas, stop; then message_delta, message_stop
# (ping anywhere).
def check_event_order(types: list[str]) -> None:
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    open_block = False
    for kind in types[1:-2]:
        if kind == "ping":
            continue
        if kind == "content_block_start":
            assert not open_block
            open_block = True
        elif kind == "content_block_delta":
            assert open_block
        elif kind == "content_block_stop":
            assert open_block
            open_block = False
        else:
            raise AssertionError(f"unexpected event {kind} in {types}")
    assert not open_block and "content_block_start" in types


def test_text_with_a_system_prompt_whole_and_streamed(client: anthropic.Anthropic, engine: RenderingEngine) -> None:
    message = client.messages.create(model=MODEL, max_tokens=50, system="Be brief.",
                                     messages=[{"role": "user", "content": "Hello there"}])
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [(b.type, b.text) for b in message.content] == [("text", "Hello there")]
    assert message.stop_reason == "end_turn" and message.stop_sequence is None and message.model == MODEL
    assert message.usage.output_tokens == 2 and message.usage.input_tokens > 0
    assert engine.rendered[-1] == [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "Hello there"}]

    with client.messages.stream(model=MODEL, max_tokens=50, system=[{"type": "text", "text": "Be brief."}],
                                messages=[{"role": "user", "content": [{"type": "text", "text": "Hello there"}]}]) as s:
        types = [event.type for event in s]
        final = s.get_final_message()
    check_event_order([t for t in types if t in ANTHROPIC_EVENTS])
    assert final.content[0].text == "Hello there" and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == 2 and final.usage.input_tokens == message.usage.input_tokens


ANTHROPIC_EVENTS = {"message_start", "content_block_start", "content_block_delta", "content_block_stop",
                    "message_delta", "message_stop", "ping"}


def test_max_tokens_is_required_and_ends_the_turn(client: anthropic.Anthropic, server: str) -> None:
    message = client.messages.create(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "one two"}])
    assert message.stop_reason == "max_tokens" and message.content[0].text == "one"
    answer = httpx.post(f"{server}/v1/messages", json={"messages": [{"role": "user", "content": "hi"}]})
    assert answer.status_code == 400
    assert answer.json()["type"] == "error" and answer.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in answer.json()["error"]["message"]


def test_a_tool_call_is_a_tool_use_block_whole_and_streamed(client: anthropic.Anthropic) -> None:
    message = client.messages.create(model=MODEL, max_tokens=50, tools=[WEATHER],
                                     messages=[{"role": "user", "content": CALL}])
    assert message.stop_reason == "tool_use"
    (call,) = [b for b in message.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.input == {"city": "Paris"} and call.id

    with client.messages.stream(model=MODEL, max_tokens=50, tools=[WEATHER],
                                messages=[{"role": "user", "content": CALL}]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    check_event_order([e.type for e in events if e.type in ANTHROPIC_EVENTS])
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert any(d.type == "input_json_delta" for d in deltas)
    (streamed,) = [b for b in final.content if b.type == "tool_use"]
    assert streamed.name == "get_weather" and streamed.input == {"city": "Paris"}
    assert final.stop_reason == "tool_use"


def test_a_tool_round_trip_becomes_the_chat_turns(client: anthropic.Anthropic, engine: RenderingEngine) -> None:
    message = client.messages.create(model=MODEL, max_tokens=50, tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                          {"type": "thinking", "thinking": "hm", "signature": "x"},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "sunny"}]}]},
    ])
    assert message.content[0].text == "sunny" and message.stop_reason == "end_turn"
    turns = engine.rendered[-1]
    assert [t["role"] for t in turns] == ["user", "assistant", "tool"]
    assert turns[1]["content"] == "Checking."
    assert turns[1]["tool_calls"] == [{"id": "toolu_1", "type": "function",
                                       "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    assert turns[2] == {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}


def test_thinking_comes_as_a_thinking_block_whole_and_streamed(client: anthropic.Anthropic) -> None:
    text = "<think> compare both </think> Paris ."
    message = client.messages.create(model=MODEL, max_tokens=50, messages=[{"role": "user", "content": text}])
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert "compare both" in message.content[0].thinking and message.content[1].text.strip() == "Paris ."
    with client.messages.stream(model=MODEL, max_tokens=50, messages=[{"role": "user", "content": text}]) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[1].text.strip() == "Paris ."


def test_count_tokens_counts_what_the_message_would_render(client: anthropic.Anthropic) -> None:
    messages = [{"role": "user", "content": "one two three"}]
    counted = client.messages.count_tokens(model=MODEL, messages=messages, system="sys")
    created = client.messages.create(model=MODEL, max_tokens=5, messages=messages, system="sys")
    assert counted.input_tokens == created.usage.input_tokens > 0


def test_tool_choice_and_metadata_are_accepted(client: anthropic.Anthropic, engine: RenderingEngine) -> None:
    message = client.messages.create(model=MODEL, max_tokens=50, tools=[WEATHER], tool_choice={"type": "none"},
                                     metadata={"user_id": "u-1"}, service_tier="auto",
                                     extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 5},
                                     messages=[{"role": "user", "content": CALL}])
    assert message.stop_reason == "end_turn" and not [b for b in message.content if b.type == "tool_use"]


@pytest.mark.parametrize(("body", "words"), [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type":
                    "image/png", "data": "AAAA"}}]}]}, "vision"),
    ({"messages": [{"role": "system", "content": "x"}]}, "role"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "content"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "text"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": 3}]}]}, "tool_use_id"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": 3}]}]},
     "input"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * 2000}]}, "1024"),
    ({"messages": [{"role": "user", "content": "x"}] * 5000}, "4096"),
    ({"system": [{"type": "image"}]}, "vision"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tools"),
    ({"tools": [{"name": "bad name!", "input_schema": {"type": "object"}}]}, "name"),
    ({"tools": [{"name": "f"}]}, "input_schema"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "nope"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ({"metadata": {"user_id": "u" * 300}}, "user_id"),
    ({"metadata": {"other": "x"}}, "metadata"),
    ({"stop_sequences": ["x"] * 100}, "stop"),
    ({"temperature": 1.5}, "temperature"),
    ({"top_k": -5}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 10**12}, "max_tokens"),
    ({"thinking": {"type": "maybe"}}, "thinking"),
    ({"output_config": {"format": {"type": "xml"}}}, "output_config"),
    ({"unknown_field": 1}, "unknown_field"),
    ({"messages": [{"role": "user", "content": "x", "deep": json.loads("[" * 100 + "]" * 100)}]}, "deep"),
    ({"model": "claude-sonnet-4"}, "claude-sonnet-4"),
])
def test_hostile_and_unsupported_requests_get_a_4xx_in_anthropics_shape(server: str, body: dict, words: str) -> None:
    request = {"model": MODEL, "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}], **body}
    answer = httpx.post(f"{server}/v1/messages", json=request, timeout=10)
    assert 400 <= answer.status_code < 500, answer.text
    error = answer.json()
    assert error["type"] == "error" and error["error"]["type"] in ("invalid_request_error", "not_found_error")
    assert words.lower() in error["error"]["message"].lower(), error


def test_the_client_raises_its_own_errors(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=MODEL, max_tokens=10, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://example.com/a.png"}}]}])
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-opus-4", max_tokens=10, messages=[{"role": "user", "content": "hi"}])


def test_x_api_key_is_accepted_as_well_as_a_bearer_token(engine: RenderingEngine) -> None:
    with ServerThread(build_app(engine, api_key="sekret")) as running:
        good = anthropic.Anthropic(base_url=running.url, api_key="sekret", max_retries=0, timeout=10)
        assert good.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "hi"}]).content
        bearer = httpx.post(f"{running.url}/v1/messages", headers={"Authorization": "Bearer sekret"},
                            json={"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})
        assert bearer.status_code == 200
        bad = anthropic.Anthropic(base_url=running.url, api_key="nope", max_retries=0, timeout=10)
        with pytest.raises(anthropic.AuthenticationError) as caught:
            bad.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "hi"}])
        assert caught.value.body["error"]["type"] == "authentication_error"
        assert httpx.get(f"{running.url}/v1/models", headers={"x-api-key": "sekret"}).status_code == 200
