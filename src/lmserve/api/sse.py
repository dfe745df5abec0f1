"""Responses: SSE framing, and JSON and event-stream responses that end their request group's life (its owner,
frontend/request_group.py, aborts what has not finished and records it) once the last byte is written or the client
is gone."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Any, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from pydantic_core import PydanticSerializationError
from starlette.types import Receive, Scope, Send

from lmserve.api.choices import Choices
from lmserve.api.errors import exception_to_response
from lmserve.api.protocol import UsageInfo
from lmserve.frontend.request_group import RequestGroup, until_client_gone

logger = logging.getLogger(__name__)

T = TypeVar("T")

SSE_DONE = "data: [DONE]\n\n"
_OPTIONAL_FIELDS = ("timelines", "prompt_logprobs")


def dump_json(payload: BaseModel) -> str:
    # lmserve's and vLLM's extra fields only appear when the client asked for them; OpenAI's None fields stay.
    exclude: dict[str, Any] = {name: True for name in _OPTIONAL_FIELDS if getattr(payload, name, None) is None}
    choices = getattr(payload, "choices", None) or []
    if all(getattr(c, "prompt_logprobs", None) is None for c in choices):
        exclude["choices"] = {"__all__": {"prompt_logprobs"}}
    try:
        return payload.model_dump_json(exclude=exclude or None)
    except PydanticSerializationError:
        # A lone surrogate a parser let through (UTF-8 cannot carry it): ASCII JSON escapes it, and the answer
        # still goes out rather than a 500 or a broken stream.
        logger.warning("a response held text UTF-8 cannot carry; sent with it escaped")
        return json.dumps(payload.model_dump(exclude=exclude or None))


def sse(payload: BaseModel) -> str:
    return f"data: {dump_json(payload)}\n\n"


def sse_error(exc: Exception) -> str:
    response = exception_to_response(exc)
    return f"data: {response.body.decode()}\n\n"


class ClosingEventStream(StreamingResponse):
    """An SSE response that runs `close` once it ends, however it ends.

    When the client leaves while a chunk (or the headers) is being sent, the cancellation never reaches the
    generator's own awaits, and a generator that never started has no cleanup to run: without this, what feeds the
    stream (an engine request, a decode instance behind the router) would go on for nobody.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[Any], close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.close = close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.close()


class EventStreamResponse(ClosingEventStream):
    """Closes its event generator when it ends, however it ends, then ends its request group's life (`group_life`:
    the group's context, handed over by the handler that entered it)."""

    def __init__(self, events: AsyncIterator[str], group_life: AsyncExitStack) -> None:
        super().__init__(events, self._close)
        self.events = events
        self.group_life = group_life

    async def _close(self) -> None:
        aclose = getattr(self.events, "aclose", None)
        if aclose is not None:
            await aclose()
        await self.group_life.aclose()


def json_response(payload: BaseModel) -> Response:
    return Response(dump_json(payload), media_type="application/json")


class RecordedJSONResponse(Response):
    """A JSON response that ends its request group's life (`group_life`, as EventStreamResponse's) once its last byte
    is written: the group then records its requests' timelines."""

    media_type = "application/json"

    def __init__(self, payload: BaseModel, group_life: AsyncExitStack) -> None:
        super().__init__(dump_json(payload))
        self.group_life = group_life

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.group_life.aclose()


def trailer(
    choices: Choices, group: RequestGroup, include_usage: bool, return_timeline: bool
) -> tuple[UsageInfo | None, list[dict[str, Any]] | None] | None:
    """(usage, timelines) for the last chunk before [DONE], or None when the client asked for neither."""
    if not (include_usage or return_timeline):
        return None
    return choices.usage() if include_usage else None, group.timeline_dicts() if return_timeline else None


async def until_disconnect(work: Awaitable[T], request: Request) -> T:
    """Runs `work` as a task and cancels it when the HTTP client goes away (uvicorn never cancels handlers)."""
    return await until_client_gone(work, request.is_disconnected)
