"""Grammars for constrained decoding, with xgrammar (vLLM's and SGLang's choice): one place that turns a request's
StructuredOutputsParams into an xgrammar Grammar, used by the front-end to check a request (a 400 naming the problem,
before anything is queued) and by the engine to compile it against the vocabulary.

JSON schemas compile without free whitespace (`any_whitespace=False`) unless a request asks for it (vLLM's
`disable_any_whitespace: false`): the output is compact JSON, and a small model cannot wander into an endless run of
spaces or newlines that a grammar would have to allow.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any, Protocol

from lmserve.json_limits import loads_bounded
from lmserve.sampling_params import StructuredOutputsParams

MAX_SCHEMA_COUNT = 100_000
# Properties of one object in a schema: xgrammar's compile against the vocabulary grows as their square when they
# are optional (100: 0.17 s, 400: 1.6 s, 1,400: 30 s on one core).
MAX_SCHEMA_PROPERTIES = 256
_COUNT_KEYWORDS = {"minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties"}
# JSON schema keywords xgrammar 0.2.8 accepts but does not enforce (a violating value completes the grammar).
_IGNORED_BY_XGRAMMAR = {"not", "if", "then", "else", "allOf", "uniqueItems", "contains", "minContains", "maxContains",
                        "dependentRequired", "dependentSchemas"}
_LOOKAROUND = re.compile(r"\(\?<?[=!]")
_SUBSCHEMA_MAPS = {"properties", "patternProperties", "$defs", "definitions"}
_SUBSCHEMA_LISTS = {"anyOf", "oneOf", "prefixItems"}
_SUBSCHEMAS = {"items", "additionalProperties", "propertyNames", "additionalItems", "unevaluatedProperties"}
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
# A repetition's counts (`a{0,1000000000}` in a regex, a schema's pattern or an EBNF grammar): xgrammar expands
# them, so its build time and memory grow with them (a pattern's {0,10000}: 16 s); no answer a context-bounded
# model gives needs more.
MAX_REPEAT_COUNT = 1000
_REPEAT = re.compile(r"(?<!\\)\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
_EBNF_LITERAL = re.compile(r'"(?:[^"\\]|\\.)*"')


class TokenMatcher(Protocol):
    """The part of xgrammar's GrammarMatcher that decoding uses: one request's place in its grammar."""

    def accept_token(self, token_id: int) -> bool:
        """Advances by one token; False (and not advanced) where the grammar refuses it."""
        ...

    def rollback(self, num_tokens: int) -> None: ...

    def is_terminated(self) -> bool: ...


class GrammarError(ValueError):
    """A schema, regex or grammar that xgrammar cannot build (or xgrammar is missing)."""


def xgrammar() -> Any:
    try:
        import xgrammar as xgr
    except ImportError as exc:
        raise GrammarError("structured output needs the xgrammar package (pip install --no-deps xgrammar "
                           "apache-tvm-ffi)") from exc
    return xgr


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose sentences are exactly the choices (JSON string escaping is xgrammar's literal syntax)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


@functools.lru_cache(maxsize=256)
def build_grammar(kind: str, text: str, json_whitespace: bool = False) -> Any:
    """The xgrammar Grammar of one constraint (cached by its key). GrammarError says what is wrong with it."""
    xgr = xgrammar()
    try:
        if kind == "json":
            schema = loads_bounded(text, "the JSON schema")
            if not isinstance(schema, dict):
                raise GrammarError("a JSON schema must be a JSON object")
            _check_schema(schema)
            return xgr.Grammar.from_json_schema(text, any_whitespace=json_whitespace, strict_mode=True)
        if kind == "json_object":  # any object, compact like the schemas (strict_mode off: any keys)
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=json_whitespace,
                                                strict_mode=False)
        if kind == "regex":
            if _LOOKAROUND.search(text):  # xgrammar would warn and drop it
                raise GrammarError("invalid regex for structured output: lookaround is not supported")
            _check_repeats(text, "regex")
            return xgr.Grammar.from_regex(text)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(text.split("\x00")))
        if kind == "grammar":
            _check_repeats(_EBNF_LITERAL.sub('""', text), "grammar")  # a quoted "{5}" is text, not a repeat
            return xgr.Grammar.from_ebnf(text)
    except GrammarError:
        raise
    except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar reports a bad input as one of these
        message = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        message = _XGRAMMAR_PREFIX.sub("", message)  # "[06:35:06] /project/cpp/regex_converter.cc:83: "
        raise GrammarError(f"invalid {kind} for structured output: {message[:500]}") from None
    raise GrammarError(f"unknown structured output kind {kind!r}")


def _check_schema(root: Any) -> None:
    """Refuses what xgrammar would let the output break: keywords it ignores (checked by generating against them),
    and length or item counts that make its compile slow (maxLength 10**9: 2.6 s), far beyond any answer a
    context-bounded model can give."""
    stack = [root]
    while stack:
        schema = stack.pop()
        if not isinstance(schema, dict):
            continue
        for key, value in schema.items():
            if key in _IGNORED_BY_XGRAMMAR and not (key == "uniqueItems" and value is False):
                raise GrammarError(f"unsupported JSON schema feature {key!r}: the grammar cannot enforce it")
            if key == "multipleOf" and schema.get("type") != "integer":
                raise GrammarError("unsupported JSON schema feature 'multipleOf' outside an integer")
            if key == "pattern" and isinstance(value, str):
                if _LOOKAROUND.search(value):
                    raise GrammarError("unsupported JSON schema feature: lookaround in a pattern")
                _check_repeats(value, "json")
            if key == "patternProperties" and isinstance(value, dict):
                for pattern in value:
                    _check_repeats(pattern, "json")
            if key in _COUNT_KEYWORDS and isinstance(value, int | float) and value > MAX_SCHEMA_COUNT:
                raise GrammarError(f"invalid json for structured output: {key}={value} is above {MAX_SCHEMA_COUNT}")
            if key == "properties" and isinstance(value, dict) and len(value) > MAX_SCHEMA_PROPERTIES:
                raise GrammarError(f"invalid json for structured output: an object has {len(value)} properties; at "
                                   f"most {MAX_SCHEMA_PROPERTIES} are allowed")
            if key in _SUBSCHEMA_MAPS and isinstance(value, dict):
                stack.extend(value.values())
            elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
                stack.extend(value)
            elif key in _SUBSCHEMAS:
                stack.append(value)


def _check_repeats(pattern: str, kind: str) -> None:
    """Refuses a repetition `{m}`, `{m,}` or `{m,n}` whose counts pass MAX_REPEAT_COUNT."""
    for match in _REPEAT.finditer(pattern):
        for count in match.groups():
            if count and (len(count) > 9 or int(count) > MAX_REPEAT_COUNT):
                raise GrammarError(f"invalid {kind} for structured output: the repetition {match.group(0)[:40]} "
                                   f"counts past {MAX_REPEAT_COUNT}, the most a repetition may count")


def check_structured_outputs(params: StructuredOutputsParams) -> None:
    """Raises GrammarError when the constraint cannot be built; warms the cache for the compiler."""
    build_grammar(*params.key)
