"""Responses: SSE framing, and JSON and event-stream responses that close their request group and record its
timelines once the last byte is written (or the client is gone)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from pydantic_core import PydanticSerializationError
from starlette.types import Receive, Scope, Send

from lmserve.api.choices import Choices
from lmserve.api.errors import ClientDisconnected, exception_to_response
from lmserve.api.protocol import UsageInfo
from lmserve.frontend.request_group import RequestGroup

logger = logging.getLogger(__name__)

T = TypeVar("T")

# How often a non-streamed request checks whether its client is still there (uvicorn never cancels handlers).
DISCONNECT_POLL_S = 0.2
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
    """Closes its event generator and its engine requests when it ends, then records their timelines."""

    def __init__(self, events: AsyncIterator[str], group: RequestGroup) -> None:
        super().__init__(events, self._close)
        self.events = events
        self.group = group

    async def _close(self) -> None:
        aclose = getattr(self.events, "aclose", None)
        if aclose is not None:
            await aclose()
        await self.group.close()
        self.group.record(delivered=True)


def json_response(payload: BaseModel) -> Response:
    return Response(dump_json(payload), media_type="application/json")


class RecordedJSONResponse(Response):
    """A JSON response that records its requests' timelines once its last byte is written."""

    media_type = "application/json"

    def __init__(self, payload: BaseModel, group: RequestGroup) -> None:
        super().__init__(dump_json(payload))
        self.group = group

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.group.record(delivered=True)


def trailer(
    choices: Choices, group: RequestGroup, include_usage: bool, return_timeline: bool
) -> tuple[UsageInfo | None, list[dict[str, Any]] | None] | None:
    """(usage, timelines) for the last chunk before [DONE], or None when the client asked for neither."""
    if not (include_usage or return_timeline):
        return None
    return choices.usage() if include_usage else None, group.timeline_dicts() if return_timeline else None


async def until_disconnect(work: Awaitable[T], request: Request) -> T:
    """Runs `work` as a task and cancels it when the HTTP client goes away (uvicorn never cancels handlers)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientDisconnected()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.wait({task})  # its own cleanup aborts the engine requests
            if not task.cancelled() and task.exception() is not None:
                logger.debug("request task failed while being cancelled: %r", task.exception())
