"""The OpenAI-compatible HTTP server: routes, SSE framing, errors, auth and Prometheus export.

It reaches the engine only through `EngineClient`; tokenizing, scheduling and tensors live behind that interface.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import jinja2
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from lmserve import __version__
from lmserve.api.body import parse_body
from lmserve.api.dashboard import router as dashboard_router
from lmserve.api.engine_client import EngineClient
from lmserve.api.errors import (
    ClientDisconnected,
    ErrorMappingRoute,
    ModelNotFoundError,
    error_response,
    exception_to_response,
)
from lmserve.api.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessageOut,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    DeltaMessage,
    ModelCard,
    ModelList,
    Prompt,
    RequestError,
    UsageInfo,
    chat_logprobs,
    completion_logprobs,
)
from lmserve.config import DEFAULT_MAX_REQUEST_BODY_BYTES
from lmserve.frontend.errors import EngineDeadError, EngineNotReadyError
from lmserve.metrics.clock import now
from lmserve.metrics.recorder import StatsRecorder
from lmserve.metrics.stats import RequestTimeline
from lmserve.outputs import CompletionOutput, Logprobs, RequestOutput
from lmserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")

# How often a non-streamed request checks whether its client is still there (uvicorn never cancels handlers).
DISCONNECT_POLL_S = 0.2
SSE_DONE = "data: [DONE]\n\n"
# Paths that need the API key when one is set; /health, /metrics and /version stay open for probes and scrapers,
# and the dashboard page and its static files load without it (the page then asks for the key).
PROTECTED_PREFIXES = ("/v1/", "/debug/", "/dashboard/api/")

# ------------------------------------------------------------------------------------------------ auth


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


# ------------------------------------------------------------------------------------------------ engine requests


class RequestGroup:
    """The engine requests behind one HTTP request: started together, read as one stream, aborted together."""

    def __init__(
        self,
        client: EngineClient,
        prompts: Sequence[Prompt],
        params: SamplingParams,
        request_ids: Sequence[str],
        priority: int,
        on_abort: Callable[[], None],
        arrival: float,
        recorder: StatsRecorder,
    ) -> None:
        self.client = client
        self.prompts = list(prompts)
        self.params = params
        self.request_ids = list(request_ids)
        self.priority = priority
        self.on_abort = on_abort
        self.arrival = arrival
        self.recorder = recorder
        self.timelines: list[RequestTimeline] | None = None  # taken from the engine client when the group closes
        self._recorded = False
        self._streams: list[AsyncIterator[RequestOutput]] = []
        self._first: list[RequestOutput | None] = []
        # True once a request needs no abort: it finished, its stream ended, or its stream raised.
        self._finished = [False] * len(self.prompts)
        self._pending: dict[asyncio.Future[RequestOutput | None], int] = {}
        self._closed = False

    async def start(self) -> None:
        """Waits for each request's first output, so bad input fails before the HTTP response has started."""
        self._streams = [
            self.client.generate(prompt, self.params, request_id, self.priority, arrival_time=self.arrival)
            for prompt, request_id in zip(self.prompts, self.request_ids, strict=True)
        ]
        if len(self._streams) == 1:
            self._first = [await self._read(0)]
            return
        try:
            async with asyncio.TaskGroup() as tasks:
                firsts = [tasks.create_task(self._read(i)) for i in range(len(self._streams))]
        except BaseExceptionGroup as group:
            raise group.exceptions[0] from None
        self._first = [task.result() for task in firsts]

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, delta output) in arrival order. Closing it aborts every request that has not finished."""
        try:
            for index, first in enumerate(self._first):
                if first is not None:
                    yield index, first
            # Each stream is read to its end (not just to finished=True), so its generator returns normally.
            live = [i for i, first in enumerate(self._first) if first is not None]
            if len(live) == 1:  # the common case needs no task per token
                while (out := await self._read(live[0])) is not None:
                    yield live[0], out
                return
            # Pull-based merge: at most one read in flight per stream, so with a slow client the deltas pile up
            # (and merge) in the engine client's per-request queues rather than here.
            for index in live:
                self._schedule_read(index)
            while self._pending:
                done, _ = await asyncio.wait(self._pending, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=self._pending.__getitem__):
                    index = self._pending.pop(task)
                    if (out := task.result()) is not None:
                        yield index, out
                        self._schedule_read(index)
        finally:
            await self.close()

    async def _read(self, index: int) -> RequestOutput | None:
        try:
            out = await anext(self._streams[index], None)
        except Exception:
            self._finished[index] = True  # a stream that raised has ended: nothing left to abort
            raise
        self._finished[index] = out is None or out.finished
        return out

    def _schedule_read(self, index: int) -> None:
        self._pending[asyncio.ensure_future(self._read(index))] = index

    async def close(self) -> None:
        """Idempotent: stops every stream and aborts in the engine every request that did not finish."""
        if self._closed:
            return
        self._closed = True
        # Shielded: when the client left, Starlette's cancel scope would otherwise cancel these awaits too.
        with anyio.CancelScope(shield=True):
            for task in self._pending:
                task.cancel()
            if self._pending:
                await asyncio.wait(self._pending)
            for task in self._pending:  # read them, or asyncio logs "exception was never retrieved"
                if not task.cancelled() and task.exception() is not None:
                    logger.debug("engine stream failed while closing: %r", task.exception())
            for stream in self._streams:
                await self._close_stream(stream)
            for request_id, finished in zip(self.request_ids, self._finished, strict=True):
                if not finished and self._streams:
                    await self._abort(request_id)
            self.timelines = [t for rid in self.request_ids for t in self.client.pop_timelines(rid)]

    def timeline_dicts(self) -> list[dict[str, Any]]:
        """The timelines so far (for return_timeline): what the response carries cannot include its last byte."""
        if self.timelines is not None:
            return [t.to_dict() for t in self.timelines]
        return [t.to_dict() for rid in self.request_ids for t in self.client.get_timelines(rid)]

    def record(self, delivered: bool) -> None:
        """Once, after close(): stamps the last byte (when the response was written) and records the timelines."""
        if self._recorded or self.timelines is None:
            return
        self._recorded = True
        stamp = now()
        for timeline in self.timelines:
            if delivered and timeline.finish_reason != "abort":
                timeline.last_byte = stamp
        self.recorder.record(self.timelines)

    async def _close_stream(self, stream: AsyncIterator[RequestOutput]) -> None:
        aclose = getattr(stream, "aclose", None)
        if aclose is None:
            return
        try:
            await aclose()
        except Exception:
            logger.exception("closing the output stream of an engine request failed")

    async def _abort(self, request_id: str) -> None:
        self.on_abort()
        try:
            await self.client.abort(request_id)
        except Exception as exc:  # noqa: BLE001 - the engine may be dead; the request is gone either way
            logger.debug("abort of %s failed: %r", request_id, exc)


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


# ------------------------------------------------------------------------------------------------ choices


@dataclass
class ChoiceState:
    """One choice as it accumulates across delta outputs."""

    texts: list[str] = field(default_factory=list)
    logprobs: list[Logprobs] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prefix_len: int = 0  # characters of echoed prompt before the generated text
    num_chars: int = 0  # where the next token starts in the choice's text, for completions' text_offset

    @property
    def text(self) -> str:
        return "".join(self.texts)


class Choices:
    """Folds delta outputs of every engine request into choices, indexed prompt_index * n + child index."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.states: dict[int, ChoiceState] = {}
        self.prompt_tokens: dict[int, int] = {}

    def update(
        self, prompt_index: int, out: RequestOutput
    ) -> Iterator[tuple[int, ChoiceState, str, CompletionOutput]]:
        """Yields (choice index, state before this delta, new text, delta), then folds the delta in."""
        self.prompt_tokens[prompt_index] = len(out.prompt_token_ids)
        for child in out.outputs:
            index = prompt_index * self.n + child.index
            state = self.states.get(index)
            text = child.text
            if state is None:
                prefix = self.first_text(prompt_index, out)
                state = self.states[index] = ChoiceState(prefix_len=len(prefix), num_chars=len(prefix))
                text = prefix + text
            yield index, state, text, child
            state.texts.append(text)
            state.num_tokens += len(child.token_ids)
            state.logprobs.extend(child.logprobs or ())
            state.finish_reason = child.finish_reason or state.finish_reason
            state.stop_reason = child.stop_reason if child.finish_reason else state.stop_reason

    def add(self, prompt_index: int, out: RequestOutput) -> None:
        for _ in self.update(prompt_index, out):
            pass

    def first_text(self, prompt_index: int, out: RequestOutput) -> str:
        """What precedes a choice's generated text (the echoed prompt for completions)."""
        return ""

    def usage(self) -> UsageInfo:
        prompt = sum(self.prompt_tokens.values())
        completion = sum(s.num_tokens for s in self.states.values())
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    def sorted_states(self) -> list[tuple[int, ChoiceState]]:
        return sorted(self.states.items())


