"""`lmserve router`: one OpenAI endpoint in front of prefill instances and decode instances (vLLM's disaggregated
prefill proxy). Each completion, chat or Responses request goes first to a prefill instance with one output token
(it computes the prompt, and its --kv-transfer-config kv_producer stores the prompt's KV blocks), then, as the client
sent it, to a decode instance (kv_consumer), which loads those blocks instead of computing them and streams the answer
back. With several instances of a role, each request goes to the one with the fewest requests in flight through this
router (ties in turn).

The instances must serve the same model with the same settings; the router only forwards. Errors from an instance
reach the client as they were sent; one that cannot be reached, or that fails, is a 502 naming it (mid-stream: an
error event, then the end of the stream). A client that goes away cancels the request where it is: the prefill call,
the decode call or the decode stream, each of which the instance aborts.

Its own `--api-key` (or LMSERVE_API_KEY) guards its /v1 routes; the instances are reached with
`--instance-api-key` (LMSERVE_INSTANCE_API_KEY) where given, else with the client's own Authorization header. /health
tells everyone whether the instances are healthy, and only clients with the key which instances they are. Prefill
calls, decode calls and health checks each have a connection pool of their own, and a call waits a bounded time for
a connection (a 503 after that), so that streams holding every decode connection never starve the prefill calls or
make /health report healthy instances as down. Bodies are parsed strictly (depth, NaN and Infinity, numbers out of
range, lone surrogates): what the instances would refuse is refused here, as a JSON 400.
"""

from __future__ import annotations

import asyncio
import hmac
import math
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pydantic_core
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from lmserve.api.body import BodyTooLargeError, read_body
from lmserve.api.errors import error_response
from lmserve.api.sse import ClosingEventStream, until_disconnect
from lmserve.frontend.errors import ClientDisconnected

# A client's key reaches the instances as it came (Anthropic's clients send x-api-key), with Anthropic's version.
FORWARDED_HEADERS = ("authorization", "x-api-key", "anthropic-version")
# Prefilled on a prefill instance, then decoded: OpenAI's three, and the coding tools' surfaces (docs/coding-clients.md):
# Anthropic's Messages API and llama.cpp's /infill.
GENERATING_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages", "/infill")
CLIENT_CLOSED_REQUEST = 499  # nginx's: nobody reads it
API_KEY_ENV = "LMSERVE_API_KEY"  # the router's own key, where it is not given as --api-key (`ps` shows argv)
INSTANCE_API_KEY_ENV = "LMSERVE_INSTANCE_API_KEY"
DEFAULT_MAX_CONNECTIONS = 256  # per role (prefill, decode): a decode stream holds one for its whole length
POOL_WAIT_S = 10.0  # the longest a call waits for a free connection before it is answered 503
HEALTH_TIMEOUT_S = 5.0


class RejectedBody(ValueError):
    """A body the router refuses before forwarding it (a 400 naming why)."""


def parse_payload(body: bytes) -> object:
    """The body as JSON, parsed strictly: nesting past 200 levels, NaN and Infinity, numbers that do not fit a
    float (1e999) and lone surrogates are refused, as the instances refuse them (json.loads took them, and
    forwarding them failed as a plain-text 500)."""
    try:
        payload = pydantic_core.from_json(body, allow_inf_nan=False)
    except ValueError as exc:
        raise RejectedBody(f"the request body is not valid JSON: {exc}") from None
    pending = [payload]
    while pending:  # the parser bounds the depth, so this walk is as long as the body, no deeper
        value = pending.pop()
        if isinstance(value, float) and not math.isfinite(value):
            raise RejectedBody("the request body holds a number out of range (it must fit a 64-bit float)")
        if isinstance(value, dict):
            pending.extend(value.values())
        elif isinstance(value, list):
            pending.extend(value)
    return payload


def bearer_matches(request: Request, api_key: str) -> bool:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


def prefill_request(payload: dict, path: str = "/v1/completions") -> dict:
    """The request as the prefill instance gets it: one token, not streamed, one choice, the prompt unchanged."""
    prefill = {k: v for k, v in payload.items() if k not in ("stream_options", "min_tokens")}
    prefill["stream"] = False
    if path == "/v1/responses":  # no n; its length field is max_output_tokens
        prefill["max_output_tokens"] = 1
        return prefill
    if path == "/v1/messages":  # Anthropic's: no n, max_tokens required
        prefill["max_tokens"] = 1
        return prefill
    if path == "/infill":  # llama.cpp's: no n; n_predict, or the OpenAI name it also reads
        prefill.pop("n_predict", None)
        prefill["max_tokens"] = 1
        return prefill
    prefill["n"] = 1
    if "max_completion_tokens" in prefill:
        prefill["max_completion_tokens"] = 1
        prefill.pop("max_tokens", None)
    else:
        prefill["max_tokens"] = 1
    return prefill


