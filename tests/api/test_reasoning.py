"""--reasoning-parser: a reasoning model's <think>...</think> goes to reasoning_content, its answer to content, streamed
and not; tool calls are parsed from the answer only. The parsers themselves, then through the server with the
`openai` client (a fake engine whose answer is the last message's words)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_api_fake_engine import MODEL, FakeEngine, ServerThread

from lmserve.api.reasoning_parsers import REASONING_PARSERS, Reasoning, ReasoningParser, get_reasoning_parser
from lmserve.api.server import build_app
from lmserve.api.serving import ToolConfig

QWEN3, R1 = get_reasoning_parser("qwen3"), get_reasoning_parser("deepseek_r1")


@pytest.mark.parametrize(
    ("parser", "text", "expected"),
    [
        (QWEN3, "<think>\nplan\n</think>\n\nAnswer.", Reasoning("\nplan\n", "\n\nAnswer.")),
        (QWEN3, "Answer without thinking.", Reasoning(None, "Answer without thinking.")),
        (QWEN3, "<think>cut off by max_tokens", Reasoning("cut off by max_tokens", None)),
        (QWEN3, "  <think>x</think>", Reasoning("x", None)),
        (QWEN3, "The tag </think> alone is text", Reasoning(None, "The tag </think> alone is text")),
        (R1, "plan\n</think>\n\nAnswer.", Reasoning("plan\n", "\n\nAnswer.")),  # the prompt opened the thinking
        (R1, "<think>plan</think>Answer.", Reasoning("plan", "Answer.")),
        (R1, "still thinking", Reasoning("still thinking", None)),
    ],
)
def test_extract(parser: ReasoningParser, text: str, expected: Reasoning) -> None:
    assert parser.extract(text) == expected


def streamed(parser: ReasoningParser, pieces: list[str]) -> tuple[str, str]:
    stream = parser.streaming()
    reasoning, content = "", ""
    for i, piece in enumerate(pieces):
        r, c = stream.feed(piece, finished=i == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
    return reasoning, content


def split_at(text: str, points: list[int]) -> list[str]:
    cuts = sorted({p % (len(text) + 1) for p in points} | {0, len(text)})
    return [text[a:b] for a, b in itertools.pairwise(cuts)] or [""]


pieces_of_text = st.lists(st.sampled_from(["<think>", "</think>", "<", "</", "<th", "think>", "a", " ", "\n", "é"]),
                          max_size=12).map("".join)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(list(REASONING_PARSERS)), pieces_of_text, st.lists(st.integers(0, 200), max_size=8))
def test_a_stream_split_anywhere_agrees_with_extract(name: str, text: str, points: list[int]) -> None:
    parser = get_reasoning_parser(name)
    whole = parser.extract(text)
    assert streamed(parser, split_at(text, points)) == (whole.reasoning or "", whole.content or "")


def test_a_partial_marker_is_held_back_until_decided() -> None:
    stream = QWEN3.streaming()
    assert stream.feed("<thi") == ("", "")  # may open the thinking
    assert stream.feed("nk>plan </thi") == ("plan ", "")  # may close it
    assert stream.feed("nk> answer") == ("", " answer")
    content = R1.streaming()
    assert content.feed("<t") == ("", "")
    assert content.feed("oo") == ("<too", "")  # not a marker after all: thinking, as the prompt opened it


# ------------------------------------------------------------------------------------------------ server


class LastMessageEngine(FakeEngine):
    """Answers with the last message's words, as a reasoning model would write them."""

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kw: Any) -> str:
        return messages[-1]["content"]


@pytest.fixture(scope="module")
def oai() -> Iterator[openai.OpenAI]:
    tools = ToolConfig(enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3")
    with ServerThread(build_app(LastMessageEngine(), tools=tools)) as running:
        yield openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0, timeout=10)


THINKING = "<think> weigh the options </think> Paris is the capital."


def ask(oai: openai.OpenAI, content: str, stream: bool, **kw: Any) -> Any:
    return oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], stream=stream,
                                       **kw)


