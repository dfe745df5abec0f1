"""What a failure looks like to an HTTP client: OpenAI-style error bodies, decided in one place."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from http import HTTPStatus

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from lmserve.api.body import BodyTimeoutError, BodyTooLargeError, InvalidBodyError
from lmserve.api.protocol import ErrorInfo, ErrorResponse
from lmserve.api.request_error import RequestError
from lmserve.frontend.errors import ClientDisconnected, EngineDeadError, EngineNotReadyError, QueueFullError

logger = logging.getLogger(__name__)

# nginx's "client closed request": nobody reads it, but access logs show why the request ended.
STATUS_CLIENT_CLOSED = 499
# What a 429 asks the client to wait before it retries, in seconds.
RETRY_AFTER_S = 1
MAX_MESSAGE_CHARS = 2000

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class NotFoundError(LookupError):
    """Something a request names that this server does not have (HTTP 404); `param` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelNotFoundError(LookupError):
    pass


def _printable(text: str) -> str:
    # A message may quote the client's input: never let it break the response (lone surrogates) or grow it.
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= MAX_MESSAGE_CHARS else text[: MAX_MESSAGE_CHARS - 3] + "..."


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    error_type = ERROR_TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    body = ErrorResponse(error=ErrorInfo(
        message=_printable(message), type=error_type, param=None if param is None else _printable(param), code=status,
    ))
    return JSONResponse(body.model_dump(), status_code=status)


def _validation_message(exc: RequestValidationError | InvalidBodyError) -> tuple[str, str | None]:
    errors = exc.errors if isinstance(exc, InvalidBodyError) else exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    unknown = [".".join(str(p) for p in e.get("loc", ()) if p != "body") for e in errors
               if e.get("type") == "extra_forbidden"]
    if unknown and len(unknown) == len(errors):
        return f"unsupported request field(s): {', '.join(unknown[:20])} (lmserve does not implement them)", unknown[0]
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    where = ".".join(loc)
    message = f"{where or 'request body'}: {first.get('msg')}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more errors)"
    return message, (loc[0] if loc else None)


def exception_to_response(exc: Exception) -> Response:
    """The one place that decides what a failure looks like to the client."""
    if isinstance(exc, RequestError):
        return error_response(400, str(exc), exc.param)
    if isinstance(exc, (RequestValidationError, InvalidBodyError)):
        return error_response(400, *_validation_message(exc))
    if isinstance(exc, BodyTooLargeError):
        return error_response(413, str(exc))
    if isinstance(exc, BodyTimeoutError):
        response = error_response(408, str(exc))
        response.headers["Connection"] = "close"  # the rest of the body is not worth waiting for
        return response
    if isinstance(exc, QueueFullError):
        response = error_response(429, str(exc))
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
        return response
    if isinstance(exc, ModelNotFoundError):
        return error_response(404, str(exc), "model")
    if isinstance(exc, NotFoundError):
        return error_response(404, str(exc), exc.param)
    if isinstance(exc, (EngineDeadError, EngineNotReadyError)):
        return error_response(503, str(exc) or type(exc).__name__)
    if isinstance(exc, (ClientDisconnected, ClientDisconnect)):
        return Response(status_code=STATUS_CLIENT_CLOSED)
    if isinstance(exc, StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail))
    logger.error("unexpected error while serving a request", exc_info=exc)
    return error_response(500, f"internal server error ({type(exc).__name__})")


class ErrorMappingRoute(APIRoute):
    """Turns every failure in a handler into an OpenAI error body, without re-raising into the ASGI server."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as exc:  # noqa: BLE001 - the boundary: exception_to_response logs the unexpected
                return exception_to_response(exc)

        return handle