def _worth_sending(text: str, child: CompletionOutput) -> bool:
    # A delta whose text is still held back (a possible stop string) carries nothing new unless it ends the
    # choice or brings logprobs the client asked for.
    return bool(text or child.finish_reason or child.logprobs)


class CompletionChoices(Choices):
    def __init__(
        self, n: int, prompts: Sequence[Prompt], echo: bool, num_logprobs: int | None,
        decode_token: Callable[[int], str],
    ) -> None:
        super().__init__(n)
        self.prompts = prompts
        self.echo = echo
        self.num_logprobs = num_logprobs
        self.decode_token = decode_token

    def first_text(self, prompt_index: int, out: RequestOutput) -> str:
        if not self.echo:
            return ""
        prompt = self.prompts[prompt_index]
        if isinstance(prompt, str):
            return prompt
        # Token-id prompts: the engine client's prompt text when it kept one, else the tokens' own texts.
        return out.prompt if out.prompt is not None else "".join(self.decode_token(t) for t in prompt)

    def _logprobs(self, entries: Sequence[Logprobs], text_offset: int) -> CompletionLogprobs | None:
        if self.num_logprobs is None:
            return None
        return completion_logprobs(entries, self.decode_token, self.num_logprobs, text_offset)

    def stream_choices(self, prompt_index: int, out: RequestOutput) -> list[CompletionChoice]:
        choices = []
        for index, state, text, child in self.update(prompt_index, out):
            logprobs = self._logprobs(child.logprobs or [], state.num_chars)
            if logprobs is not None:
                state.num_chars += sum(map(len, logprobs.tokens))
            if _worth_sending(text, child):
                choices.append(CompletionChoice(
                    index=index, text=text, logprobs=logprobs,
                    finish_reason=child.finish_reason, stop_reason=child.stop_reason,
                ))
        return choices

    def final_choices(self) -> list[CompletionChoice]:
        choices = []
        for index, state in self.sorted_states():
            choices.append(CompletionChoice(
                index=index, text=state.text, logprobs=self._logprobs(state.logprobs, state.prefix_len),
                finish_reason=state.finish_reason, stop_reason=state.stop_reason,
            ))
        return choices


