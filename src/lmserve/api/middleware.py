"""ASGI middleware: the API key check and the arrival stamp, both before anything else runs (body parsing included).

Pure ASGI rather than BaseHTTPMiddleware, which would get in the way of streaming and disconnect detection.
"""

from __future__ import annotations

import hmac

from fastapi import Request
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from lmserve.api.errors import error_response
from lmserve.metrics.clock import now

# Paths that need the API key when one is set; /health, /metrics and /version stay open for probes and scrapers,
# and the dashboard page and its static files load without it (the page then asks for the key).
PROTECTED_PREFIXES = ("/v1/", "/debug/", "/dashboard/api/", "/tokenize", "/detokenize")


class ApiKeyMiddleware:
    """Checks the Bearer key before anything else (even body parsing), so unauthenticated clients learn nothing.

    Pure ASGI rather than BaseHTTPMiddleware, which would get in the way of streaming and disconnect detection.
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED_PREFIXES):
            given = Headers(scope=scope).get("authorization", "").encode()
            if not hmac.compare_digest(given, self.expected):
                response = error_response(401, "invalid or missing API key (expected 'Authorization: Bearer <key>')")
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
