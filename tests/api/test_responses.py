"""/v1/responses through the `openai` client's `responses.create` and `responses.stream`: text and message-item input,
instructions, function tools and their results, text.format, reasoning, typed stream events, and what a server that
keeps nothing answers (a fake engine whose answer is the rendered chat's last message)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
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
def oai(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=10)


WEATHER = {"type": "function", "name": "get_weather", "description": "the weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = '<tool_call> {"name": "get_weather", "arguments": {"city": "Paris"}} </tool_call>'


def test_text_input_with_instructions(oai: openai.OpenAI, engine: RenderingEngine) -> None:
    response = oai.responses.create(model=MODEL, input="Hello there", instructions="Be brief.")
    assert response.output_text == "Hello there"
    assert response.status == "completed" and response.object == "response" and response.id.startswith("resp_")
    assert [item.type for item in response.output] == ["message"]
    assert response.usage.output_tokens == 2 and response.usage.input_tokens == response.usage.total_tokens - 2
    assert engine.rendered[-1] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


def test_message_items_function_calls_and_their_outputs_become_the_chat(oai: openai.OpenAI, engine) -> None:
    response = oai.responses.create(model=MODEL, tools=[WEATHER], input=[
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ])
    assert response.output_text == "sunny"
    turns = engine.rendered[-1]
    assert [t["role"] for t in turns] == ["developer", "user", "assistant", "tool"]
    assert turns[2]["tool_calls"][0]["id"] == "call_1" and turns[3]["tool_call_id"] == "call_1"


def test_a_tool_call_is_a_function_call_item_whole_and_streamed(oai: openai.OpenAI) -> None:
    response = oai.responses.create(model=MODEL, tools=[WEATHER], input=CALL)
    calls = [item for item in response.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert calls[0].call_id and calls[0].status == "completed"
    with oai.responses.stream(model=MODEL, tools=[WEATHER], input=CALL) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    streamed = [item for item in final.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in streamed] == [("get_weather", {"city": "Paris"})]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds


def test_streamed_text_events_are_typed_ordered_and_add_up(oai: openai.OpenAI) -> None:
    events = list(oai.responses.create(model=MODEL, input="one two three", stream=True))
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * 3, "response.output_text.done",
                     "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "one two three"
    completed = events[-1].response
    assert completed.output_text == "one two three" and completed.usage.output_tokens == 3
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {completed.output[0].id}  # one message item, the same id throughout


def test_the_stream_helper_and_reasoning(oai: openai.OpenAI) -> None:
    text = "<think> compare both </think> Paris ."
    whole = oai.responses.create(model=MODEL, input=text)
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == " compare both " and whole.output_text == " Paris ."
    with oai.responses.stream(model=MODEL, input=text) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == " Paris ." and final.output_text == " Paris ."
    assert final.output[0].type == "reasoning"


def test_max_output_tokens_makes_an_incomplete_response(oai: openai.OpenAI) -> None:
    response = oai.responses.create(model=MODEL, input="a b c d e", max_output_tokens=2)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text == "a b"
    events = list(oai.responses.create(model=MODEL, input="a b c d e", max_output_tokens=2, stream=True))
    assert events[-1].type == "response.completed" and events[-1].response.status == "incomplete"
    with oai.responses.stream(model=MODEL, input="a b c d e", max_output_tokens=2) as stream:
        assert stream.get_final_response().status == "incomplete"  # the client's helper takes it as the end


def test_text_format_json_schema_is_the_chat_response_format(server: str, engine: RenderingEngine) -> None:
    fmt = {"type": "json_schema", "name": "city", "schema": {"type": "object", "properties": {"name": {"type": "string"}}},
           "strict": True}
    response = httpx.post(f"{server}/v1/responses", json={"model": MODEL, "input": "x", "text": {"format": fmt}})
    assert response.status_code == 200, response.text
    assert response.json()["text"] == {"format": fmt}
    bad = httpx.post(f"{server}/v1/responses", json={"model": MODEL, "input": "x", "text": {"format": {"type": "xml"}}})
    assert bad.status_code == 400 and "text.format" in bad.json()["error"]["message"]


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": "x", "previous_response_id": "resp_123"}, 404, "previous_response_id"),
        ({"input": "x", "background": True}, 400, "background"),
        ({"input": [{"type": "input_image", "image_url": "http://x"}]}, 400, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, 400, "input"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools"),
        ({"input": "x", "tool_choice": {"type": "file_search"}}, 400, "tool_choice"),
        ({"input": "x", "bogus": 1}, 400, None),
        ({"input": "x", "model": "other"}, 404, "model"),
        ({}, 400, None),
    ],
)
def test_what_cannot_be_served_is_a_clear_error(server: str, body: dict, status: int, param: str | None) -> None:
    response = httpx.post(f"{server}/v1/responses", json={"model": MODEL, **body})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and (param is None or error["param"] == param)


def test_nothing_is_stored(server: str, oai: openai.OpenAI) -> None:
    response = oai.responses.create(model=MODEL, input="hi", store=True)
    assert response.store is False
    fetched = httpx.get(f"{server}/v1/responses/{response.id}")
    assert fetched.status_code == 404 and "keeps no responses" in fetched.json()["error"]["message"]
