"""Tool-call parsers: extract() on whole outputs, and streams that agree with it however the text is split."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmserve.api.tool_parsers import (
    TOOL_PARSERS,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    PythonicToolParser,
    ToolParser,
    get_tool_parser,
)
from lmserve.api.tool_parsers.common import CanonicalJson

hermes = HermesToolParser()
llama = Llama3JsonToolParser()
mistral = MistralToolParser()
pythonic = PythonicToolParser()


def hermes_block(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def calls_of(parser: ToolParser, text: str) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in parser.extract(text).tool_calls]


def stream(parser: ToolParser, chunks: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """Feeds the chunks, checks OpenAI's delta shape, and returns the content and each call's (name, arguments)."""
    content, calls, _ = stream_and_stop(parser, chunks)
    return content, calls


def stream_and_stop(parser: ToolParser, chunks: list[str]) -> tuple[str, list[tuple[str, str]], bool]:
    """stream(), and whether the stream stopped on a call that contradicted what it had sent."""
    s = parser.streaming()
    content, calls = "", []
    for delta in [s.feed(chunk) for chunk in chunks] + [s.finish()]:
        content += delta.content
        for d in delta.tool_calls:
            if d.index == len(calls):  # a call's first delta: id and name
                assert d.id is not None and d.name is not None
                calls.append([d.name, d.arguments])
            else:
                assert d.index == len(calls) - 1 and d.id is None and d.name is None
                calls[d.index][1] += d.arguments
    return content, [tuple(c) for c in calls], s.stopped


def assert_stream_agrees(parser: ToolParser, text: str, chunks: list[str]) -> None:
    assert "".join(chunks) == text
    expected = parser.extract(text)
    content, calls = stream(parser, chunks)
    assert content == (expected.content or "")
    assert calls == [(c.name, c.arguments) for c in expected.tool_calls]


def splits(text: str, points: list[int]) -> list[str]:
    cuts = sorted({min(p, len(text)) for p in points})
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


# ------------------------------------------------------------------------------------------------ extract


def test_hermes_one_call() -> None:
    result = hermes.extract(hermes_block("get_weather", {"city": "Zürich"}))
    assert result.content is None
    [call] = result.tool_calls
    assert (call.name, call.arguments) == ("get_weather", '{"city": "Zürich"}')  # ensure_ascii=False
    assert re.fullmatch(r"call_[A-Za-z0-9]{24}", call.id)


def test_hermes_two_calls_after_content() -> None:
    text = "Let me check.\n" + hermes_block("a", {"x": 1}) + "\n" + hermes_block("b", {})
    result = hermes.extract(text)
    assert result.content == "Let me check.\n"
    assert calls_of(hermes, text) == [("a", '{"x": 1}'), ("b", "{}")]
    assert result.tool_calls[0].id != result.tool_calls[1].id


def test_hermes_normalises_arguments_and_accepts_an_unclosed_last_block() -> None:
    text = '<tool_call>{"name":"a","arguments":{"x":[1,2]}}'
    assert calls_of(hermes, text) == [("a", '{"x": [1, 2]}')]


@pytest.mark.parametrize("text", [
    "<tool_call>\n{\"name\": \"a\", \"arguments\": {\"x\": }\n</tool_call>",  # bad JSON
    "<tool_call>\n{\"arguments\": {}}\n</tool_call>",  # no name
    "<tool_call>\n{\"name\": \"a\", \"arguments\": [1]}\n</tool_call>",  # arguments not an object
    "hi " + hermes_block("a", {}) + "<tool_call>{\"name\": \"b\"",  # a later block cut short
    "<tool_call></tool_call>",
])
def test_hermes_malformed_is_content(text: str) -> None:
    result = hermes.extract(text)
    assert result.content == text and result.tool_calls == []


@pytest.mark.parametrize("text", ["", "Hello there.", "a <tool_ b", "</tool_call>"])
def test_no_calls_is_content(text: str) -> None:
    for parser in (hermes, llama):
        assert parser.extract(text).content == text and parser.extract(text).tool_calls == []


def test_llama_one_call_with_python_tag_and_parameters() -> None:
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}'
    result = llama.extract(text)
    assert result.content is None
    assert calls_of(llama, text) == [("get_weather", '{"city": "Paris"}')]


def test_llama_two_calls_separated_by_semicolons() -> None:
    text = '{"name": "a", "arguments": {"s": "x;}{"}} ; {"name":"b","parameters":{}};'
    assert calls_of(llama, text) == [("a", '{"s": "x;}{"}'), ("b", "{}")]


@pytest.mark.parametrize("text", [
    '{"answer": 42}',  # JSON, but not a call
    '{"name": "a", "parameters": {}} and then some text',
    '{"name": "a", "parameters": {"x": }}',
    'Sure: {"name": "a", "parameters": {}}',  # a call not at the start is prose
    '<|python_tag|>print("hi")',  # Llama's code interpreter, not a JSON call
])
def test_llama_malformed_or_prose_is_content(text: str) -> None:
    result = llama.extract(text)
    assert result.content == text and result.tool_calls == []


def test_mistral_json_list_after_its_marker() -> None:
    text = 'Sure. [TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]'
    assert calls_of(mistral, text) == [("a", '{"x": 1}'), ("b", "{}")]
    assert mistral.extract(text).content == "Sure. "


def test_mistral_name_args_per_call() -> None:
    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}'
    assert calls_of(mistral, text) == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    assert mistral.extract(text).content is None


@pytest.mark.parametrize("text", ["no calls", "[TOOL_CALLS] [{oops}]", "[TOOL_CALLS]f[ARGS]not json",
                                  "[TOOL_CALLS][ARGS]{}", "[TOOL_CALLS] []", "[TOOL_CALLS] [1]"])
def test_mistral_malformed_or_prose_is_content(text: str) -> None:
    assert mistral.extract(text).content == text and not mistral.extract(text).tool_calls


def test_pythonic_calls() -> None:
    text = '[get_weather(city="Paris", days=2), get_time(tz=\'UTC\', exact=True, at=None, tags=["a", 1.5])]'
    assert calls_of(pythonic, text) == [
        ("get_weather", '{"city": "Paris", "days": 2}'),
        ("get_time", '{"tz": "UTC", "exact": true, "at": null, "tags": ["a", 1.5]}'),
    ]
    assert calls_of(pythonic, "<|python_start|>[f()]<|python_end|>") == [("f", "{}")]


@pytest.mark.parametrize("text", ["Paris is sunny.", "[f(1)]", "[f(**k)]", "[os.system('x')]", "[f(x=open('a'))]",
                                  "[f(x={1, 2})]", "[f(x=1e999)]", "[]", "[f(x=", "[1, 2]", "[f(x=1)] and prose"])
def test_pythonic_anything_but_literal_keyword_calls_is_content(text: str) -> None:
    assert pythonic.extract(text).content == text and not pythonic.extract(text).tool_calls


def test_mistral_keeps_special_tokens_in_the_text() -> None:
    assert mistral.needs_special_tokens and not hermes.needs_special_tokens


def test_registry() -> None:
    assert set(TOOL_PARSERS) == {"harmony", "openai", "hermes", "llama3_json", "mistral", "pythonic"}
    assert isinstance(get_tool_parser("hermes"), HermesToolParser)
    with pytest.raises(ValueError, match="hermes, llama3_json"):
        get_tool_parser("granite")


# ------------------------------------------------------------------------------------------------ streaming

EXAMPLES = [
    (hermes, "Let me check.\n" + hermes_block("a", {"x": 1, "s": "<tool_call>"}) + "\n" + hermes_block("b", {})),
    (hermes, hermes_block("only", {"q": "é ü"})),
    (hermes, "plain answer with < and <tool and </tool_call> in it"),
    (hermes, "before <tool_call>\n{\"name\": \"a\" \"arguments\": {\"x\": 1}}\n</tool_call> after"),
    (hermes, "<tool_call>{\"arguments\": {\"x\": 1}, \"name\": \"late_name\"}</tool_call>"),
    (hermes, hermes_block("spaced", {"n": [1.50, -0.0, 1e21], "s": "a\\\"b\\u00e9\\ud83d\\ude00 \u00fc"})),
    (hermes, "cut short <tool_call>{\"name\": \"a\", \"arguments\": {}}"),
    (hermes, "ends in a marker prefix <tool_"),
    (llama, '<|python_tag|>{"name": "a", "parameters": {"x": "}{;"}}; {"name": "b", "arguments": {}}'),
    (llama, '  {"name": "a", "parameters": {}}'),
    (llama, '{"answer": 42}'),
    (llama, '{"name": "a", "parameters": {}} trailing prose'),
    (llama, "<|python_tag|>print(1)"),
    (llama, "<|pyth not a tag"),
    (llama, "Just prose."),
    (mistral, 'Sure. [TOOL_CALLS] [{"name": "a", "arguments": {"x": "[TOOL_CALLS]"}}]'),
    (mistral, '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]b[ARGS]{}'),
    (mistral, "prose with [TOOL and [TOOL_CALL"),
    (mistral, "[TOOL_CALLS] not json"),
    (pythonic, '  [get_weather(city="Paris"), f()]'),
    (pythonic, "<|python_start|>[f(x=[1, 2])]<|python_end|>"),
    (pythonic, "<|python not a tag"),
    (pythonic, "[not, a, call]"),
    (pythonic, "Plain prose [with brackets]."),
]


@pytest.mark.parametrize(("parser", "text"), EXAMPLES)
def test_stream_one_character_at_a_time(parser: ToolParser, text: str) -> None:
    assert_stream_agrees(parser, text, list(text))


@pytest.mark.parametrize(("parser", "text"), EXAMPLES)
def test_stream_all_at_once(parser: ToolParser, text: str) -> None:
    assert_stream_agrees(parser, text, [text])


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(EXAMPLES), st.lists(st.integers(0, 200), max_size=12))
def test_stream_random_splits(example: tuple[ToolParser, str], points: list[int]) -> None:
    parser, text = example
    assert_stream_agrees(parser, text, splits(text, points))


arguments = st.dictionaries(st.text(max_size=4), st.one_of(st.integers(), st.text(alphabet="a<>{};\"\\_ é", max_size=6)),
                            max_size=3)
names = st.from_regex(r"[a-z_]{1,8}", fullmatch=True)
prose = st.text(alphabet="ab <>_/tol|c{}", max_size=16)


@settings(max_examples=200, deadline=None)
@given(prose, st.lists(st.tuples(names, arguments), max_size=3), st.lists(st.integers(0, 400), max_size=12))
def test_hermes_generated_outputs(content: str, calls: list, points: list[int]) -> None:
    text = content + "\n".join(hermes_block(n, a) for n, a in calls)
    assert_stream_agrees(hermes, text, splits(text, points))


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["", "<|python_tag|>", " "]), st.lists(st.tuples(names, arguments), min_size=1, max_size=3),
       st.lists(st.integers(0, 400), max_size=12))
def test_llama_generated_outputs(prefix: str, calls: list, points: list[int]) -> None:
    text = prefix + "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)
    assert_stream_agrees(llama, text, splits(text, points))


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([hermes, llama, mistral, pythonic]),
       st.text(alphabet='<tool_call>/{}"name:arguments;|python_tag [TOOL_CALS]()=,', max_size=60),
       st.lists(st.integers(0, 60), max_size=8))
def test_any_text_never_raises_and_agrees_unless_a_streamed_call_is_contradicted(
        parser: ToolParser, text: str, points: list[int]) -> None:
    expected = parser.extract(text)
    content, calls, stopped = stream_and_stop(parser, splits(text, points))
    if stopped:
        assert calls  # a stream stops only on a call after it sent a call, or the first pieces of one
    else:
        assert content == (expected.content or "")
        assert calls == [(c.name, c.arguments) for c in expected.tool_calls]


def test_hermes_holds_back_a_possible_marker_then_releases_it() -> None:
    s = hermes.streaming()
    assert s.feed("Hello <tool_").content == "Hello "
    assert s.feed("box> and <").content == "<tool_box> and "
    assert s.finish().content == "<"


def test_hermes_streams_the_name_first_then_the_arguments_as_they_come() -> None:
    """vLLM's shape: a first delta with the id and name, then argument pieces, here re-serialised as json.dumps
    writes the whole (spacing, numbers, escapes), so that they concatenate to the non-streamed arguments."""
    s = hermes.streaming()
    assert s.feed('Hi <tool_call>\n{"name": "get_wea').tool_calls == []
    head, piece = s.feed('ther", "arguments":{ "city" :"Par').tool_calls
    assert (head.index, head.name, head.arguments) == (0, "get_weather", "") and head.id.startswith("call_")
    assert (piece.index, piece.id, piece.name, piece.arguments) == (0, None, None, '{"city": "Par')
    assert [d.arguments for d in s.feed('is\\u00e9", "days": 2.50').tool_calls] == ['is\u00e9", "days": ']
    assert [d.arguments for d in s.feed("}}\n").tool_calls] == ["2.5}"]  # a number goes once it is complete
    assert s.feed("</tool_call>").tool_calls == []  # nothing left: the pieces were the whole arguments
    assert s.finish().tool_calls == []
    [call] = hermes.extract('<tool_call>{"name": "get_weather", "arguments":{ "city" :"Paris\\u00e9", '
                            '"days": 2.50}}</tool_call>').tool_calls
    assert call.arguments == '{"city": "Paris\u00e9", "days": 2.5}'


def test_a_hermes_call_that_contradicts_what_was_sent_ends_the_stream() -> None:
    """As in vLLM, pieces sent cannot be taken back: a call that turns out malformed (or repeats a key, which the
    whole parse keeps once) leaves the client with what it got, and the stream sends nothing more."""
    for body in ('{"name": "a", "arguments": {"x": }', '{"name": "a", "arguments": {"k": 1, "k": 2}}'):
        s = hermes.streaming()
        first = s.feed("before <tool_call>" + body)
        assert first.content == "before " and first.tool_calls[0].name == "a"
        later = s.feed("\n</tool_call> after")
        assert later.content == "" and later.tool_calls == [] and s.stopped
        end = s.finish()
        assert end.content == "" and end.tool_calls == []


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**30, 10**30) | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3),
    max_leaves=8)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(max_size=4), json_values, max_size=4), st.booleans(),
       st.sampled_from([None, 0, 2]), st.lists(st.integers(0, 300), max_size=10))
def test_canonical_json_pieces_concatenate_to_json_dumps(value: dict, ascii_only: bool, indent: int | None,
                                                         points: list[int]) -> None:
    """However the model spaced and escaped the arguments and however the text was split, the pieces concatenate to
    json.dumps(value, ensure_ascii=False): surrogate pairs and escapes are never cut."""
    text = json.dumps(value, ensure_ascii=ascii_only, indent=indent)
    writer, written, seen = CanonicalJson(0), "", ""
    for piece in splits(text, points):
        seen += piece
        written += writer.advance(seen)
    assert writer.done and not writer.failed
    assert written == json.dumps(json.loads(text), ensure_ascii=False)


def test_hermes_stream_after_a_malformed_first_block_is_all_content() -> None:
    s = hermes.streaming()
    assert s.feed("A <tool_call>{oops}").content == "A "
    assert s.feed("</tool_call> B").content == "<tool_call>{oops}</tool_call> B"
    assert s.feed(" C").content == " C"


def test_llama_stream_decides_on_the_first_character() -> None:
    s = llama.streaming()
    assert s.feed(" ").content == ""
    assert s.feed("Hello").content == " Hello"
    s = llama.streaming()
    assert s.feed("<|python").content == ""
    assert s.feed('_tag|>{"name": "a", "parameters": {}};').tool_calls[0].name == "a"
