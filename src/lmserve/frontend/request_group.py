"""The one owner of a request group's life: the engine requests behind one API request, from start to record.

A group is an async context manager. Entering it starts its engine requests (n>1 and multi-prompt fan-out) and waits
for each one's first output, so that bad input fails before a response has started; `outputs()` (streamed) or
`collect()` (whole) read them as one stream. Whoever answers the client leaves the context when the answer is done
(its last byte written, or the client gone); leaving aborts in the engine every request that has not finished and
records the requests' timelines, exactly once. While the group starts or collects, a client that goes away
(`client_gone`) aborts it at once, with ClientDisconnected.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from types import TracebackType
from typing import Any, Self, TypeVar

import anyio

from lmserve.frontend.engine_client import EngineClient
from lmserve.frontend.errors import ClientDisconnected
from lmserve.frontend.input_processor import Prompt
from lmserve.metrics.clock import now
from lmserve.metrics.recorder import StatsRecorder
from lmserve.metrics.stats import RequestTimeline
from lmserve.outputs import RequestOutput
from lmserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")

# How often a waiting group checks whether its client is still there (uvicorn never cancels handlers).
DISCONNECT_POLL_S = 0.2


async def _client_stays() -> bool:
    return False


async def until_client_gone(work: Awaitable[T], client_gone: Callable[[], Awaitable[bool]]) -> T:
    """Runs `work` as a task and cancels it (raising ClientDisconnected) when `client_gone()` says the client left."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await client_gone():
                raise ClientDisconnected()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.wait({task})  # its own cleanup aborts the engine requests
            if not task.cancelled() and task.exception() is not None:
                logger.debug("request task failed while being cancelled: %r", task.exception())


class RequestGroup:
    """The engine requests behind one HTTP request: started together, read as one stream, aborted together, recorded
    once. `async with group:` is its whole life (see the module's docstring)."""

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
        final_only: bool = False,
        cache_salt: str | None = None,
        client_gone: Callable[[], Awaitable[bool]] = _client_stays,
    ) -> None:
        """`final_only`: each engine request yields its whole output once, when it ends (non-streamed responses).
        `cache_salt`: the tenant's salt for prefix-cache blocks (vLLM's request field). `client_gone`: whether the
        client has gone away, asked while the group starts or collects."""
        self.client_gone = client_gone
        self.final_only = final_only
        self.cache_salt = cache_salt
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

    async def __aenter__(self) -> Self:
        """Starts the engine requests and waits for each one's first output (so that bad input fails before the
        response has started), aborting them if the client goes away first. A start that fails ends the group's
        life here: its requests are aborted and recorded."""
        try:
            await until_client_gone(self._start(), self.client_gone)
        except BaseException:
            await self._close()
            self._record(delivered=False)
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """The answer is done (its last byte written, or it failed): aborts what has not finished, records once."""
        await self._close()
        self._record(delivered=exc_type is None)

    async def _start(self) -> None:
        self._streams = [
            self.client.generate(prompt, self.params, request_id, self.priority, arrival_time=self.arrival,
                                 final_only=self.final_only, cache_salt=self.cache_salt)
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
            await self._close()

    async def collect(self) -> list[tuple[int, RequestOutput]]:
        """Every output (a whole response), aborted with ClientDisconnected if the client goes away first."""

        async def read_all() -> list[tuple[int, RequestOutput]]:
            return [item async for item in self.outputs()]

        return await until_client_gone(read_all(), self.client_gone)

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

    async def _close(self) -> None:
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

    def _record(self, delivered: bool) -> None:
        """Once, after _close(): stamps the last byte (when the response was written) and records the timelines."""
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