class ChatChoices(Choices):
    def __init__(self, n: int, num_top_logprobs: int | None, decode_token: Callable[[int], str]) -> None:
        super().__init__(n)
        self.num_top_logprobs = num_top_logprobs
        self.decode_token = decode_token

    def _logprobs(self, entries: Sequence[Logprobs]) -> ChatChoiceLogprobs | None:
        if self.num_top_logprobs is None:
            return None
        return chat_logprobs(entries, self.decode_token, self.num_top_logprobs)

    def stream_choices(self, out: RequestOutput) -> list[ChatCompletionStreamChoice]:
        return [
            ChatCompletionStreamChoice(
                index=index, delta=DeltaMessage(content=text), logprobs=self._logprobs(child.logprobs or []),
                finish_reason=child.finish_reason, stop_reason=child.stop_reason,
            )
            for index, _, text, child in self.update(0, out)
            if _worth_sending(text, child)
        ]

    def final_choices(self) -> list[ChatCompletionChoice]:
        return [
            ChatCompletionChoice(
                index=index, message=ChatMessageOut(content=state.text), logprobs=self._logprobs(state.logprobs),
                finish_reason=state.finish_reason, stop_reason=state.stop_reason,
            )
            for index, state in self.sorted_states()
        ]


# ------------------------------------------------------------------------------------------------ SSE


