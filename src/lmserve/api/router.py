"""`lmserve router`: one OpenAI endpoint in front of a prefill instance and a decode instance (vLLM's disaggregated
prefill proxy). Each completion or chat request goes first to the prefill instance with max_tokens 1 (it computes
the prompt, and its --kv-transfer-config kv_producer stores the prompt's KV blocks), then, as the client sent it, to
the decode instance (kv_consumer), which loads those blocks instead of computing them and streams the answer back.

The two instances must serve the same model with the same settings; the router only forwards. Errors from either
instance reach the client as they were sent; one that cannot be reached is a 502. A client that goes away closes the
decode instance's stream, which aborts the request there.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from lmserve.api.body import BodyTooLargeError, read_body
from lmserve.api.errors import error_response

FORWARDED_HEADERS = ("authorization",)


def prefill_request(payload: dict) -> dict:
    """The request as the prefill instance gets it: one token, not streamed, one choice, the prompt unchanged."""
    prefill = {k: v for k, v in payload.items() if k not in ("stream_options", "min_tokens")}
    prefill.update(stream=False, n=1)
    if "max_completion_tokens" in prefill:
        prefill["max_completion_tokens"] = 1
        prefill.pop("max_tokens", None)
    else:
        prefill["max_tokens"] = 1
    return prefill


def build_router_app(prefill_url: str, decode_url: str, max_body_bytes: int, timeout_s: float = 600.0) -> FastAPI:
    prefill_url, decode_url = prefill_url.rstrip("/"), decode_url.rstrip("/")
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = FastAPI(title="lmserve router", lifespan=lifespan)

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
            prefilled = await client.post(prefill_url + path, json=prefill_request(payload), headers=headers)
            if prefilled.status_code != 200:
                return Response(prefilled.content, prefilled.status_code, media_type="application/json")
            if not payload.get("stream"):
                decoded = await client.post(decode_url + path, json=payload, headers=headers)
                return Response(decoded.content, decoded.status_code, media_type="application/json")
            upstream = await client.send(client.build_request("POST", decode_url + path, json=payload,
                                                              headers=headers), stream=True)
        except httpx.HTTPError as exc:
            return error_response(502, f"an instance behind the router failed: {type(exc).__name__}: {exc}")
        if upstream.status_code != 200:
            body = await upstream.aread()
            await upstream.aclose()
            return Response(body, upstream.status_code, media_type="application/json")

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()

        return StreamingResponse(relay(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await forward(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        headers = {h: request.headers[h] for h in FORWARDED_HEADERS if h in request.headers}
        try:
            answer = await client.get(decode_url + "/v1/models", headers=headers)
        except httpx.HTTPError as exc:
            return error_response(502, f"the decode instance failed: {type(exc).__name__}: {exc}")
        return Response(answer.content, answer.status_code, media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        states = {}
        for role, url in (("prefill", prefill_url), ("decode", decode_url)):
            try:
                states[role] = (await client.get(url + "/health", timeout=5.0)).status_code
            except httpx.HTTPError:
                states[role] = None
        healthy = all(code == 200 for code in states.values())
        return JSONResponse({"prefill": states["prefill"], "decode": states["decode"]}, 200 if healthy else 503)

    return app


def run_router(prefill_url: str, decode_url: str, host: str, port: int, max_body_bytes: int, log_level: str) -> int:
    import uvicorn

    uvicorn.run(build_router_app(prefill_url, decode_url, max_body_bytes), host=host, port=port,
                log_level=log_level.lower())
    return 0
