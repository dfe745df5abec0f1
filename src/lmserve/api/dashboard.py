"""The live dashboard: an HTML page with its static files, and the data endpoints it reads.

One Server-Sent Events stream per open page (`/dashboard/api/events`) carries everything that changes (engine
gauges, new engine steps, newly finished requests), so an open page costs one engine stats call per interval
instead of a poll per chart. The request endpoints serve the waterfall of one request on demand.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse

from lmserve.api.errors import ErrorMappingRoute, error_response
from lmserve.frontend.engine_client import EngineClient
from lmserve.metrics.clock import now, wall_time_of
from lmserve.metrics.recorder import StatsRecorder
from lmserve.metrics.stats import RequestTimeline, StepRecord

STATIC_DIR = Path(__file__).with_name("dashboard_static")
# Only plain file names of known kinds: no separators, no dot-files, so nothing outside STATIC_DIR is reachable.
STATIC_NAME = re.compile(r"^[A-Za-z0-9_-]+(?:\.[A-Za-z0-9_-]+)*\.(js|css|html|svg)$")
MEDIA_TYPES = {"js": "text/javascript", "css": "text/css", "html": "text/html", "svg": "image/svg+xml"}

DEFAULT_INTERVAL_S = 1.0
MIN_INTERVAL_S, MAX_INTERVAL_S = 0.2, 10.0
MAX_STEPS_PER_EVENT = 500
MAX_FINISHED_PER_EVENT = 200
FIRST_EVENT_STEPS = 200
FIRST_EVENT_FINISHED = 50
# How often a waiting stream checks that its client is still there, so a closed tab frees its task quickly even
# when the interval is long.
DISCONNECT_CHECK_S = 0.25

router = APIRouter(route_class=ErrorMappingRoute)


# ------------------------------------------------------------------------------------------------ payloads


def step_dict(step: StepRecord) -> dict[str, Any]:
    """A step record for the browser: wall-clock stamps (the page has no access to our monotonic clock)."""
    return {
        "index": step.index,
        "start_unix": round(wall_time_of(step.start), 6),
        "end_unix": round(wall_time_of(step.end), 6),
        "duration_s": round(step.duration_s, 6),
        "forward_s": round(step.forward_s, 6),
        "prefill": dict(step.prefill),
        "decode": dict(step.decode),
        "preempted": list(step.preempted),
        "num_running": step.num_running,
        "num_waiting": step.num_waiting,
        "num_sampled": step.num_sampled,
        "engine": step.engine,
    }


def steps_after(steps: Iterable[StepRecord], last_index: dict[int, int]) -> list[StepRecord]:
    """The steps with an index above their engine's entry in `last_index`, oldest first. Each data-parallel
    replica counts its own steps; the recorder's deque is in arrival order, so once one step is found already sent,
    every older one was sent in the same event or before."""
    newer: list[StepRecord] = []
    for step in reversed(list(steps)):  # a copy: the deque may grow while we build the event
        if step.index <= last_index.get(step.engine, -1):
            break
        newer.append(step)
    newer.reverse()
    return newer


def newest(timelines: Iterable[RequestTimeline], count: int) -> list[RequestTimeline]:
    """The newest `count` recorded timelines, in the order they were recorded."""
    snapshot = list(timelines)
    return snapshot[max(0, len(snapshot) - count):] if count > 0 else []


def _recorder(request: Request) -> StatsRecorder:
    return request.app.state.recorder


def _client(request: Request) -> EngineClient:
    return request.app.state.serving.client


# ------------------------------------------------------------------------------------------------ events


@dataclass
class EventCursor:
    """What one open page has already been sent."""

    last_step_index: dict[int, int] = field(default_factory=dict)  # engine replica -> its last step sent
    num_recorded: int = 0
    last_time: float = field(default_factory=now)  # monotonic, for tokens per second


async def engine_stats(client: EngineClient) -> tuple[dict[str, Any], str | None]:
    try:
        return await client.get_stats(), None
    except Exception as exc:  # noqa: BLE001 - a dead engine must not end the stream: the page shows why
        return {}, str(exc) or type(exc).__name__


async def build_event(
    client: EngineClient, recorder: StatsRecorder, cursor: EventCursor, first: bool, interval: float
) -> dict[str, Any]:
    """One event's payload; advances the cursor past what it contains."""
    engine, engine_error = await engine_stats(client)
    stamp = now()
    steps = steps_after(recorder.recent_steps, cursor.last_step_index)
    num_recorded = recorder.num_recorded
    new_count = FIRST_EVENT_FINISHED if first else min(num_recorded - cursor.num_recorded, MAX_FINISHED_PER_EVENT)
    finished = newest(recorder.recent_requests, new_count)
    # Throughput over this interval's wall time, not over busy time: what a client of the server would observe.
    # Every step reported since the last event counts (a record arrives a moment after its step ends); the first
    # event looks back one interval. Counted before the payload's cap on steps.
    since = stamp - interval if first else cursor.last_time
    sampled = sum(s.num_sampled for s in steps if not first or s.end > since)
    elapsed = max(stamp - since, 1e-6)
    for step in steps:
        cursor.last_step_index[step.engine] = step.index
    steps = steps[-(FIRST_EVENT_STEPS if first else MAX_STEPS_PER_EVENT):]
    cursor.num_recorded = num_recorded
    cursor.last_time = stamp
    return {
        "time": time.time(),
        "engine": engine,
        "engine_error": engine_error,
        "steps": [step_dict(s) for s in steps],
        "finished": [t.to_dict() for t in finished],
        "num_finished": num_recorded,
        "tokens_per_s": round(sampled / elapsed, 3),
        "interval_s": interval,
    }


