"""Reading a request body: bounded in bytes before it is read, bounded in JSON values before it is parsed, parsed
strictly from the JSON text, off the event loop when it is large."""

from __future__ import annotations

import asyncio
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from lmserve.api.request_error import RequestError

Model = TypeVar("Model", bound=BaseModel)

# Parsing holds the GIL in native code (pydantic's parser) for ~1 µs per string, object or array and ~0.15 µs per
# number on a slow core: an 8 MiB body of 2 million tiny values held every other client's request for seconds.
# These bounds keep one parse near 0.1 s, far above any request a model's context could serve (docs/limits.md).
MAX_BODY_CONTAINERS_AND_STRINGS = 65_536
MAX_BODY_ELEMENTS = 262_144
# A body larger than this is parsed on a worker thread; smaller ones parse faster than a thread hop.
PARSE_INLINE_BYTES = 64 * 1024


class BodyTooLargeError(Exception):
    """The body is over the server's limit (HTTP 413)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the request body is larger than this server's limit of {limit} bytes "
                         "(--max-request-body-bytes)")


class BodyTimeoutError(Exception):
    """The request body did not all arrive within its deadline (HTTP 408; api/middleware.py)."""


class InvalidBodyError(ValueError):
    """The body is not valid JSON for the route's schema (HTTP 400); wraps pydantic's errors."""

    def __init__(self, error: ValidationError) -> None:
        super().__init__(str(error))
        self.errors = error.errors(include_url=False, include_input=False, include_context=False)


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refused as soon as it (or its declared length) passes `limit`."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLargeError(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLargeError(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def check_body_values(body: bytes) -> None:
    """Refuses a body with more JSON values than one parse may cost, counted without parsing (a few ms for 8 MiB).

    The counts include brackets, quotes and commas inside strings, so they are upper bounds: only text full of them
    could be refused, and such text is refused long before by the prompt's own length limit. An escaped quote
    (`\\"`) is not a string's end, so it is not counted."""
    quotes = body.count(b'"') - body.count(b'\\"')
    containers = body.count(b"{") + body.count(b"[")
    costly = quotes // 2 + containers
    if costly > MAX_BODY_CONTAINERS_AND_STRINGS:
        raise RequestError(f"the request body holds about {costly} JSON strings, objects and arrays; at most "
                           f"{MAX_BODY_CONTAINERS_AND_STRINGS} are allowed (docs/limits.md)")
    elements = body.count(b",") + containers
    if elements > MAX_BODY_ELEMENTS:
        raise RequestError(f"the request body holds about {elements} JSON array elements and object members; at "
                           f"most {MAX_BODY_ELEMENTS} are allowed (docs/limits.md)")


def validate_body(body: bytes, model: type[Model]) -> Model:
    if not body.strip():
        raise RequestError("the request body is empty; expected a JSON object")
    check_body_values(body)
    try:
        # pydantic's own JSON parser: invalid UTF-8, lone surrogates, NaN and Infinity are refused here, and so is
        # nesting deeper than 200 levels (the fields that take any JSON bound theirs to MAX_JSON_DEPTH).
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise InvalidBodyError(exc) from None


async def parse_body(request: Request, model: type[Model], limit: int) -> Model:
    body = await read_body(request, limit)
    if len(body) <= PARSE_INLINE_BYTES:
        return validate_body(body, model)
    return await asyncio.to_thread(validate_body, body, model)
