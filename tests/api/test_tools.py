"""tools / tool_choice: request bounds, the 400s, the constraint schema, and calls read from constrained output."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from lmserve.api.protocol import RequestError
from lmserve.api.tools import (
    MAX_TOOL_DESCRIPTION_CHARS,
    MAX_TOOL_PARAMETERS_BYTES,
    MAX_TOOLS,
    ChatTool,
    ConstrainedToolStream,
    NamedToolChoice,
    ToolChoice,
    Tools,
    check_tool_choice,
    constraint_schema,
    resolve_tool_choice,
    tool_calls_from_constrained,
)

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"],
    "additionalProperties": False,
}


class Request(BaseModel):
    """How protocol.py's chat request is expected to carry the fields."""

    tools: Tools | None = None
    tool_choice: ToolChoice | None = None


def request(body: dict[str, Any]) -> Request:
    return Request.model_validate_json(json.dumps(body))


def tool(name: str, parameters: dict | None = None) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def tools(*entries: dict[str, Any]) -> list[ChatTool]:
    return [ChatTool.model_validate_json(json.dumps(entry)) for entry in entries]


def named(name: str) -> NamedToolChoice:
    return NamedToolChoice.model_validate_json(json.dumps({"type": "function", "function": {"name": name}}))


# ------------------------------------------------------------------------------------------------ models


def test_request_fields_parse() -> None:
    parsed = request({"tools": [tool("get_weather", WEATHER)], "tool_choice": {"type": "function",
                                                                             "function": {"name": "get_weather"}}})
    assert parsed.tools and parsed.tools[0].function.parameters == WEATHER
    assert isinstance(parsed.tool_choice, NamedToolChoice)
    assert request({"tool_choice": "required"}).tool_choice == "required"


@pytest.mark.parametrize("body", [
    {"tools": [tool("has space")]},
    {"tools": [tool("")]},
    {"tools": [tool("x" * 65)]},
    {"tools": [{"type": "code_interpreter", "function": {"name": "a"}}]},
    {"tools": [{"type": "function", "function": {"name": "a", "description": "d" * (MAX_TOOL_DESCRIPTION_CHARS + 1)}}]},
    {"tools": [tool("a", {"description": "d" * MAX_TOOL_PARAMETERS_BYTES})]},
    {"tools": [tool("a", {"type": "object"})] * (MAX_TOOLS + 1)},
    {"tool_choice": "any"},
    {"tool_choice": {"type": "function"}},
])
def test_request_bounds(body: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        request(body)


def test_resolve_tool_choice_defaults_as_openai() -> None:
    assert resolve_tool_choice(None, None) == "none"
    assert resolve_tool_choice(tools(tool("a")), None) == "auto"
    assert resolve_tool_choice(tools(tool("a")), "required") == "required"


# ------------------------------------------------------------------------------------------------ 400s


@pytest.mark.parametrize(("tool_list", "tool_choice", "param"), [
    ([tool("a")], named("b"), "tool_choice"),
    ([], named("a"), "tool_choice"),
    (None, "required", "tool_choice"),
    ([tool("a"), tool("b"), tool("a")], "auto", "tools"),
])
def test_check_tool_choice_refuses(tool_list: list | None, tool_choice: ToolChoice, param: str) -> None:
    with pytest.raises(RequestError) as error:
        check_tool_choice(None if tool_list is None else tools(*tool_list), tool_choice)
    assert error.value.param == param


@pytest.mark.parametrize("tool_choice", [None, "none", "auto"])
def test_free_choices_need_no_tools(tool_choice: ToolChoice | None) -> None:
    check_tool_choice(None, tool_choice)
    assert constraint_schema(tools(tool("a")), tool_choice) is None


def test_constraint_schema_checks_too() -> None:
    with pytest.raises(RequestError):
        constraint_schema(tools(tool("a")), named("b"))


# ------------------------------------------------------------------------------------------------ schemas


def test_named_schema_is_the_functions_parameters() -> None:
    tool_list = tools(tool("get_weather", WEATHER), tool("other"))
    schema = constraint_schema(tool_list, named("get_weather"))
    assert schema == WEATHER
    jsonschema.validate({"city": "Paris", "unit": "c"}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"unit": "c"}, schema)
    schema["properties"].clear()  # a copy: the request's tools are unchanged
    assert tool_list[0].function.parameters == WEATHER
    assert constraint_schema(tool_list, named("other")) == {"type": "object"}