def closing(request: Request) -> bool:
    """True once the server is shutting down (serve() sets `is_shutting_down`).

    An open page's stream never ends by itself, and uvicorn's graceful shutdown would wait for it and then cancel
    it with an error in the log; ending the stream as soon as shutdown starts avoids both.
    """
    is_shutting_down = getattr(request.app.state, "is_shutting_down", None)
    return bool(is_shutting_down is not None and is_shutting_down())


async def wait_or_end(request: Request, seconds: float) -> bool:
    """Sleeps `seconds`; returns True early if the client has left or the server is shutting down."""
    deadline = now() + seconds
    while (left := deadline - now()) > 0:
        await asyncio.sleep(min(left, DISCONNECT_CHECK_S))
        if closing(request) or await request.is_disconnected():
            return True
    return closing(request) or await request.is_disconnected()


async def event_stream(request: Request, interval: float) -> AsyncIterator[str]:
    """Runs in the response's own task and holds no other: it ends when the client leaves or the server shuts
    down, and when cancelled it stops at an await with nothing left behind."""
    client, recorder = _client(request), _recorder(request)
    cursor = EventCursor()
    first = True
    while not closing(request):
        payload = await build_event(client, recorder, cursor, first, interval)
        first = False
        yield f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
        if await wait_or_end(request, interval):
            return


@router.get("/dashboard/api/events")
async def events(request: Request, interval: float = Query(DEFAULT_INTERVAL_S)) -> Response:
    if not math.isfinite(interval):  # max(nan, 0.2) is nan: an unthrottled stream
        return error_response(400, f"interval must be a finite number of seconds, got {interval}", "interval")
    interval = min(max(interval, MIN_INTERVAL_S), MAX_INTERVAL_S)
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(event_stream(request, interval), media_type="text/event-stream", headers=headers)


# ------------------------------------------------------------------------------------------------ requests


@router.get("/dashboard/api/requests")
async def recent_requests(request: Request, limit: int = Query(50, ge=1, le=1000)) -> Response:
    timelines = newest(_recorder(request).recent_requests, limit)
    return JSONResponse({"data": [t.to_dict() for t in reversed(timelines)]})


def find_timelines(
    recorder: StatsRecorder, client: EngineClient, request_id: str
) -> tuple[list[RequestTimeline], bool]:
    """(timelines, in flight): recorded ones first (their response is done), else the engine client's live ones."""
    found = [t for t in list(recorder.recent_requests) if request_id in (t.request_id, t.parent_id)]
    if found:
        return found, False
    found = list(client.get_timelines(request_id))
    if not found and (parent := re.sub(r"-\d+$", "", request_id)) != request_id:
        # An engine request id of an n>1 choice (`<parent>-<k>`): the client knows it by its parent.
        found = [t for t in client.get_timelines(parent) if t.request_id == request_id]
    return found, True


@router.get("/dashboard/api/requests/{request_id}")
async def one_request(request: Request, request_id: str) -> Response:
    found, in_flight = find_timelines(_recorder(request), _client(request), request_id)
    if not found:
        return error_response(404, f"no recent or in-flight request with id {request_id!r}", "request_id")
    return JSONResponse({"data": [t.to_dict() for t in found], "in_flight": in_flight})


# ------------------------------------------------------------------------------------------------ page


def static_path(name: str) -> Path | None:
    if not STATIC_NAME.match(name):
        return None
    path = (STATIC_DIR / name).resolve()
    if path.parent != STATIC_DIR.resolve() or not path.is_file():
        return None
    return path


@router.get("/", include_in_schema=False)
@router.get("/dashboard", include_in_schema=False)
async def page() -> Response:
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html", headers={"Cache-Control": "no-cache"})


@router.get("/static/dashboard/{name}", include_in_schema=False)
async def static_file(name: str) -> Response:
    path = static_path(name)
    if path is None:
        return error_response(404, f"no dashboard file {name!r}")
    media_type = MEDIA_TYPES[path.suffix.lstrip(".")]
    return FileResponse(path, media_type=media_type, headers={"Cache-Control": "no-cache"})
