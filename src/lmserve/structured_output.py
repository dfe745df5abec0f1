"""Grammars for constrained decoding, with xgrammar (vLLM's and SGLang's choice): one place that turns a request's
StructuredOutputsParams into an xgrammar Grammar, used by the front-end to check a request (a 400 naming the problem,
before anything is queued) and by the engine to compile it against the vocabulary.

JSON schemas compile without free whitespace (`any_whitespace=False`): the output is compact JSON, and a small model
cannot wander into an endless run of spaces or newlines that a grammar would have to allow.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from lmserve.sampling_params import StructuredOutputsParams

MAX_SCHEMA_COUNT = 100_000
_COUNT_KEYWORDS = {"minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties"}
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


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
def build_grammar(kind: str, text: str) -> Any:
    """The xgrammar Grammar of one constraint (cached by its key). GrammarError says what is wrong with it."""
    xgr = xgrammar()
    try:
        if kind == "json":
            schema = json.loads(text)
            if not isinstance(schema, dict):
                raise GrammarError("a JSON schema must be a JSON object")
            _check_counts(schema)
            return xgr.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=True)
        if kind == "json_object":  # any object, compact like the schemas (strict_mode off: any keys)
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if kind == "regex":
            return xgr.Grammar.from_regex(text)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(text.split("\x00")))
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(text)
    except GrammarError:
        raise
    except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar reports a bad input as one of these
        message = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        message = _XGRAMMAR_PREFIX.sub("", message)  # "[06:35:06] /project/cpp/regex_converter.cc:83: "
        raise GrammarError(f"invalid {kind} for structured output: {message[:500]}") from None
    raise GrammarError(f"unknown structured output kind {kind!r}")


def _check_counts(node: Any) -> None:
    """Length and item counts bounded: xgrammar's compile time grows with them (maxLength 10**9: 2.6 s), and no
    answer of a context-bounded model gets near the bound anyway."""
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for key, value in item.items():
                if key in _COUNT_KEYWORDS and isinstance(value, int | float) and value > MAX_SCHEMA_COUNT:
                    raise GrammarError(f"invalid json for structured output: {key}={value} is above "
                                       f"{MAX_SCHEMA_COUNT}")
                stack.append(value)
        elif isinstance(item, list):
            stack.extend(item)


def check_structured_outputs(params: StructuredOutputsParams) -> None:
    """Raises GrammarError when the constraint cannot be built; warms the cache for the compiler."""
    build_grammar(*params.key)