def test_the_thinking_is_reasoning_content_and_the_answer_content(oai: openai.OpenAI) -> None:
    message = ask(oai, THINKING, stream=False).choices[0].message
    assert message.reasoning_content == " weigh the options "
    assert message.content == " Paris is the capital."
    chunks = [c.choices[0].delta for c in ask(oai, THINKING, stream=True) if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in chunks) == message.reasoning_content
    assert "".join(d.content or "" for d in chunks) == message.content
    # Thinking deltas carry no content and answer deltas no reasoning: clients concatenate each field.
    assert not any(getattr(d, "reasoning_content", None) and d.content for d in chunks)


def test_an_answer_without_thinking_has_no_reasoning_content(oai: openai.OpenAI) -> None:
    message = ask(oai, "Just the answer.", stream=False).choices[0].message
    assert message.content == "Just the answer." and getattr(message, "reasoning_content", None) is None
    assert "reasoning_content" not in message.model_dump(exclude_unset=True)


def test_include_reasoning_false_leaves_the_thinking_out(oai: openai.OpenAI) -> None:
    for stream in (False, True):
        reply = ask(oai, THINKING, stream=stream, extra_body={"include_reasoning": False})
        if stream:
            deltas = [c.choices[0].delta for c in reply if c.choices]
            assert not any(getattr(d, "reasoning_content", None) for d in deltas)
            assert "".join(d.content or "" for d in deltas) == " Paris is the capital."
        else:
            assert reply.choices[0].message.content == " Paris is the capital."
            assert getattr(reply.choices[0].message, "reasoning_content", None) is None


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_tool_calls_come_from_the_answer_not_the_thinking(oai: openai.OpenAI) -> None:
    # A call written while thinking is a thought; the one in the answer is the call.
    text = ('<think> maybe <tool_call> {"name": "get_weather", "arguments": {"city": "Rome"}} </tool_call> no </think>'
            ' <tool_call> {"name": "get_weather", "arguments": {"city": "Paris"}} </tool_call>')
    reply = ask(oai, text, stream=False, tools=[WEATHER])
    calls = reply.choices[0].message.tool_calls
    assert [c.function.arguments for c in calls] == ['{"city": "Paris"}']
    assert "Rome" in reply.choices[0].message.reasoning_content
    assert reply.choices[0].finish_reason == "tool_calls"
    deltas = [c.choices[0] for c in ask(oai, text, stream=True, tools=[WEATHER]) if c.choices]
    arguments = "".join(tc.function.arguments or "" for d in deltas for tc in d.delta.tool_calls or ())
    assert arguments == '{"city": "Paris"}' and deltas[-1].finish_reason == "tool_calls"


def test_a_grammar_from_the_first_token_means_no_thinking_to_split(oai: openai.OpenAI) -> None:
    # The fake engine does not apply grammars; what matters is that the text is taken whole as the answer.
    reply = ask(oai, "<think> x </think> y", stream=False, response_format={"type": "json_object"})
    assert reply.choices[0].message.content == "<think> x </think> y"


def test_an_unknown_reasoning_parser_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match="--reasoning-parser"):
        ToolConfig(reasoning_parser="o1")


@pytest.mark.parametrize(
    ("prompt", "deferred"),
    [
        ("user: hi assistant:", True),  # Qwen3 thinking: the model opens <think> itself
        ("user: hi assistant: <think>", True),  # DeepSeek-R1's template opens it
        ("user: hi assistant: <think> </think>", False),  # Qwen3 with enable_thinking false: closed in the prompt
        ("<think> old </think> user: hi assistant: <think>", True),  # an earlier turn's thinking, then a new one
    ],
)
def test_a_grammar_starts_after_the_thinking_unless_the_prompt_closed_it(prompt: str, deferred: bool) -> None:
    from lmserve.api.protocol import ChatCompletionRequest
    from lmserve.api.serving import OpenAIServing
    from lmserve.metrics.recorder import StatsRecorder

    engine = LastMessageEngine()
    serving = OpenAIServing(engine, MODEL, StatsRecorder(MODEL), ToolConfig(reasoning_parser="qwen3"))
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                "response_format": {"type": "json_object"}})
    params = req.to_sampling_params({})
    reasoning = serving._reasoning_output(req, params, engine.tokenize(prompt))
    end = engine.tokenize("</think>")[0]
    assert (reasoning is not None) == deferred
    assert params.structured_outputs.after_token_id == (end if deferred else None)
