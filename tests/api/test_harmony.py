"""gpt-oss's harmony format: lmserve's rendering against the chat template gpt-oss ships, token for token; the
parser of the model's output (analysis -> reasoning_content, commentary to functions.NAME -> tool calls, final ->
content), whole and streamed.

The template is tests/api/data/gpt_oss_chat_template.jinja: openai/gpt-oss-120b's chat_template.jinja as llama.cpp
keeps it (models/templates/openai-gpt-oss-120b.jinja), applied by transformers as for any model."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from lmserve.api.protocol import ChatCompletionRequest
from lmserve.api.reasoning_parsers import get_reasoning_parser
from lmserve.api.responses import ResponsesRequest
from lmserve.api.tool_parsers import HarmonyToolParser, ToolConfig, get_tool_parser
from lmserve.config import ModelConfig
from lmserve.frontend.tokenizer import tokenizer_chat_format
from lmserve.harmony import MARKERS, render_harmony, uses_harmony
from lmserve.model_tokenizer import end_of_generation_ids
from lmserve.models import ModelSource

TEMPLATE = (Path(__file__).parent / "data" / "gpt_oss_chat_template.jinja").read_text()
HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]


@pytest.fixture(scope="module")
def harmony_tokenizer(default_tokenizer) -> transformers.PreTrainedTokenizerBase:
    """The default model's tokenizer with harmony's special tokens and gpt-oss's template."""
    tokenizer = copy.deepcopy(default_tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    tokenizer.chat_template = TEMPLATE
    return tokenizer


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "The city's name."},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
        "days": {"type": "integer", "default": 1},
        "tags": {"type": "array", "items": {"type": "string"}},
        "where": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                  "required": ["lat"]},
        "points": {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "number"}}}},
        "flag": {"type": "boolean", "nullable": True},
        "anything": {},
        "either": {"type": ["string", "number"]},
        "choice": {"oneOf": [{"type": "string", "description": "a name"}, {"type": "number"}]},
    }}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time now.", "parameters": {}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}