def test_required_schema_is_an_array_of_calls() -> None:
    schema = constraint_schema(tools(tool("get_weather", WEATHER), tool("noop")), "required")
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Oslo"}},
                         {"name": "noop", "parameters": {}}], schema)
    for bad in (
        [],  # minItems
        [{"name": "nope", "parameters": {}}],  # not a tool
        [{"name": "get_weather", "parameters": {"unit": "c"}}],  # the tool's own schema
        [{"name": "noop"}],  # parameters required
        [{"name": "noop", "parameters": {}, "extra": 1}],  # additionalProperties
        {"name": "noop", "parameters": {}},  # not an array
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_required_schema_takes_one_call_when_calls_may_not_be_parallel() -> None:
    """parallel_tool_calls false: maxItems 1, which the grammar backend (xgrammar) enforces while decoding."""
    from xgrammar import Grammar
    from xgrammar.testing import _is_grammar_accept_string

    listed = tools(tool("get_weather", WEATHER), tool("noop"))
    one, two = ('[{"name": "noop", "parameters": {}}]',
                '[{"name": "noop", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Oslo"}}]')
    unbounded = Grammar.from_json_schema(json.dumps(constraint_schema(listed, "required")))
    assert _is_grammar_accept_string(unbounded, one) and _is_grammar_accept_string(unbounded, two)
    schema = constraint_schema(listed, "required", max_calls=1)
    assert schema["maxItems"] == 1
    bounded = Grammar.from_json_schema(json.dumps(schema))
    assert _is_grammar_accept_string(bounded, one) and not _is_grammar_accept_string(bounded, two)


def test_required_schema_moves_definitions_to_the_root() -> None:
    point = {"type": "object", "properties": {"p": {"$ref": "#/$defs/Point"}}, "required": ["p"],
             "$defs": {"Point": {"type": "array", "items": {"type": "number"}, "minItems": 2}}}
    same = {"type": "object", "properties": {"q": {"$ref": "#/$defs/Point"}}, "$defs": point["$defs"]}
    schema = constraint_schema(tools(tool("a", point), tool("b", same)), "required")
    assert schema is not None and set(schema["$defs"]) == {"Point"}
    jsonschema.validate([{"name": "a", "parameters": {"p": [1, 2]}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "a", "parameters": {"p": [1]}}], schema)
    other = {"type": "object", "$defs": {"Point": {"type": "string"}}}
    with pytest.raises(RequestError) as error:
        constraint_schema(tools(tool("a", point), tool("c", other)), "required")
    assert error.value.param == "tools"


# ------------------------------------------------------------------------------------------------ calls


def test_named_call_keeps_the_generated_text() -> None:
    text = '{"city":  "Zürich" }'
    [call] = tool_calls_from_constrained(text, named("get_weather"))
    assert (call.name, call.arguments) == ("get_weather", text)
    assert call.id.startswith("call_")


def test_required_calls_one_per_element() -> None:
    text = '[{"name": "a", "parameters": {"x":1}}, {"name":"b","parameters":{"s":"é"}}]'
    calls = tool_calls_from_constrained(text, "required")
    assert [(c.name, c.arguments) for c in calls] == [("a", '{"x": 1}'), ("b", '{"s": "é"}')]
    # Cut short by max_tokens: a call whose name was complete has its arguments cut short, as a named call's (and as
    # they streamed); one cut inside its head is left out.
    cut = tool_calls_from_constrained(text[:-10], "required")
    assert [(c.name, c.arguments) for c in cut] == [("a", '{"x": 1}'), ("b", '{')]
    assert [c.name for c in tool_calls_from_constrained(text[:-30], "required")] == ["a"]


def test_free_choices_do_not_stream_constrained_calls() -> None:
    with pytest.raises(ValueError):
        ConstrainedToolStream("auto")


def stream(tool_choice: ToolChoice, chunks: list[str]) -> list[tuple[str, str]]:
    s = ConstrainedToolStream(tool_choice)
    calls: list[list[str]] = []
    for deltas in [s.feed(chunk) for chunk in chunks] + [s.finish()]:
        for d in deltas:
            if d.index == len(calls):
                assert d.id is not None and d.name is not None
                calls.append([d.name, d.arguments])
            else:
                assert d.index == len(calls) - 1 and d.id is None and d.name is None and d.arguments
                calls[d.index][1] += d.arguments
    return [(name, arguments) for name, arguments in calls]


def splits(text: str, points: list[int]) -> list[str]:
    cuts = sorted({min(p, len(text)) for p in points})
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


OUTPUTS = [
    (named("get_weather"), '{"city": "Paris", "unit": "c"}'),
    (named("get_weather"), ""),
    (named("get_weather"), '{"city": "cut sho'),
    ("required", '[{"name": "a", "parameters": {"s": "}]{[\\"", "n": [1, {"m": 2}]}}, {"name": "b", "parameters": {}}]'),
    ("required", '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "param'),
]


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(OUTPUTS), st.lists(st.integers(0, 120), max_size=12))
def test_streamed_fragments_concatenate_to_the_whole_calls(output: tuple[ToolChoice, str], points: list[int]) -> None:
    tool_choice, text = output
    expected = [(c.name, c.arguments) for c in tool_calls_from_constrained(text, tool_choice)]
    assert stream(tool_choice, splits(text, points)) == expected
    assert stream(tool_choice, list(text)) == expected


def test_named_stream_sends_the_name_first_and_text_as_it_comes() -> None:
    s = ConstrainedToolStream(named("f"))
    [first] = s.feed('{"a"')
    assert (first.index, first.name, first.arguments) == (0, "f", '{"a"') and first.id
    assert s.feed("") == []
    [later] = s.feed(": 1}")
    assert (later.id, later.name, later.arguments) == (None, None, ": 1}")
    assert s.finish() == []


def test_required_stream_sends_each_call_as_its_element_streams() -> None:
    """A call's id and name once its name is complete, then its arguments in pieces, as a hermes call streams."""
    s = ConstrainedToolStream("required")
    assert s.feed('[{"name": "a", "para') == []
    head, piece = s.feed('meters": {"x": 1')
    assert (head.index, head.name, head.arguments, piece.index, piece.id, piece.arguments) == \
        (0, "a", "", 0, None, '{"x": ')
    assert [(d.index, d.arguments) for d in s.feed("}}, ")] == [(0, "1}")]
    [call] = s.feed('{"name": "b", "parameters": {}}]')  # complete within one piece of text: one delta
    assert (call.index, call.name, call.arguments) == (1, "b", "{}")
    assert s.finish() == []
