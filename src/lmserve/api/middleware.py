"""ASGI middleware: the API key check and the arrival stamp, both before anything else runs (body parsing included),
and the deadline of a request's body.

Pure ASGI rather than BaseHTTPMiddleware, which would get in the way of streaming and disconnect detection.
"""

from __future__ import annotations

import asyncio
import hmac

from fastapi import Request
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lmserve.api.anthropic import ANTHROPIC_PATHS, as_anthropic_error
from lmserve.api.body import BodyTimeoutError
from lmserve.api.errors import error_response
from lmserve.config import DEFAULT_BODY_TIMEOUT_S
from lmserve.metrics.clock import now

# Paths that need the API key when one is set; /health, /metrics and /version stay open for probes and scrapers,
# and the dashboard page and its static files load without it (the page then asks for the key). The API docs are
# guarded: they list every route and schema, which tells an unauthenticated visitor what to try.
PROTECTED_PREFIXES = ("/v1/", "/debug/", "/dashboard/api/", "/tokenize", "/detokenize", "/infill", "/rerank", "/docs",
                      "/redoc", "/openapi.json")


class ApiKeyMiddleware:
    """Checks the Bearer key before anything else (even body parsing), so unauthenticated clients learn nothing.
    Anthropic's clients send the key as `x-api-key` instead: either header may carry it.

    Pure ASGI rather than BaseHTTPMiddleware, which would get in the way of streaming and disconnect detection.
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.expected_key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED_PREFIXES):
            headers = Headers(scope=scope)
            bearer, key = headers.get("authorization", "").encode(), headers.get("x-api-key", "").encode()
            # Both compared whatever the first gives, so the time taken tells nothing about which one is close.
            bearer_ok, key_ok = hmac.compare_digest(bearer, self.expected), hmac.compare_digest(key, self.expected_key)
            if not (bearer_ok or key_ok):
                response = error_response(401, "invalid or missing API key (expected 'Authorization: Bearer <key>' "
                                               "or 'x-api-key: <key>')")
                if scope["path"].startswith(ANTHROPIC_PATHS):
                    response = as_anthropic_error(response)
                response.headers["WWW-Authenticate"] = "Bearer"
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class ArrivalStampMiddleware:
    """Stamps each HTTP request's arrival before anything else runs (body parsing included): the timeline's start."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope.setdefault("state", {})["arrival_time"] = now()
        await self.app(scope, receive, send)


def arrival_time(request: Request) -> float:
    return getattr(request.state, "arrival_time", None) or now()


# A body trickled one byte at a time held its connection and handler open without end (--body-timeout).
BODY_TIMEOUT_S = DEFAULT_BODY_TIMEOUT_S


class BodyDeadlineMiddleware:
    """Cuts off a request whose body has not all arrived `timeout` seconds after its headers: the handler reading it
    gets BodyTimeoutError (a 408, and the connection is closed). Once the body is complete, receive() is left alone:
    it then waits for the client's disconnect, which may come at any time."""

    def __init__(self, app: ASGIApp, timeout: float = BODY_TIMEOUT_S) -> None:
        self.app = app
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline = now() + self.timeout
        body_done = False

        async def receive_in_time() -> Message:
            nonlocal body_done
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - now(), 0.0))
            except TimeoutError:
                raise BodyTimeoutError(f"the request body did not arrive within {self.timeout:g} s (--body-timeout)") from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        await self.app(scope, receive_in_time, send)