# (name, OpenAI-shaped messages as a client sends them, template kwargs)
CONVERSATIONS: list[tuple[str, list[dict[str, Any]], dict[str, Any]]] = [
    ("plain", [{"role": "user", "content": "What is 2+2?"}], {}),
    ("system_and_effort", [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi"}],
     {"reasoning_effort": "high"}),
    ("developer", [{"role": "developer", "content": "Be terse."}, {"role": "user", "content": "Hi"}],
     {"reasoning_effort": "low"}),
    ("tools", [{"role": "user", "content": "Weather in Paris?"}], {"tools": [WEATHER, CLOCK]}),
    ("system_and_tools", [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather?"}],
     {"tools": [WEATHER]}),
    ("call_and_result", [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": "I should call get_weather.", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'},
    ], {"tools": [WEATHER]}),
    ("call_result_and_answer_then_new_question", [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": "Call the tool.", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny.", "reasoning_content": "The tool said sunny."},
        {"role": "user", "content": "Thanks! And tomorrow?"},
    ], {"tools": [WEATHER]}),
    ("multi_turn_with_earlier_reasoning", [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris.", "reasoning_content": "Easy: Paris."},
        {"role": "user", "content": "And of Italy?"},
        {"role": "assistant", "content": "Rome.", "reasoning": "Rome, of course."},
        {"role": "user", "content": "Spain?"},
    ], {"reasoning_effort": "medium"}),
    ("unicode", [{"role": "user", "content": "Ça va? 日本語 \"quotes\" and \\ backslash"}], {}),
]


def as_template_sees_it(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the template's own input would be: the thinking in its `thinking` field."""
    out = []
    for message in messages:
        message = dict(message)
        for key in ("reasoning_content", "reasoning"):
            if key in message:
                message["thinking"] = message.pop(key)
        out.append(message)
    return out


@pytest.mark.parametrize(("name", "messages", "kwargs"), CONVERSATIONS, ids=[c[0] for c in CONVERSATIONS])
def test_rendering_equals_gpt_oss_template_token_for_token(harmony_tokenizer, name: str, messages: list[dict],
                                                           kwargs: dict[str, Any]) -> None:
    # The messages go through the chat request's own model, as the server hands them to the template.
    request = ChatCompletionRequest.model_validate({"messages": messages, "tools": kwargs.get("tools"),
                                                    "reasoning_effort": kwargs.get("reasoning_effort")})
    template_messages, template_kwargs = request.template_messages(), request.template_kwargs()
    ours = render_harmony(template_messages, True, **template_kwargs)
    theirs = harmony_tokenizer.apply_chat_template(as_template_sees_it(template_messages), tokenize=False,
                                                   add_generation_prompt=True, **template_kwargs)
    assert ours == theirs
    assert harmony_tokenizer.encode(ours, add_special_tokens=False) == \
        harmony_tokenizer.encode(theirs, add_special_tokens=False)


def test_a_training_example_keeps_the_last_turns_thinking_and_ends_with_return(harmony_tokenizer) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!", "thinking": "Greet."}]
    ours = render_harmony(messages, False)
    assert ours == harmony_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert ours.endswith("<|start|>assistant<|channel|>analysis<|message|>Greet.<|end|>"
                         "<|start|>assistant<|channel|>final<|message|>Hello!<|return|>")


def test_earlier_reasoning_is_dropped_and_a_pending_calls_reasoning_kept() -> None:
    _, multi, _ = next(c for c in CONVERSATIONS if c[0] == "multi_turn_with_earlier_reasoning")
    rendered = render_harmony(multi)
    assert "Easy: Paris." not in rendered and "Rome, of course." not in rendered
    _, pending, _ = next(c for c in CONVERSATIONS if c[0] == "call_and_result")
    assert "<|channel|>analysis<|message|>I should call get_weather.<|end|>" in render_harmony(pending)


@pytest.mark.parametrize(("effort", "written"), [("minimal", "low"), ("none", "low"), ("xhigh", "high"),
                                                 (None, "medium")])
def test_reasoning_effort_is_one_of_the_formats_three_levels(effort: str | None, written: str) -> None:
    assert f"Reasoning: {written}\n\n" in render_harmony([{"role": "user", "content": "Hi"}],
                                                         reasoning_effort=effort)


def test_which_models_speak_harmony() -> None:
    assert uses_harmony("gpt_oss", None) and uses_harmony("gpt-oss", None)
    assert uses_harmony("llama", TEMPLATE)
    assert not uses_harmony("qwen2", "{{ messages }}") and not uses_harmony(None, None)


# ------------------------------------------------------------------------------------------------ parsing

REASONER, TOOLS = get_reasoning_parser("harmony"), get_tool_parser("harmony")
THOUGHT = "<|channel|>analysis<|message|>The user wants the weather.<|end|>"
ANSWER = "<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>"
A_CALL = ('<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>'
          '{"city":"Paris"}<|call|>')


def parse(text: str) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    """(reasoning, content, calls as (name, arguments)) as the chat path gets them: reasoning parser, then tools."""
    split = REASONER.extract(text)
    found = TOOLS.extract(split.content or "")
    return split.reasoning, found.content, [(c.name, c.arguments) for c in found.tool_calls]


@pytest.mark.parametrize(("text", "expected"), [
    (THOUGHT + ANSWER, ("The user wants the weather.", "It is sunny.", [])),
    (THOUGHT + ANSWER.removesuffix("<|return|>"), ("The user wants the weather.", "It is sunny.", [])),  # stop token dropped
    (THOUGHT + A_CALL, ("The user wants the weather.", None, [("get_weather", '{"city": "Paris"}')])),
    # The recipient in the channel part of the header, as gpt-oss also writes it; the first message a call.
    ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Rome"}<|call|>',
     (None, None, [("get_weather", '{"city": "Rome"}')])),
    ('<|channel|>commentary<|message|>Let me check.<|end|>' + A_CALL,  # a preamble is shown to the user
     (None, "Let me check.", [("get_weather", '{"city": "Paris"}')])),
    ("<|channel|>analysis<|message|>cut off by max_tok", ("cut off by max_tok", None, [])),
    (THOUGHT + "<|start|>assistant<|channel|>fin", ("The user wants the weather.", None, [])),  # a cut header
    ("<|channel|>final<|message|>Just the answer.", (None, "Just the answer.", [])),
    # Malformed output is content, never an error.
    ("No format at all.", (None, "No format at all.", [])),
    (THOUGHT + "stray text", ("The user wants the weather.", "stray text", [])),
    (THOUGHT + "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{not json<|call|>",
     ("The user wants the weather.", "{not json", [])),
    ("<|channel|>analysis to=python code<|message|>print(1)<|call|>", ("print(1)", None, [])),  # a built-in tool
    ("<|channel|>commentary to=browser.search json<|message|>{}<|call|>", (None, "{}", [])),
    (THOUGHT + "<|start|>user<|message|>I answer myself<|end|>", ("The user wants the weather.",
                                                                 "user<|message|>I answer myself<|end|>", [])),
    ("", (None, None, [])),
])
def test_extract(text: str, expected: tuple) -> None:
    assert parse(text) == expected


def streamed(text: str, pieces: list[str]) -> tuple[str, str, list[tuple[str, str]]]:
    reasoner, tools = REASONER.streaming(), TOOLS.streaming()
    reasoning, content, calls = "", "", []
    for i, piece in enumerate(pieces):
        finished = i == len(pieces) - 1
        thought, rest = reasoner.feed(piece, finished=finished)
        out = tools.feed(rest)
        if finished:
            last = tools.finish()
            out.content += last.content
            out.tool_calls += last.tool_calls
        reasoning, content = reasoning + thought, content + out.content
        calls += [(c.name, c.arguments) for c in out.tool_calls]
    return reasoning, content, calls


def split_at(text: str, points: list[int]) -> list[str]:
    cuts = sorted({p % (len(text) + 1) for p in points} | {0, len(text)})
    return [text[a:b] for a, b in itertools.pairwise(cuts)] or [""]


harmony_texts = st.lists(st.sampled_from([*MARKERS, "assistant", "analysis", "final", "commentary", " to=functions.f",
                                          " json", '{"a": 1}', "hi", " ", "<|", "é"]), max_size=14).map("".join)


@settings(max_examples=400, deadline=None)
@given(st.one_of(harmony_texts, st.sampled_from([THOUGHT + ANSWER, THOUGHT + A_CALL])),
       st.lists(st.integers(0, 300), max_size=10))
def test_a_stream_split_anywhere_agrees_with_extract(text: str, points: list[int]) -> None:
    reasoning, content, calls = parse(text)
    assert streamed(text, split_at(text, points)) == (reasoning or "", content or "", calls)


def test_nothing_is_sent_while_an_end_token_may_be_coming() -> None:
    reasoner, tools = REASONER.streaming(), TOOLS.streaming()
    assert reasoner.feed("<|channel|>analysis<|message|>thinking <|") == ("thinking ", "<|channel|>analysis<|message|>thinking <|")
    assert reasoner.feed("en")[0] == "" and reasoner.feed("d|>")[0] == ""
    assert tools.feed("<|channel|>final<|message|>Hello <|re").content == "Hello "
    assert tools.feed("turn|>").content == ""


def test_what_the_format_cannot_write_is_a_value_error() -> None:
    for messages, kwargs, words in [
        ([{"role": "tool", "content": "21"}], {}, "must follow an assistant message with a tool call"),
        ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<|channel|>final<|message|>x"}], {},
         "channel tags"),
        ([{"role": "user", "content": "Hi"}], {"continue_final_message": True}, "continue_final_message"),
    ]:
        with pytest.raises(ValueError, match=words):
            render_harmony(messages, **kwargs)


