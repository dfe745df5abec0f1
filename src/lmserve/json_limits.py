"""Bounds on JSON a client sends, shared by the API (request bodies, tool-call arguments) and the grammar builder
(JSON schemas sent as text). A value nested thousands deep makes Python's recursive walkers (json, copy.deepcopy,
a chat template's tojson) raise RecursionError, and a deep schema makes xgrammar's compile time grow as the cube of
its depth (256 levels: 10 s); so every JSON value a client sends, and every string of it parsed later, is at most
MAX_JSON_DEPTH deep (docs/limits.md).
"""

from __future__ import annotations

from typing import Any

import pydantic_core

# Arrays and objects inside each other; a JSON schema object level costs two (the object and its "properties").
MAX_JSON_DEPTH = 64


class JsonTooDeepError(ValueError):
    """A JSON value nested deeper than MAX_JSON_DEPTH."""


def json_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> int:
    """How many arrays and objects are nested in `value` (a scalar: 0), counting no further than limit + 1.

    Iterative: a value that came from a JSON parser with a higher limit (pydantic's: 200) must not reach Python's
    recursion limit here either."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        depth += 1
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        stack.extend((child, depth) for child in children if isinstance(child, dict | list | tuple))
    return deepest


def check_json_depth(value: Any, what: str, limit: int = MAX_JSON_DEPTH) -> Any:
    """`value`, or JsonTooDeepError naming `what` when it is nested deeper than `limit`."""
    if json_depth(value, limit) > limit:
        raise JsonTooDeepError(f"{what} is nested more than {limit} levels deep (arrays and objects); at most "
                               f"{limit} are allowed")
    return value


def loads_bounded(text: str, what: str, limit: int = MAX_JSON_DEPTH) -> Any:
    """JSON text a client sent inside a string (tool-call arguments, a schema), parsed without recursion in
    Python: ValueError when it is not JSON, JsonTooDeepError when it is nested deeper than `limit`."""
    try:
        value = pydantic_core.from_json(text)
    except ValueError as exc:
        if "recursion limit" in str(exc):
            raise JsonTooDeepError(f"{what} is nested more than {limit} levels deep (arrays and objects); at "
                                   f"most {limit} are allowed") from None
        raise
    return check_json_depth(value, what, limit)
