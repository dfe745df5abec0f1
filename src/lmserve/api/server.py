"""The OpenAI-compatible HTTP server: routes and the app. The rest of the API room is split by idea: middleware.py
(auth, arrival stamp), body.py (bounded, strict bodies), serving.py (the endpoints' logic), choices.py (deltas into
choices), sse.py (responses and SSE framing), errors.py (one place decides what a failure looks like).

It reaches the engine only through the front-end's `EngineClient`; tokenizing, scheduling and tensors live behind it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from lmserve import __version__
from lmserve.api.anthropic import AnthropicErrorRoute, CountTokensRequest, MessagesRequest
from lmserve.api.body import parse_body
from lmserve.api.dashboard import router as dashboard_router
from lmserve.api.embeddings import EmbeddingRequest, create_embedding
from lmserve.api.errors import ErrorMappingRoute, ModelNotFoundError, NotFoundError, exception_to_response
from lmserve.api.fim import InfillRequest
from lmserve.api.middleware import (
    BODY_TIMEOUT_S,
    ApiKeyMiddleware,
    ArrivalStampMiddleware,
    BodyDeadlineMiddleware,
)
from lmserve.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from lmserve.api.responses import ResponsesRequest
from lmserve.api.scoring import RerankRequest, ScoreRequest, create_rerank, create_score
from lmserve.api.served_models import ServedModels, Task
from lmserve.api.serving import OpenAIServing, ToolConfig
from lmserve.api.sse import json_response
from lmserve.config import DEFAULT_MAX_REQUEST_BODY_BYTES
from lmserve.frontend.engine_client import EngineClient
from lmserve.metrics.prometheus import merged_registry
from lmserve.metrics.recorder import StatsRecorder
from lmserve.metrics.request_log import RequestLog

logger = logging.getLogger(__name__)


def _serving(request: Request) -> OpenAIServing:
    """The primary model's serving (the only one, unless --embedding-model or --rerank-model add others)."""
    return request.app.state.serving


def _models(request: Request) -> ServedModels:
    return request.app.state.models


def _route(request: Request, model: str | None, task: Task | None = None) -> OpenAIServing:
    """The serving the request's `model` names (api/served_models.py)."""
    return _models(request).pick(model, task)


def require_engine_ready(request: Request) -> None:
    _models(request).check_any_ready()


v1 = APIRouter(prefix="/v1", route_class=ErrorMappingRoute, dependencies=[Depends(require_engine_ready)])
plain = APIRouter(route_class=ErrorMappingRoute)
# Anthropic's Messages API: the same checks, its errors in Anthropic's shape (api/anthropic.py).
messages_api = APIRouter(prefix="/v1", route_class=AnthropicErrorRoute, dependencies=[Depends(require_engine_ready)])


@v1.post("/completions")
async def completions(raw: Request) -> Response:
    req = await parse_body(raw, CompletionRequest, raw.app.state.max_request_body_bytes)
    return await _route(raw, req.model, "generate").create_completion(req, raw)


@v1.post("/chat/completions")
async def chat_completions(raw: Request) -> Response:
    req = await parse_body(raw, ChatCompletionRequest, raw.app.state.max_request_body_bytes)
    return await _route(raw, req.model, "generate").create_chat_completion(req, raw)


@v1.post("/responses")
async def responses(raw: Request) -> Response:
    req = await parse_body(raw, ResponsesRequest, raw.app.state.max_request_body_bytes)
    return await _route(raw, req.model, "generate").create_response(req, raw)


@v1.get("/responses/{response_id}")
async def get_response(response_id: str) -> Response:
    # Nothing is stored (store: false semantics, api/responses.py): every id is unknown here, as OpenAI answers one.
    raise NotFoundError(f"response {response_id[:100]!r} not found: this server keeps no responses", "response_id")


@messages_api.post("/messages")
async def messages(raw: Request) -> Response:
    req = await parse_body(raw, MessagesRequest, raw.app.state.max_request_body_bytes)
    return await _route(raw, req.model, "generate").create_message(req, raw)


@messages_api.post("/messages/count_tokens")
async def count_message_tokens(raw: Request) -> Response:
    req = await parse_body(raw, CountTokensRequest, raw.app.state.max_request_body_bytes)
    return JSONResponse(await asyncio.to_thread(_route(raw, req.model, "generate").count_message_tokens, req))


@v1.post("/embeddings")
async def embeddings(raw: Request) -> Response:
    req = await parse_body(raw, EmbeddingRequest, raw.app.state.max_request_body_bytes)
    serving = _route(raw, req.model, "embed")
    serving.check_model(req.model)
    return await create_embedding(serving.client, serving.model_name, serving.recorder, req, raw)


@v1.post("/rerank")
async def rerank(raw: Request) -> Response:
    """Jina's and Cohere's rerank shape (vLLM's /v1/rerank, llama.cpp's /rerank): api/scoring.py."""
    req = await parse_body(raw, RerankRequest, raw.app.state.max_request_body_bytes)
    serving = _route(raw, req.model, "score")
    serving.check_model(req.model)
    return await create_rerank(serving.client, serving.model_name, serving.recorder, req, raw)


@plain.post("/rerank")
async def rerank_unversioned(raw: Request) -> Response:
    require_engine_ready(raw)
    return await rerank(raw)


@v1.post("/score")
async def score(raw: Request) -> Response:
    """vLLM's /v1/score: text_1 against text_2 on a cross-encoder."""
    req = await parse_body(raw, ScoreRequest, raw.app.state.max_request_body_bytes)
    serving = _route(raw, req.model, "score")
    serving.check_model(req.model)
    return await create_score(serving.client, serving.model_name, serving.recorder, req, raw)