# ------------------------------------------------------------------------------------------------ choosing


def test_a_harmony_model_reads_its_output_as_harmony_unless_told_otherwise() -> None:
    chosen = ToolConfig().for_chat_format("harmony")
    assert (chosen.enable_auto_tool_choice, chosen.tool_call_parser, chosen.reasoning_parser) == \
        (True, "harmony", "harmony")
    assert ToolConfig().for_chat_format(None) == ToolConfig()
    vllm_names = ToolConfig(True, "openai", "openai_gptoss")
    assert vllm_names.for_chat_format("harmony") is vllm_names
    assert isinstance(get_tool_parser("openai"), HarmonyToolParser)
    with pytest.raises(ValueError, match="read different formats"):
        ToolConfig(True, "hermes", "harmony")


def test_a_gguf_vocabulary_with_return_and_call_does_not_end_at_end() -> None:
    """As llama.cpp: gpt-oss's <|end|> closes its thinking and the model goes on; <|return|> and <|call|> end it."""
    harmony = {"<|end|>": 5, "<|return|>": 6, "<|call|>": 7, "<|endoftext|>": 8}
    phi = {"<|end|>": 5, "<|endoftext|>": 8}
    source = ModelSource("gguf", Path("unused.gguf"), "unused")
    for vocabulary, expected in ((harmony, {6, 7, 8}), (phi, {5, 8})):
        tokenizer = SimpleNamespace(eos_token_id=None,
                                    backend_tokenizer=SimpleNamespace(token_to_id=vocabulary.get))
        assert set(end_of_generation_ids(source, tokenizer)) == expected


def test_responses_reasoning_items_go_back_with_the_turn_they_precede() -> None:
    request = ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": "Weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Call it."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "Sunny."}]},
        {"role": "assistant", "content": "It is sunny."},
    ]})
    messages = request.to_chat()["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
    assert messages[1]["reasoning_content"] == "Call it." and messages[3]["reasoning_content"] == "Sunny."


def test_a_gpt_oss_directory_is_harmony_unless_the_operator_gives_another_template(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "gpt_oss"}')
    tokenizer = SimpleNamespace(chat_template=None)  # a file without a template: lmserve needs none
    assert tokenizer_chat_format(ModelConfig(model=str(tmp_path)), tokenizer) == "harmony"
    chatml = "{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}"
    assert tokenizer_chat_format(ModelConfig(model=str(tmp_path), chat_template=chatml),
                                 SimpleNamespace(chat_template=chatml)) is None
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert tokenizer_chat_format(ModelConfig(model=str(tmp_path)), SimpleNamespace(chat_template=TEMPLATE)) == "harmony"
