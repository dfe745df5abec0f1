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
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from lmserve.api.body import BodyTooLargeError, read_body
from lmserve.api.errors import ClientDisconnected, error_response
from lmserve.api.sse import ClosingEventStream, until_disconnect

FORWARDED_HEADERS = ("authorization",)
CLIENT_CLOSED_REQUEST = 499  # nginx's: nobody reads it


def prefill_request(payload: dict, path: str = "/v1/completions") -> dict:
    """The request as the prefill instance gets it: one token, not streamed, one choice, the prompt unchanged."""
    prefill = {k: v for k, v in payload.items() if k not in ("stream_options", "min_tokens")}
    prefill["stream"] = False
    if path == "/v1/responses":  # no n; its length field is max_output_tokens
        prefill["max_output_tokens"] = 1
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


def build_router_app(prefill_urls: list[str], decode_urls: list[str], max_body_bytes: int,
                     timeout_s: float = 600.0) -> FastAPI:
    prefill, decode = Instances("prefill", prefill_urls), Instances("decode", decode_urls)
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = FastAPI(title="lmserve router", lifespan=lifespan)
    app.state.instances = {"prefill": prefill, "decode": decode}

    async def post(role: Instances, path: str, payload: dict, headers: dict[str, str]) -> httpx.Response:
        index = role.acquire()
        try:
            return await client.post(role.urls[index] + path, json=payload, headers=headers)
        except httpx.HTTPError as exc:
            raise InstanceFailed(role.role, role.urls[index], exc) from exc
        finally:
            role.release(index)

    async def open_stream(path: str, payload: dict, headers: dict[str, str]) -> Response:
        index = decode.acquire()
        url = decode.urls[index]
        try:
            upstream = await client.send(client.build_request("POST", url + path, json=payload, headers=headers),
                                         stream=True)
        except BaseException as exc:  # a failure, or the client gone while the instance had not answered yet
            decode.release(index)
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

    async def answer(path: str, payload: dict, headers: dict[str, str]) -> Response:
        prefilled = await post(prefill, path, prefill_request(payload, path), headers)
        if prefilled.status_code != 200:
            return Response(prefilled.content, prefilled.status_code, media_type="application/json")
        if payload.get("stream"):
            return await open_stream(path, payload, headers)
        decoded = await post(decode, path, payload, headers)
        return Response(decoded.content, decoded.status_code, media_type="application/json")

    async def forward(request: Request, path: str) -> Response:
        try:
            payload = json.loads(await read_body(request, max_body_bytes))
        except BodyTooLargeError as exc:
            return error_response(413, str(exc))
        except ValueError as exc:
            return error_response(400, f"the request body is not valid JSON: {exc}")
        if not isinstance(payload, dict):
            return error_response(400, "the request body must be a JSON object")
        headers = {h: request.headers[h] for h in FORWARDED_HEADERS if h in request.headers}
        try:
            return await until_disconnect(answer(path, payload, headers), request)
        except InstanceFailed as exc:
            return error_response(502, str(exc))
        except ClientDisconnected:  # the call in flight was cancelled: its instance aborts the request
            return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await forward(request, "/v1/chat/completions")

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await forward(request, "/v1/responses")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        """The first decode instance that answers (they all serve the same model)."""
        headers = {h: request.headers[h] for h in FORWARDED_HEADERS if h in request.headers}
        failure = None
        for url in decode.urls:
            try:
                listed = await client.get(url + "/v1/models", headers=headers)
            except httpx.HTTPError as exc:
                failure = InstanceFailed("decode", url, exc)
                continue
            return Response(listed.content, listed.status_code, media_type="application/json")
        return error_response(502, str(failure))

    async def status(url: str) -> int | None:
        try:
            return (await client.get(url + "/health", timeout=5.0)).status_code
        except httpx.HTTPError:
            return None

    @app.get("/health")
    async def health() -> Response:
        """200 when every instance answers 200; the status of each (null: not reachable), asked all at once."""
        urls = [(role.role, url) for role in (prefill, decode) for url in role.urls]
        codes = await asyncio.gather(*(status(url) for _, url in urls))
        states: dict[str, dict[str, int | None]] = {"prefill": {}, "decode": {}}
        for (role, url), code in zip(urls, codes, strict=True):
            states[role][url] = code
        healthy = all(code == 200 for code in codes)
        return JSONResponse(states, 200 if healthy else 503)

    return app


def run_router(prefill_urls: list[str], decode_urls: list[str], host: str, port: int, max_body_bytes: int,
               log_level: str) -> int:
    import uvicorn

    uvicorn.run(build_router_app(prefill_urls, decode_urls, max_body_bytes), host=host, port=port,
                log_level=log_level.lower())
    return 0
