"""gpt-oss's harmony format through the server, with the official `openai` client: chat and Responses, streamed and
not, a tool call and its result, on a tiny model scripted to think, answer or call (tests/api/harmony_model.py).

The server is started with no parser flags: the model's chat template speaks harmony, so lmserve renders its prompts
(lmserve.harmony), stops its turns on <|return|> and <|call|>, and reads its output as harmony messages."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import transformers
from harmony_model import ANSWER_TEXT, ARGUMENTS, SUN, THOUGHT, build_harmony_model
from server_process import Server, start_server

MODEL = "gpt-oss-scripted"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
RESPONSES_WEATHER = {"type": "function", **WEATHER["function"]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> Path:
    return build_harmony_model(tmp_path_factory.mktemp("harmony-model"), default_tokenizer)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Server]:
    running = start_server(tmp_path_factory.mktemp("harmony-server"), "--model", str(model_dir), "--dtype",
                           "float32", "--max-model-len", "512", "--served-model-name", MODEL)
    try:
        yield running
    finally:
        running.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def oai(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def chat(oai: openai.OpenAI, messages: list[dict], stream: bool = False, **kw: Any) -> Any:
    return oai.chat.completions.create(model=MODEL, messages=messages, stream=stream, **{"temperature": 0,
                                                                                          "max_tokens": 40, **kw})


def streamed_message(chunks: Any) -> tuple[str, str, list[Any], str | None]:
    """(reasoning, content, tool-call deltas, finish_reason) of a streamed chat choice."""
    reasoning, content, calls, finish = "", "", [], None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            assert not (getattr(delta, "reasoning_content", None) and delta.content), "a delta carries both"
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
            calls += delta.tool_calls or []
            finish = choice.finish_reason or finish
    return reasoning, content, calls, finish


ASK_SUNNY = [{"role": "user", "content": f"How is the weather? {SUN}"}]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_the_analysis_channel_is_reasoning_and_the_final_channel_content(oai: openai.OpenAI) -> None:
    reply = chat(oai, ASK_SUNNY)
    choice = reply.choices[0]
    assert (choice.message.reasoning_content, choice.message.content) == (THOUGHT, ANSWER_TEXT)
    assert choice.finish_reason == "stop" and not choice.message.tool_calls  # stopped at <|return|>
    assert streamed_message(chat(oai, ASK_SUNNY, stream=True)) == (THOUGHT, ANSWER_TEXT, [], "stop")


def test_include_reasoning_false_drops_the_thinking(oai: openai.OpenAI) -> None:
    message = chat(oai, ASK_SUNNY, extra_body={"include_reasoning": False}).choices[0].message
    assert message.content == ANSWER_TEXT and getattr(message, "reasoning_content", None) is None
    streamed = streamed_message(chat(oai, ASK_SUNNY, stream=True, extra_body={"include_reasoning": False}))
    assert streamed == ("", ANSWER_TEXT, [], "stop")


def test_max_tokens_counts_the_reasoning(oai: openai.OpenAI) -> None:
    # <|channel|> analysis <|message|> The " user": five tokens, all of them the thinking's.
    reply = chat(oai, ASK_SUNNY, max_tokens=5)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 5
    assert (reply.choices[0].message.reasoning_content, reply.choices[0].message.content) == ("The user", None)
    assert streamed_message(chat(oai, ASK_SUNNY, stream=True, max_tokens=5)) == ("The user", "", [], "length")


def test_a_tool_call_and_its_result(oai: openai.OpenAI, server: Server, model_dir: Path) -> None:
    reply = chat(oai, ASK_WEATHER, tools=[WEATHER])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", ARGUMENTS)

    reasoning, content, deltas, finish = streamed_message(chat(oai, ASK_WEATHER, stream=True, tools=[WEATHER]))
    assert (reasoning, content, finish) == ("", "", "tool_calls")
    # vLLM's shape: the call's id and name in one chunk, its arguments in the next.
    assert {d.index for d in deltas} == {0} and [d.function.name for d in deltas if d.id] == ["get_weather"]
    assert "".join(d.function.arguments or "" for d in deltas) == ARGUMENTS

    history = [*ASK_WEATHER, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": f"{SUN} 21 degrees"}]
    answer = chat(oai, history, tools=[WEATHER]).choices[0]
    assert (answer.message.reasoning_content, answer.message.content, answer.finish_reason) == \
        (THOUGHT, ANSWER_TEXT, "stop")
    # The result went back as harmony's tool message, the prompt exactly what gpt-oss's template writes.
    tokens = httpx.post(f"{server.base_url}/tokenize", timeout=30,
                        json={"model": MODEL, "messages": history, "tools": [WEATHER]}).json()["tokens"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    sent = history[:]
    sent[1] = {**sent[1], "tool_calls": [{**call.model_dump(), "function": {"name": "get_weather",
                                                                            "arguments": {"city": "Paris"}}}]}
    expected = tokenizer.apply_chat_template(sent, tools=[WEATHER], add_generation_prompt=True, tokenize=False)
    assert tokens == tokenizer.encode(expected, add_special_tokens=False)
    assert "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>" in expected


def test_a_call_no_tool_was_offered_for_is_dropped(oai: openai.OpenAI) -> None:
    choice = chat(oai, ASK_WEATHER).choices[0]  # the script calls get_weather anyway
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (None, None, "stop")


def test_responses_reasoning_and_output_text(oai: openai.OpenAI) -> None:
    response = oai.responses.create(model=MODEL, input=ASK_SUNNY[0]["content"], reasoning={"effort": "low"},
                                    max_output_tokens=40, temperature=0)
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "message"] and response.status == "completed"
    assert response.output[0].content[0].text == THOUGHT and response.output_text == ANSWER_TEXT

    events = list(oai.responses.create(model=MODEL, input=ASK_SUNNY[0]["content"], max_output_tokens=40,
                                       temperature=0, stream=True))
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (reasoning, text) == (THOUGHT, ANSWER_TEXT)
    assert events[-1].type == "response.completed" and events[-1].response.output_text == ANSWER_TEXT


def test_responses_function_call_and_its_output(oai: openai.OpenAI) -> None:
    first = oai.responses.create(model=MODEL, input=ASK_WEATHER[0]["content"], tools=[RESPONSES_WEATHER],
                                 max_output_tokens=40, temperature=0)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert (call.name, call.arguments) == ("get_weather", ARGUMENTS)
    with oai.responses.stream(model=MODEL, input=ASK_WEATHER[0]["content"], tools=[RESPONSES_WEATHER],
                              max_output_tokens=40, temperature=0) as stream:
        streamed = stream.get_final_response()
    assert [(i.name, i.arguments) for i in streamed.output if i.type == "function_call"] == [("get_weather", ARGUMENTS)]

    followed = oai.responses.create(model=MODEL, tools=[RESPONSES_WEATHER], max_output_tokens=40, temperature=0,
                                    input=[{"role": "user", "content": ASK_WEATHER[0]["content"]}, *(i.model_dump(exclude_none=True) for i in first.output),
                                           {"type": "function_call_output", "call_id": call.call_id,
                                            "output": f"{SUN} 21 degrees"}])
    assert followed.output_text == ANSWER_TEXT
    assert [i.type for i in followed.output] == ["reasoning", "message"]


def test_output_that_breaks_the_format_is_content_not_an_error(oai: openai.OpenAI, model_dir: Path) -> None:
    # Every token forced to <|message|>: no header, no channel; the text is the answer as written.
    message_token = transformers.AutoTokenizer.from_pretrained(model_dir).convert_tokens_to_ids("<|message|>")
    for stream in (False, True):
        reply = chat(oai, ASK_SUNNY, stream=stream, max_tokens=6, logit_bias={str(message_token): 100})
        if stream:
            reasoning, content = streamed_message(reply)[:2]
        else:
            message = reply.choices[0].message
            reasoning, content = getattr(message, "reasoning_content", None) or "", message.content
        assert (reasoning, content) == ("", "<|message|>" * 6)
