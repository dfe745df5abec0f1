"""Reading a request body: bounded in bytes before it is read, parsed strictly from the JSON text."""

from __future__ import annotations

from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from lmserve.api.request_error import RequestError

Model = TypeVar("Model", bound=BaseModel)


class BodyTooLargeError(Exception):
    """The body is over the server's limit (HTTP 413)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the request body is larger than this server's limit of {limit} bytes "
                         "(--max-request-body-bytes)")


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


async def parse_body(request: Request, model: type[Model], limit: int) -> Model:
    body = await read_body(request, limit)
    if not body.strip():
        raise RequestError("the request body is empty; expected a JSON object")
    try:
        # pydantic's own JSON parser: invalid UTF-8, lone surrogates, NaN and Infinity are refused here.
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise InvalidBodyError(exc) from None