def dump_json(payload: BaseModel) -> str:
    # `timelines` only appears when the client asked for it; other None fields are OpenAI's and stay.
    return payload.model_dump_json(exclude={"timelines"} if getattr(payload, "timelines", None) is None else None)


def sse(payload: BaseModel) -> str:
    return f"data: {dump_json(payload)}\n\n"


def sse_error(exc: Exception) -> str:
    response = exception_to_response(exc)
    return f"data: {response.body.decode()}\n\n"


class EventStreamResponse(StreamingResponse):
    """An SSE response that closes its event generator and its engine requests when it ends, however it ends,
    then records their timelines.

    When the client leaves while a chunk (or the headers) is being sent, the cancellation never reaches the
    generator's own awaits, and a generator that never started has no cleanup to run: without this, the engine
    would keep generating for nobody.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], group: RequestGroup) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.events = events
        self.group = group

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
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


def _trailer(
    choices: Choices, group: RequestGroup, include_usage: bool, return_timeline: bool
) -> tuple[UsageInfo | None, list[dict[str, Any]] | None] | None:
    """(usage, timelines) for the last chunk before [DONE], or None when the client asked for neither."""
    if not (include_usage or return_timeline):
        return None
    return choices.usage() if include_usage else None, group.timeline_dicts() if return_timeline else None


# ------------------------------------------------------------------------------------------------ serving


class OpenAIServing:
    """The logic behind /v1/completions and /v1/chat/completions."""

    def __init__(self, client: EngineClient, model_name: str, recorder: StatsRecorder) -> None:
        self.client = client
        self.model_name = model_name
        self.recorder = recorder
        self.num_requests_aborted = 0  # by this server (client disconnects, failures); for /metrics

    def check_model(self, requested: str | None) -> None:
        # A missing model means the served one, as in vLLM; a wrong one must not silently run another model.
        if requested is not None and requested != self.model_name:
            raise ModelNotFoundError(f"the model {requested!r} does not exist; this server serves {self.model_name!r}")

    def _count_abort(self) -> None:
        self.num_requests_aborted += 1

    def _group(
        self, prompts: Sequence[Prompt], params: SamplingParams, request_ids: Sequence[str], priority: int,
        raw: Request,
    ) -> RequestGroup:
        return RequestGroup(self.client, prompts, params, request_ids, priority, self._count_abort,
                            arrival_time(raw), self.recorder)

    async def _start(self, group: RequestGroup) -> None:
        try:
            await group.start()
        except RequestError:
            raise
        except ValueError as exc:  # the engine client's input validation (PromptTooLongError included)
            raise RequestError.from_value_error(exc) from exc

    async def _start_streaming(self, group: RequestGroup, raw: Request) -> None:
        try:
            await until_disconnect(self._start(group), raw)
        except BaseException:
            await group.close()
            group.record(delivered=False)
            raise

    async def _collect(self, group: RequestGroup) -> list[tuple[int, RequestOutput]]:
        try:
            await self._start(group)
            return [item async for item in group.outputs()]
        finally:
            await group.close()

    async def _respond(
        self, group: RequestGroup, choices: Choices, raw: Request, response_type: type[BaseModel], response_id: str,
        return_timeline: bool,
    ) -> Response:
        """The non-streamed answer: every output collected (aborted if the client leaves), then one JSON body."""
        try:
            collected = await until_disconnect(self._collect(group), raw)
        except BaseException:
            group.record(delivered=False)
            raise
        for prompt_index, out in collected:
            choices.add(prompt_index, out)
        response = response_type(
            id=response_id, model=self.model_name, choices=choices.final_choices(), usage=choices.usage(),
            timelines=group.timeline_dicts() if return_timeline else None,
        )
        return RecordedJSONResponse(response, group)

    # -------------------------------------------------------------------------------------------- completions

    async def create_completion(self, req: CompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        prompts = req.prompts()
        params = req.to_sampling_params()
        response_id = f"cmpl-{uuid.uuid4().hex}"
        request_ids = [f"{response_id}-{i}" for i in range(len(prompts))]
        group = self._group(prompts, params, request_ids, req.check_priority(), raw)
        choices = CompletionChoices(req.num_choices, prompts, bool(req.echo), req.logprobs, self.client.decode_token)
        if req.stream:
            await self._start_streaming(group, raw)
            events = self._completion_events(group, choices, response_id, req.include_usage, bool(req.return_timeline))
            return EventStreamResponse(events, group)
        return await self._respond(group, choices, raw, CompletionResponse, response_id, bool(req.return_timeline))

    async def _completion_events(
        self, group: RequestGroup, choices: CompletionChoices, response_id: str, include_usage: bool,
        return_timeline: bool,
    ) -> AsyncIterator[str]:
        def chunk(items: list[CompletionChoice], usage: UsageInfo | None = None, timelines: list | None = None) -> str:
            return sse(CompletionStreamResponse(
                id=response_id, model=self.model_name, choices=items, usage=usage, timelines=timelines
            ))

        try:
            async for prompt_index, out in group.outputs():
                for choice in choices.stream_choices(prompt_index, out):
                    yield chunk([choice])  # one choice per chunk, as OpenAI (and clients reading choices[0])
            if trailer := _trailer(choices, group, include_usage, return_timeline):
                yield chunk([], *trailer)
        except Exception as exc:  # noqa: BLE001 - headers are sent: report in-band (sse_error logs the unexpected)
            yield sse_error(exc)
        finally:
            await group.close()
        yield SSE_DONE

    # -------------------------------------------------------------------------------------------- chat

    async def create_chat_completion(self, req: ChatCompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        params = req.to_sampling_params()
        prompt_token_ids = self._chat_prompt(req)
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        group = self._group([prompt_token_ids], params, [response_id], req.check_priority(), raw)
        num_top = (req.top_logprobs or 0) if req.logprobs else None
        choices = ChatChoices(req.num_choices, num_top, self.client.decode_token)
        if req.stream:
            await self._start_streaming(group, raw)
            events = self._chat_events(group, choices, response_id, req.include_usage, bool(req.return_timeline))
            return EventStreamResponse(events, group)
        return await self._respond(group, choices, raw, ChatCompletionResponse, response_id, bool(req.return_timeline))

    def _chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        messages = req.template_messages()
        kwargs = req.template_kwargs()
        try:
            text = self.client.apply_chat_template(
                messages, add_generation_prompt=req.add_generation_prompt is not False, **kwargs
            )
            # The template already holds the special tokens (BOS and turn markers).
            return self.client.prompt_token_ids(text, add_special_tokens=False)
        except (ValueError, TypeError, KeyError, jinja2.TemplateError) as exc:
            raise RequestError(f"cannot apply the chat template to these messages: {exc}", "messages") from exc

    async def _chat_events(
        self, group: RequestGroup, choices: ChatChoices, response_id: str, include_usage: bool,
        return_timeline: bool,
    ) -> AsyncIterator[str]:
        def chunk(
            items: list[ChatCompletionStreamChoice], usage: UsageInfo | None = None, timelines: list | None = None
        ) -> str:
            return sse(ChatCompletionStreamResponse(
                id=response_id, model=self.model_name, choices=items, usage=usage, timelines=timelines
            ))

        try:
            for index in range(choices.n):
                yield chunk([ChatCompletionStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])
            async for _, out in group.outputs():
                for choice in choices.stream_choices(out):
                    yield chunk([choice])
            if trailer := _trailer(choices, group, include_usage, return_timeline):
                yield chunk([], *trailer)
        except Exception as exc:  # noqa: BLE001 - headers are sent: report in-band (sse_error logs the unexpected)
            yield sse_error(exc)
        finally:
            await group.close()
        yield SSE_DONE


# ------------------------------------------------------------------------------------------------ app


def _serving(request: Request) -> OpenAIServing:
    return request.app.state.serving


def require_engine_ready(request: Request) -> None:
    client = _serving(request).client
    if client.errored:
        raise EngineDeadError("the engine process has died; restart the server")
    if not client.is_ready:
        raise EngineNotReadyError("the engine is still starting; retry shortly")


v1 = APIRouter(prefix="/v1", route_class=ErrorMappingRoute, dependencies=[Depends(require_engine_ready)])
plain = APIRouter(route_class=ErrorMappingRoute)


@v1.post("/completions")
async def completions(raw: Request) -> Response:
    req = await parse_body(raw, CompletionRequest, raw.app.state.max_request_body_bytes)
    return await _serving(raw).create_completion(req, raw)


@v1.post("/chat/completions")
async def chat_completions(raw: Request) -> Response:
    req = await parse_body(raw, ChatCompletionRequest, raw.app.state.max_request_body_bytes)
    return await _serving(raw).create_chat_completion(req, raw)


@v1.get("/models")
async def models(raw: Request) -> Response:
    serving = _serving(raw)
    card = ModelCard(id=serving.model_name, max_model_len=serving.client.max_model_len)
    return json_response(ModelList(data=[card]))


@plain.get("/health")
async def health(raw: Request) -> Response:
    require_engine_ready(raw)
    return Response(status_code=200)


@plain.get("/version")
async def version() -> Response:
    return JSONResponse({"server": "lmserve", "version": __version__})


@plain.get("/metrics")
async def metrics(raw: Request) -> Response:
    serving = _serving(raw)
    prometheus = serving.recorder.prometheus
    try:
        stats = await serving.client.get_stats()
    except Exception as exc:  # noqa: BLE001 - a dead engine must not break the scrape; /health reports it
        logger.debug("get_stats failed during a scrape: %r", exc)
        stats = {}
    # Engine clients that do not count aborts get this server's own count (client disconnects, failures).
    stats.setdefault("num_requests_aborted", serving.num_requests_aborted)
    prometheus.engine.stats = stats
    return Response(generate_latest(prometheus.registry), media_type=CONTENT_TYPE_LATEST)


@plain.get("/debug/engine")
async def debug_engine(raw: Request) -> Response:
    """Engine counters; `?request_id=ID` (repeatable) adds each request's computed positions and status."""
    request_ids = raw.query_params.getlist("request_id")
    return JSONResponse(await _serving(raw).client.get_stats(request_ids))


async def _http_exception(request: Request, exc: Exception) -> Response:
    # Unknown paths and wrong methods get the same error shape as everything else.
    return exception_to_response(exc)


def build_app(
    client: EngineClient, api_key: str | None = None, served_model_name: str | None = None,
    request_log: str | None = None, max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
) -> FastAPI:
    app = FastAPI(title="lmserve", version=__version__)
    app.state.max_request_body_bytes = max_request_body_bytes
    model_name = served_model_name or client.model_name
    recorder = StatsRecorder(model_name, request_log)
    client.on_step = recorder.on_step
    serving = OpenAIServing(client, model_name, recorder)
    app.state.serving = serving
    app.state.recorder = recorder
    app.include_router(v1)
    app.include_router(plain)
    app.include_router(dashboard_router)
    app.add_exception_handler(StarletteHTTPException, _http_exception)
    app.add_exception_handler(RequestValidationError, _http_exception)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(ArrivalStampMiddleware)  # added last: the outermost layer, so it runs first
    return app
