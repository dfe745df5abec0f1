"""tool_choice "auto" with --enable-auto-tool-choice --tool-call-parser hermes: the model's own <tool_call> blocks
become OpenAI tool calls, whole and streamed (the fake engine answers with the prompt's words)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator

import openai
import pytest
from server_process import Server
from test_api_fake_engine import MODEL, FakeEngine, ServerThread

from lmserve.api.server import build_app
from lmserve.api.serving import ToolConfig

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALLING = 'Checking. <tool_call> {"name": "get_weather", "arguments": {"city": "Paris"}} </tool_call>'


@pytest.fixture(scope="module")
def oai() -> Iterator[openai.OpenAI]:
    app = build_app(FakeEngine(), tools=ToolConfig(enable_auto_tool_choice=True, tool_call_parser="hermes"))
    with ServerThread(app) as running:
        yield openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0, timeout=10)


def streamed_calls(chunks: Iterable) -> tuple[str, dict[int, str], dict[int, str], str | None]:
    """A streamed chat answer put together: its content, each call's name and arguments by index, its finish reason."""
    content, names, arguments, finish = "", {}, {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or ():
                if delta.id is not None:
                    names[delta.index] = delta.function.name
                arguments[delta.index] = arguments.get(delta.index, "") + (delta.function.arguments or "")
    return content, names, arguments, finish


def ask(oai: openai.OpenAI, content: str, stream: bool):
    return oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                       tools=[WEATHER], stream=stream)


def test_a_hermes_tool_call_becomes_tool_calls_whole_and_streamed(oai: openai.OpenAI) -> None:
    whole = ask(oai, CALLING, stream=False).choices[0]
    assert whole.finish_reason == "tool_calls"
    (call,) = whole.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert whole.message.content == "user: Checking. "

    content, names, arguments, finish = streamed_calls(ask(oai, CALLING, stream=True))
    assert content == whole.message.content and finish == "tool_calls"
    assert names == {0: "get_weather"} and arguments == {0: call.function.arguments}


def test_an_answer_without_a_call_is_plain_content(oai: openai.OpenAI) -> None:
    whole = ask(oai, "just words", stream=False).choices[0]
    assert whole.message.tool_calls is None and whole.finish_reason == "stop"
    assert whole.message.content == "user: just words assistant:"
    streamed = "".join(c.choices[0].delta.content or "" for c in ask(oai, "just words", stream=True) if c.choices)
    assert streamed == whole.message.content


def test_tool_flags_are_checked_at_start() -> None:
    with pytest.raises(ValueError, match="--tool-call-parser"):
        ToolConfig(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="hermes"):
        ToolConfig(tool_call_parser="nope")


def test_parallel_tool_calls_false_keeps_the_first_call_whole_and_streamed(oai: openai.OpenAI) -> None:
    two = CALLING + ' <tool_call> {"name": "get_weather", "arguments": {"city": "Rome"}} </tool_call>'
    kwargs = {"model": MODEL, "messages": [{"role": "user", "content": two}], "tools": [WEATHER]}
    assert len(oai.chat.completions.create(**kwargs).choices[0].message.tool_calls) == 2
    whole = oai.chat.completions.create(**kwargs, parallel_tool_calls=False).choices[0]
    (call,) = whole.message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Paris"} and whole.finish_reason == "tool_calls"
    indices, arguments = set(), ""
    for chunk in oai.chat.completions.create(**kwargs, parallel_tool_calls=False, stream=True):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or ():
                indices.add(delta.index)
                arguments += delta.function.arguments or ""
    assert indices == {0} and arguments == call.function.arguments


@pytest.fixture(scope="module")
def no_parser() -> Iterator[openai.OpenAI]:
    with ServerThread(build_app(FakeEngine())) as running:
        yield openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0, timeout=10)


def test_tools_without_tool_choice_mean_auto_which_needs_a_parser(no_parser: openai.OpenAI) -> None:
    """OpenAI's and vLLM's default with tools is "auto"; on a server without a parser that is a 400 naming the
    flags (vLLM's answer), not a silent "none" whose tool-call text would come back as the answer."""
    for extra in ({}, {"tool_choice": "auto"}):
        with pytest.raises(openai.BadRequestError) as info:
            no_parser.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": CALLING}],
                                              tools=[WEATHER], **extra)
        assert "--enable-auto-tool-choice" in info.value.body["message"]
        assert "--tool-call-parser" in info.value.body["message"] and info.value.body["param"] == "tool_choice"
    answer = no_parser.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                               tools=[WEATHER], tool_choice="none").choices[0]
    assert answer.message.tool_calls is None and answer.message.content == "user: hi assistant:"
    plain = no_parser.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert plain.choices[0].message.content == "user: hi assistant:"


def test_a_streamed_call_comes_as_vllm_sends_it_name_first_then_its_arguments(oai: openai.OpenAI) -> None:
    pieces = [c.choices[0].delta.tool_calls for c in ask(oai, CALLING, stream=True) if c.choices]
    pieces = [p for p in pieces if p]
    head, *fragments = [call for piece in pieces for call in piece]
    assert head.id and head.type == "function" and head.function.name == "get_weather"
    assert not head.function.arguments
    assert fragments and all(f.id is None and f.function.name is None for f in fragments)
    assert json.loads("".join(f.function.arguments for f in fragments)) == {"city": "Paris"}
    assert len(pieces) >= 2  # the name and the arguments in chunks of their own


def test_a_real_models_call_in_auto_mode_whole_and_streamed(default_hermes_server: Server) -> None:
    """The real engine and detokenizer under --enable-auto-tool-choice: the default model, held to a hermes call by a
    regex (a tiny model does not choose to call on its own), writes its call token by token; tool_choice is left
    unset (auto, as agent frameworks send it), and the parser turns the text into the same call whole and streamed."""
    real = openai.OpenAI(base_url=f"{default_hermes_server.base_url}/v1", api_key="unused", max_retries=0,
                         timeout=60)
    forced = {"regex": r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{1,12}"\}\}'
                       r"\n</tool_call>"}

    def ask_real(stream: bool):
        return real.chat.completions.create(
            model="smollm2-135m-instruct", messages=[{"role": "user", "content": "The weather in Paris?"}],
            tools=[WEATHER], max_tokens=80, temperature=0, stream=stream,
            extra_body={"structured_outputs": forced})

    whole = ask_real(stream=False).choices[0]
    assert whole.finish_reason == "tool_calls" and not whole.message.content
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_weather" and list(json.loads(call.function.arguments)) == ["city"]
    names, arguments, finish = {}, {}, None
    for chunk in ask_real(stream=True):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or ():
                if delta.id is not None:
                    names[delta.index] = delta.function.name
                arguments[delta.index] = arguments.get(delta.index, "") + (delta.function.arguments or "")
    assert finish == "tool_calls" and names == {0: "get_weather"} and arguments == {0: call.function.arguments}
