"""/v1/messages on the real engine (the default model, --enable-auto-tool-choice --tool-call-parser hermes) through
the official `anthropic` client: text whole and streamed, stop_sequences, a forced tool call and its tool_result round
trip, count_tokens against the usage a message reports."""

from __future__ import annotations

import anthropic
import pytest
from server_process import Server

MODEL = "smollm2-135m-instruct"
WEATHER = {"name": "get_weather", "description": "the weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                            "required": ["city"]}}
GREEDY = {"temperature": 0}  # the SDK leaves sampling fields out of its signature; the API still takes them
ASK = [{"role": "user", "content": "Write a short sentence about the sea."}]


@pytest.fixture(scope="module")
def client(default_hermes_server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=default_hermes_server.base_url, api_key="unused", max_retries=0, timeout=120)


def test_text_whole_and_streamed_are_the_same(client: anthropic.Anthropic) -> None:
    whole = client.messages.create(model=MODEL, max_tokens=24, messages=ASK, extra_body=GREEDY)
    assert whole.content[0].type == "text" and whole.content[0].text.strip()
    assert whole.stop_reason in ("end_turn", "max_tokens") and 0 < whole.usage.output_tokens <= 24
    with client.messages.stream(model=MODEL, max_tokens=24, messages=ASK, extra_body=GREEDY) as stream:
        types = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert types[0] == "message_start" and types[-1] == "message_stop" and "text" in types
    assert streamed.content[0].text == whole.content[0].text and streamed.stop_reason == whole.stop_reason
    assert streamed.usage.output_tokens == whole.usage.output_tokens
    assert client.messages.count_tokens(model=MODEL, messages=ASK).input_tokens == whole.usage.input_tokens


def test_a_stop_sequence_ends_the_turn_and_is_named(client: anthropic.Anthropic) -> None:
    text = client.messages.create(model=MODEL, max_tokens=24, messages=ASK, extra_body=GREEDY).content[0].text
    word = text.split()[2]  # a word the greedy answer reaches
    whole = client.messages.create(model=MODEL, max_tokens=24, messages=ASK, stop_sequences=[word], extra_body=GREEDY)
    assert whole.stop_reason == "stop_sequence" and whole.stop_sequence == word
    assert whole.content[0].text == text[:text.index(word)]
    with client.messages.stream(model=MODEL, max_tokens=24, messages=ASK, stop_sequences=[word],
                                extra_body=GREEDY) as stream:
        streamed = stream.get_final_message()
    assert (streamed.stop_reason, streamed.stop_sequence, streamed.content[0].text) == (
        "stop_sequence", word, whole.content[0].text)


def test_a_forced_tool_call_and_its_result_round_trip(client: anthropic.Anthropic) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced = {"type": "tool", "name": "get_weather"}
    whole = client.messages.create(model=MODEL, max_tokens=60, messages=ask, tools=[WEATHER], tool_choice=forced,
                                   extra_body=GREEDY)
    (call,) = [block for block in whole.content if block.type == "tool_use"]
    assert whole.stop_reason == "tool_use" and call.name == "get_weather" and list(call.input) == ["city"]
    with client.messages.stream(model=MODEL, max_tokens=60, messages=ask, tools=[WEATHER], tool_choice=forced,
                                extra_body=GREEDY) as stream:
        deltas = [event.delta.type for event in stream if event.type == "content_block_delta"]
        streamed = stream.get_final_message()
    assert "input_json_delta" in deltas and streamed.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [(call.name, call.input)]

    answer = client.messages.create(model=MODEL, max_tokens=30, tools=[WEATHER], extra_body=GREEDY, messages=[
        *ask, {"role": "assistant", "content": [{"type": "tool_use", "id": call.id, "name": call.name,
                                                 "input": call.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 24 C"}]},
    ])
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use") and answer.content
    assert answer.usage.input_tokens > whole.usage.input_tokens
