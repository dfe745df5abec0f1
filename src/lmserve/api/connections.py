"""uvicorn's HTTP/1.1 protocol with a deadline on a request's headers.

uvicorn times out an idle keep-alive connection only after a response; a connection that sends its headers one
byte at a time (or nothing at all) stays open without end, and enough of them hold every connection the server
allows. Here the headers of each request must be complete `header_timeout` seconds (--header-timeout) after the
connection opens or the last response ends; the body has its own deadline (middleware.BodyDeadlineMiddleware).
"""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from lmserve.config import DEFAULT_HEADER_TIMEOUT_S, DEFAULT_LIMIT_CONCURRENCY

HEADER_TIMEOUT_S = DEFAULT_HEADER_TIMEOUT_S
# Connections (and requests in flight) past this are answered 503 by uvicorn: each holds a file descriptor.
MAX_CONNECTIONS = DEFAULT_LIMIT_CONCURRENCY


class DeadlineH11Protocol(H11Protocol):
    header_timeout = HEADER_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_deadline: asyncio.TimerHandle | None = None
        self._arm_header_deadline()

    def handle_events(self) -> None:
        super().handle_events()
        if self._waiting_for_headers():
            return
        self._disarm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._waiting_for_headers():
            self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def _waiting_for_headers(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm_header_deadline(self) -> None:
        self._disarm_header_deadline()
        self._header_deadline = self.loop.call_later(self.header_timeout, self._headers_too_late)

    def _disarm_header_deadline(self) -> None:
        deadline = getattr(self, "_header_deadline", None)
        if deadline is not None:
            deadline.cancel()
            self._header_deadline = None

    def _headers_too_late(self) -> None:
        self._header_deadline = None
        if self._waiting_for_headers() and not self.transport.is_closing():
            self.transport.close()


def with_header_timeout(seconds: float) -> type[DeadlineH11Protocol]:
    """The protocol class with its own header deadline (uvicorn takes a class and builds one per connection)."""
    if seconds == DeadlineH11Protocol.header_timeout:
        return DeadlineH11Protocol
    return type("DeadlineH11Protocol", (DeadlineH11Protocol,), {"header_timeout": seconds})


def uvicorn_config(
    app: Any, *, header_timeout: float = HEADER_TIMEOUT_S, limit_concurrency: int = MAX_CONNECTIONS, **options: Any
) -> uvicorn.Config:
    """uvicorn's configuration for the API: the header deadline and the connection cap (--header-timeout,
    --limit-concurrency), and whatever else the caller passes (host, port, log_level, ...)."""
    return uvicorn.Config(app, http=with_header_timeout(header_timeout), limit_concurrency=limit_concurrency,
                          **options)
