"""What the grammar builder refuses: anything xgrammar would accept without enforcing it, and counts that make its
compile slow. Each refused keyword was checked against xgrammar 0.2.8: a value breaking it completes the grammar."""

from __future__ import annotations

import json

import pytest

from lmserve.structured_output import GrammarError, build_grammar

ACCEPTED = [
    {"type": "object", "properties": {"not": {"type": "integer"}, "contains": {"type": "string"}}},  # names, not keywords
    {"type": "integer", "multipleOf": 3},
    {"type": "array", "items": {"type": "integer"}, "uniqueItems": False},
    {"type": "string", "format": "email"},
    {"type": "object", "minProperties": 1, "additionalProperties": {"type": "integer"}},
]
REFUSED = [
    ({"not": {"type": "string"}}, "'not'"),
    ({"type": "array", "items": {"type": "array", "uniqueItems": True}}, "'uniqueItems'"),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf"),
    ({"type": "string", "pattern": "^(?=a)b"}, "lookaround"),
    ({"anyOf": [{"type": "object", "properties": {"x": {"allOf": [{"type": "integer"}]}}}]}, "'allOf'"),
    ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "'if'"),
    ({"type": "string", "maxLength": 10**9}, "maxLength"),
    ({"type": "nonsense"}, "nonsense"),
]


@pytest.mark.parametrize("schema", ACCEPTED)
def test_enforceable_schemas_build(schema: dict) -> None:
    build_grammar("json", json.dumps(schema))


@pytest.mark.parametrize(("schema", "words"), REFUSED)
def test_unenforceable_schemas_are_refused_by_name(schema: dict, words: str) -> None:
    with pytest.raises(GrammarError, match=words):
        build_grammar("json", json.dumps(schema))


def test_regex_lookaround_and_bad_grammars_are_refused() -> None:
    with pytest.raises(GrammarError, match="lookaround"):
        build_grammar("regex", "(?!a)b")
    with pytest.raises(GrammarError, match="grammar"):
        build_grammar("grammar", "root ::= ")


@pytest.mark.parametrize("kind", ["json", "json_object"])
def test_json_is_compact_unless_free_whitespace_is_asked_for(kind: str) -> None:
    from xgrammar.testing import _is_grammar_accept_string as accepts

    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    text = schema if kind == "json" else ""
    assert accepts(build_grammar(kind, text), '{"a": 1}')
    assert not accepts(build_grammar(kind, text), '{\n  "a": 1\n}')
    assert accepts(build_grammar(kind, text, json_whitespace=True), '{\n  "a": 1\n}')