class InstanceFailed(Exception):
    def __init__(self, role: str, url: str, exc: Exception) -> None:
        super().__init__(f"the {role} instance {url} failed: {type(exc).__name__}: {exc}")


class Instances:
    """One role's instances and the requests this router has in flight on each."""

    def __init__(self, role: str, urls: list[str]) -> None:
        if not urls:
            raise ValueError(f"the router needs at least one {role} instance")
        self.role = role
        self.urls = [url.rstrip("/") for url in urls]
        self.in_flight = [0] * len(self.urls)
        self._next = 0

    def acquire(self) -> int:
        """The instance with the fewest requests in flight, ties in turn; counted until release()."""
        order = [(self._next + k) % len(self.urls) for k in range(len(self.urls))]
        chosen = min(order, key=lambda i: self.in_flight[i])
        self._next = (chosen + 1) % len(self.urls)
        self.in_flight[chosen] += 1
        return chosen

    def release(self, index: int) -> None:
        self.in_flight[index] -= 1


class PoolExhausted(Exception):
    def __init__(self, role: str) -> None:
        super().__init__(f"every connection of this router to its {role} instances is busy (waited "
                         f"{POOL_WAIT_S:.0f} s): try again shortly, or start the router with more "
                         "--max-instance-connections")


def build_router_app(prefill_urls: list[str], decode_urls: list[str], max_body_bytes: int,
                     timeout_s: float = 600.0, api_key: str | None = None, instance_api_key: str | None = None,
                     max_connections: int = DEFAULT_MAX_CONNECTIONS, pool_wait_s: float = POOL_WAIT_S) -> FastAPI:
    prefill, decode = Instances("prefill", prefill_urls), Instances("decode", decode_urls)

    def pool(size: int, timeout: float) -> httpx.AsyncClient:
        return httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0, pool=pool_wait_s),
                                 limits=httpx.Limits(max_connections=size, max_keepalive_connections=size))

    # One pool per role, and one for health checks: streams holding every decode connection must not hold up a
    # prefill call or a health check.
    clients = {"prefill": pool(max_connections, timeout_s), "decode": pool(max_connections, timeout_s),
               "health": pool(max(4, len(prefill.urls) + len(decode.urls)), HEALTH_TIMEOUT_S)}

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        for client in clients.values():
            await client.aclose()

    app = FastAPI(title="lmserve router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.instances = {"prefill": prefill, "decode": decode}
    app.state.clients = clients

    def unauthorized(request: Request) -> Response | None:
        if api_key is None or bearer_matches(request, api_key) or hmac.compare_digest(
                request.headers.get("x-api-key", "").encode(), api_key.encode()):
            return None
        return error_response(401, "a valid API key is required: send 'Authorization: Bearer KEY' (or 'x-api-key: "
                                   "KEY')")

    def instance_headers(request: Request) -> dict[str, str]:
        if instance_api_key is not None:
            return {"authorization": f"Bearer {instance_api_key}"}
        return {h: request.headers[h] for h in FORWARDED_HEADERS if h in request.headers}

    async def post(role: Instances, path: str, payload: dict, headers: dict[str, str]) -> httpx.Response:
        index = role.acquire()
        try:
            return await clients[role.role].post(role.urls[index] + path, json=payload, headers=headers)
        except httpx.PoolTimeout as exc:
            raise PoolExhausted(role.role) from exc
        except httpx.HTTPError as exc:
            raise InstanceFailed(role.role, role.urls[index], exc) from exc
        finally:
            role.release(index)

    async def open_stream(path: str, payload: dict, headers: dict[str, str]) -> Response:
        index = decode.acquire()
        url = decode.urls[index]
        client = clients["decode"]
        try:
            upstream = await client.send(client.build_request("POST", url + path, json=payload, headers=headers),
                                         stream=True)
        except BaseException as exc:  # a failure, or the client gone while the instance had not answered yet
            decode.release(index)
            if isinstance(exc, httpx.PoolTimeout):
                raise PoolExhausted("decode") from exc
            if isinstance(exc, httpx.HTTPError):
                raise InstanceFailed("decode", url, exc) from exc
            raise
        released = False

        async def close() -> None:  # however the response ends: a client gone before the first chunk included
            nonlocal released
            await upstream.aclose()
            if not released:
                released = True
                decode.release(index)

        if upstream.status_code != 200:
            try:
                body = await upstream.aread()
            except httpx.HTTPError as exc:
                raise InstanceFailed("decode", url, exc) from exc
            finally:
                await close()
            return Response(body, upstream.status_code, media_type="application/json")

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for line in upstream.aiter_lines():  # whole lines: an error event never lands mid-event
                    yield (line + "\n").encode()
            except httpx.HTTPError as exc:
                failure = error_response(502, str(InstanceFailed("decode", url, exc)))
                yield b"\n" + b"data: " + failure.body + b"\n\n"
            finally:
                await close()

        return ClosingEventStream(relay(), close)  # a client gone before the first chunk included

    async def answer(path: str, payload: dict, headers: dict[str, str], through_prefill: bool = True) -> Response:
        if not through_prefill:
            counted = await post(decode, path, payload, headers)
            return Response(counted.content, counted.status_code, media_type="application/json")
        prefilled = await post(prefill, path, prefill_request(payload, path), headers)
        if prefilled.status_code != 200:
            return Response(prefilled.content, prefilled.status_code, media_type="application/json")
        if payload.get("stream"):
            return await open_stream(path, payload, headers)
        decoded = await post(decode, path, payload, headers)
        return Response(decoded.content, decoded.status_code, media_type="application/json")

    async def forward(request: Request, path: str, through_prefill: bool = True) -> Response:
        if (refused := unauthorized(request)) is not None:
            return refused
        try:
            payload = parse_payload(await read_body(request, max_body_bytes))
        except BodyTooLargeError as exc:
            return error_response(413, str(exc))
        except RejectedBody as exc:
            return error_response(400, str(exc))
        if not isinstance(payload, dict):
            return error_response(400, "the request body must be a JSON object")
        headers = instance_headers(request)
        try:
            return await until_disconnect(answer(path, payload, headers, through_prefill), request)
        except InstanceFailed as exc:
            return error_response(502, str(exc))
        except PoolExhausted as exc:
            return error_response(503, str(exc))
        except ClientDisconnected:  # the call in flight was cancelled: its instance aborts the request
            return Response(status_code=CLIENT_CLOSED_REQUEST)

    def route(path: str, through_prefill: bool = True) -> None:
        async def forward_path(request: Request) -> Response:
            return await forward(request, path, through_prefill)

        app.post(path)(forward_path)

    for path in GENERATING_PATHS:
        route(path)
    route("/v1/messages/count_tokens", through_prefill=False)  # counting a prompt's tokens needs no KV

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        """The first decode instance that answers (they all serve the same model)."""
        if (refused := unauthorized(request)) is not None:
            return refused
        headers = instance_headers(request)
        failure = None
        for url in decode.urls:
            try:
                listed = await clients["health"].get(url + "/v1/models", headers=headers)
            except httpx.HTTPError as exc:
                failure = InstanceFailed("decode", url, exc)
                continue
            return Response(listed.content, listed.status_code, media_type="application/json")
        return error_response(502, str(failure))

    async def status(url: str) -> int | None:
        try:
            return (await clients["health"].get(url + "/health")).status_code
        except httpx.HTTPError:
            return None

    @app.get("/health")
    async def health(request: Request) -> Response:
        """200 when every instance answers 200, asked all at once. To a client with the key (or to everyone where
        the router has none), the status of each instance by URL (null: not reachable); to others only whether
        all are healthy: the URLs map the deployment's inside."""
        urls = [(role.role, url) for role in (prefill, decode) for url in role.urls]
        codes = await asyncio.gather(*(status(url) for _, url in urls))
        healthy = all(code == 200 for code in codes)
        if unauthorized(request) is not None:
            return JSONResponse({"status": "healthy" if healthy else "unhealthy"}, 200 if healthy else 503)
        states: dict[str, dict[str, int | None]] = {"prefill": {}, "decode": {}}
        for (role, url), code in zip(urls, codes, strict=True):
            states[role][url] = code
        return JSONResponse(states, 200 if healthy else 503)

    return app


def router_keys(api_key: str | None, instance_api_key: str | None) -> tuple[str | None, str | None]:
    """The router's key and the instances' key: the flags', else the environment's."""
    return (api_key or os.environ.get(API_KEY_ENV) or None,
            instance_api_key or os.environ.get(INSTANCE_API_KEY_ENV) or None)


def run_router(prefill_urls: list[str], decode_urls: list[str], host: str, port: int, max_body_bytes: int,
               log_level: str, api_key: str | None = None, instance_api_key: str | None = None,
               max_connections: int = DEFAULT_MAX_CONNECTIONS) -> int:
    """`api_key`, `instance_api_key`: the flags', else the environment's (LMSERVE_API_KEY,
    LMSERVE_INSTANCE_API_KEY)."""
    import uvicorn

    api_key, instance_api_key = router_keys(api_key, instance_api_key)
    app = build_router_app(prefill_urls, decode_urls, max_body_bytes, api_key=api_key,
                           instance_api_key=instance_api_key, max_connections=max_connections)
    uvicorn.run(app, host=host, port=port, log_level=log_level.lower())
    return 0