@plain.post("/infill")
async def infill(raw: Request) -> Response:
    """llama.cpp's fill-in-the-middle endpoint (llama.vscode, llama.vim): api/fim.py."""
    require_engine_ready(raw)
    req = await parse_body(raw, InfillRequest, raw.app.state.max_request_body_bytes)
    return await _route(raw, req.model, "generate").create_infill(req, raw)


@plain.post("/tokenize")
async def tokenize(raw: Request) -> Response:
    require_engine_ready(raw)
    req = await parse_body(raw, TokenizeRequest, raw.app.state.max_request_body_bytes)
    # Messages go through the chat template (Python): on a worker thread, as a chat request's do.
    return json_response(await asyncio.to_thread(_route(raw, req.model).tokenize, req))


@plain.post("/detokenize")
async def detokenize(raw: Request) -> Response:
    require_engine_ready(raw)
    req = await parse_body(raw, DetokenizeRequest, raw.app.state.max_request_body_bytes)
    return json_response(_route(raw, req.model).detokenize(req))


@v1.get("/models")
async def models(raw: Request) -> Response:
    cards = [ModelCard(id=name, max_model_len=serving.client.max_model_len)
             for serving in _models(raw) for name in serving.model_names]
    return json_response(ModelList(data=cards))


@v1.get("/models/{model_id:path}")
async def model(raw: Request, model_id: str) -> Response:
    """OpenAI's retrieve-model (`client.models.retrieve(name)`): one served name's card."""
    serving = _models(raw).by_name.get(model_id)
    if serving is None:
        raise ModelNotFoundError(f"the model {model_id!r} does not exist; this server serves "
                                 f"{', '.join(map(repr, _models(raw).names))}")
    return json_response(ModelCard(id=model_id, max_model_len=serving.client.max_model_len))


@plain.get("/health")
async def health(raw: Request) -> Response:
    _models(raw).check_all_ready()  # with several models: healthy only while every engine is
    return Response(status_code=200)


@plain.api_route("/ping", methods=["GET", "POST"])
async def ping(raw: Request) -> Response:
    """vLLM's (and SageMaker's) liveness route: /health's answer."""
    return await health(raw)


@plain.get("/version")
async def version() -> Response:
    return JSONResponse({"server": "lmserve", "version": __version__})


@plain.get("/metrics")
async def metrics(raw: Request) -> Response:
    """Every model's series, told apart by their model_name label (as vLLM labels them)."""
    for serving in _models(raw):
        try:
            stats = await serving.client.get_stats()
        except Exception as exc:  # noqa: BLE001 - a dead engine must not break the scrape; /health reports it
            logger.debug("get_stats failed during a scrape: %r", exc)
            stats = {}
        # Engine clients that do not count aborts get this server's own count (client disconnects, failures).
        stats.setdefault("num_requests_aborted", serving.num_requests_aborted)
        serving.recorder.prometheus.engine.stats = stats
    return Response(generate_latest(raw.app.state.metrics_registry), media_type=CONTENT_TYPE_LATEST)


@plain.get("/debug/engine")
async def debug_engine(raw: Request) -> Response:
    """Engine counters; `?request_id=ID` (repeatable) adds each request's computed positions and status;
    `?model=NAME` another served model's engine (default: the primary one)."""
    request_ids = raw.query_params.getlist("request_id")
    serving = _route(raw, raw.query_params.get("model"))
    return JSONResponse(await serving.client.get_stats(request_ids))


def _serving_of(client: EngineClient, model_name: str, aliases: Sequence[str], tools: ToolConfig | None,
                request_log: str | RequestLog | None) -> OpenAIServing:
    recorder = StatsRecorder(model_name, request_log)
    client.on_step = recorder.on_step
    return OpenAIServing(client, model_name, recorder, tools, aliases=aliases)


async def _http_exception(request: Request, exc: Exception) -> Response:
    # Unknown paths and wrong methods get the same error shape as everything else.
    return exception_to_response(exc)


def build_app(
    client: EngineClient, api_key: str | None = None, served_model_name: str | Sequence[str] | None = None,
    request_log: str | None = None, max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
    tools: ToolConfig | None = None, allowed_origins: Sequence[str] | None = None,
    body_timeout: float = BODY_TIMEOUT_S, more_models: Sequence[EngineClient] = (),
) -> FastAPI:
    """`more_models`: the engine clients of the other models this server serves (--embedding-model,
    --rerank-model), each by its own model_name; `client` is the primary model."""
    app = FastAPI(title="lmserve", version=__version__)
    app.state.max_request_body_bytes = max_request_body_bytes
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or ())
    model_name = names[0] if names else client.model_name
    servings = [_serving_of(client, model_name, names[1:], tools, request_log)]
    # One request log for all: each line names its model.
    servings += [_serving_of(other, other.model_name, (), tools, servings[0].recorder.request_log)
                 for other in more_models]
    app.state.models = ServedModels(servings)
    app.state.serving = servings[0]
    app.state.recorder = servings[0].recorder
    app.state.metrics_registry = merged_registry([s.recorder.prometheus.registry for s in servings])
    app.include_router(messages_api)
    app.include_router(v1)
    app.include_router(plain)
    app.include_router(dashboard_router)
    app.add_exception_handler(StarletteHTTPException, _http_exception)
    app.add_exception_handler(RequestValidationError, _http_exception)
    app.add_middleware(BodyDeadlineMiddleware, timeout=body_timeout)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    if allowed_origins:
        # Outside the key check: a browser's preflight carries no key. Credentials stay off (a key is a header).
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])
    app.add_middleware(ArrivalStampMiddleware)  # added last: the outermost layer, so it runs first
    return app
