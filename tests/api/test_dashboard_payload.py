"""The dashboard's data endpoints over real HTTP against the fake engine: payload shapes, cursors, auth, static
files, and that an event stream ends when its client leaves or the server shuts down."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from test_api_fake_engine import FakeEngine, ServerThread

from lmserve.api.server import build_app
from lmserve.metrics.clock import now
from lmserve.metrics.recorder import StatsRecorder
from lmserve.metrics.stats import StepRecord

EVENT_KEYS = {"time": float, "engine": dict, "steps": list, "finished": list, "num_finished": int,
              "tokens_per_s": float}
STEP_KEYS = {"index": int, "start_unix": float, "end_unix": float, "duration_s": float, "forward_s": float,
             "prefill": dict, "decode": dict, "preempted": list, "num_running": int, "num_waiting": int,
             "num_sampled": int}
TIMELINE_KEYS = {"request_id", "parent_id", "arrival_unix", "stamps", "steps", "preemptions", "num_preemptions",
                 "num_prompt_tokens", "num_output_tokens", "num_cached_tokens", "finish_reason", "intervals"}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with ServerThread(build_app(FakeEngine())) as running:
        yield running


@pytest.fixture(scope="module")
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=10) as client:
        yield client


def recorder_of(server: ServerThread) -> StatsRecorder:
    return server.server.config.app.state.recorder


def add_step(recorder: StatsRecorder, request_id: str, prefill: int = 0, decode: int = 0) -> StepRecord:
    index = recorder.recent_steps[-1].index + 1 if recorder.recent_steps else 1
    end = now()
    step = StepRecord(index, end - 0.01, end, 0.008, {request_id: prefill} if prefill else {},
                      {request_id: decode} if decode else {}, [], 1, 0, num_sampled=1)
    recorder.on_step(step)  # from this thread: deque appends are atomic, and the server only copies the deque
    return step


def complete(http: httpx.Client, prompt: str) -> str:
    response = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4})
    assert response.status_code == 200
    return response.json()["id"] + "-0"


def wait_recorded(recorder: StatsRecorder, request_id: str) -> None:
    # Recorded once the response's last byte is written, a moment after the client has it.
    deadline = time.monotonic() + 5
    while request_id not in {t.request_id for t in recorder.recent_requests}:
        assert time.monotonic() < deadline, f"{request_id} was never recorded"
        time.sleep(0.01)


class EventReader:
    """Reads `data:` events from an open SSE response, one at a time.

    Keep it while the response should stay open: httpx closes the response when its line iterator is collected.
    """

    def __init__(self, response: httpx.Response) -> None:
        self.lines = response.iter_lines()

    def next(self) -> dict[str, Any]:
        for line in self.lines:
            if line.startswith("data: "):
                return json.loads(line.removeprefix("data: "))
        raise AssertionError("the event stream ended")


def check_types(payload: dict[str, Any], expected: dict[str, type]) -> None:
    for key, kind in expected.items():
        assert key in payload, key
        value = payload[key]
        ok = isinstance(value, (int, float)) if kind is float else isinstance(value, kind)
        assert ok and not isinstance(value, bool), f"{key}: {value!r} is not {kind.__name__}"


def test_first_event_has_every_key_and_the_recent_history(server: ServerThread, http: httpx.Client) -> None:
    recorder = recorder_of(server)
    request_id = complete(http, "first event history")
    wait_recorded(recorder, request_id)
    steps = [add_step(recorder, request_id, prefill=3), add_step(recorder, request_id, decode=1)]
    with http.stream("GET", "/dashboard/api/events", params={"interval": 0.2}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        event = EventReader(response).next()
    check_types(event, EVENT_KEYS)
    assert event["engine"]["num_requests_running"] == 2  # the fake's stats
    assert event["num_finished"] == recorder.num_recorded
    assert abs(event["time"] - time.time()) < 5
    by_index = {s["index"]: s for s in event["steps"]}
    for step in steps:
        sent = by_index[step.index]
        check_types(sent, STEP_KEYS)
        assert sent["prefill"] == step.prefill and sent["decode"] == step.decode
        assert sent["end_unix"] - sent["start_unix"] == pytest.approx(sent["duration_s"], abs=1e-3)
        assert abs(sent["end_unix"] - time.time()) < 5
    finished = {t["request_id"]: t for t in event["finished"]}
    assert set(finished[request_id]) >= TIMELINE_KEYS
    assert finished[request_id]["finish_reason"] == "stop"
    assert finished[request_id]["stamps"]["last_byte"] is not None


def test_later_events_carry_only_what_is_new(server: ServerThread, http: httpx.Client) -> None:
    recorder = recorder_of(server)
    add_step(recorder, "old", decode=1)
    with http.stream("GET", "/dashboard/api/events", params={"interval": 0.2}) as response:
        events = EventReader(response)
        first = events.next()
        assert first["steps"], "the first event carries the recent steps"
        request_id = complete(http, "only new ones")
        wait_recorded(recorder, request_id)
        step = add_step(recorder, request_id, decode=1)
        later: list[dict[str, Any]] = []
        while not any(s["index"] == step.index for e in later for s in e["steps"]):
            later.append(events.next())
    assert all(s["index"] > first["steps"][-1]["index"] for e in later for s in e["steps"])
    assert [t["request_id"] for e in later for t in e["finished"]] == [request_id]
    assert later[-1]["num_finished"] == first["num_finished"] + 1
    # One sampled token over at most one interval and a bit: tokens/s is per wall-clock second, not per step.
    assert sum(e["tokens_per_s"] for e in later) > 0


def test_interval_is_clamped_and_validated(http: httpx.Client) -> None:
    with http.stream("GET", "/dashboard/api/events", params={"interval": 0.001}) as response:
        assert EventReader(response).next()["interval_s"] == 0.2
    response = http.get("/dashboard/api/events", params={"interval": "often"})
    assert response.status_code == 400 and "interval" in response.json()["error"]["message"]


def test_requests_endpoints(server: ServerThread, http: httpx.Client) -> None:
    recorder = recorder_of(server)
    older = complete(http, "older request")
    newer = complete(http, "newer request")
    wait_recorded(recorder, newer)
    listed = http.get("/dashboard/api/requests", params={"limit": 2}).json()["data"]
    assert [t["request_id"] for t in listed] == [newer, older]  # newest first
    assert set(listed[0]) >= TIMELINE_KEYS

    one = http.get(f"/dashboard/api/requests/{older}").json()
    assert [t["request_id"] for t in one["data"]] == [older] and one["in_flight"] is False
    assert one["data"][0]["num_output_tokens"] == 2

    missing = http.get("/dashboard/api/requests/chatcmpl-nobody")
    assert missing.status_code == 404
    assert missing.json()["error"]["type"] == "NotFoundError" and missing.json()["error"]["code"] == 404


def test_in_flight_request_comes_from_the_engine_client(server: ServerThread, http: httpx.Client) -> None:
    """A streaming request (the fake's `forever` word streams slowly) is found before it is recorded."""
    body = {"prompt": "forever", "max_tokens": 40, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        chunks = EventReader(response)  # kept: an abandoned line iterator would close the response
        request_id = chunks.next()["id"] + "-0"
        live = http.get(f"/dashboard/api/requests/{request_id}").json()
    assert live["in_flight"] is True and live["data"][0]["request_id"] == request_id
    assert live["data"][0]["stamps"]["finished"] is None


def test_page_and_static_files(http: httpx.Client) -> None:
    for path in ("/", "/dashboard"):
        page = http.get(path)
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "/static/dashboard/app.js" in page.text
    for name, media_type in (("app.js", "text/javascript"), ("dashboard.css", "text/css")):
        response = http.get(f"/static/dashboard/{name}")
        assert response.status_code == 200 and response.headers["content-type"].startswith(media_type)
    for bad in ("..%2Fserver.py", "..%2F..%2F__init__.py", ".hidden.js", "..", "missing.js", "dashboard.py"):
        response = http.get(f"/static/dashboard/{bad}")
        assert response.status_code == 404, bad
        assert response.json()["error"]["code"] == 404


def test_api_key_guards_the_data_but_not_the_page() -> None:
    with ServerThread(build_app(FakeEngine(), api_key="sekret")) as running, \
            httpx.Client(base_url=running.url, timeout=10) as http:
        for path in ("/", "/dashboard", "/static/dashboard/app.js"):
            assert http.get(path).status_code == 200, path
        for path in ("/dashboard/api/events", "/dashboard/api/requests", "/dashboard/api/requests/x"):
            response = http.get(path)
            assert response.status_code == 401, path
            assert response.json()["error"]["type"] == "AuthenticationError"
        auth = {"Authorization": "Bearer sekret"}
        assert http.get("/dashboard/api/requests", headers=auth).json() == {"data": []}
        assert http.get("/dashboard/api/requests/x", headers=auth).status_code == 404
        with http.stream("GET", "/dashboard/api/events", headers=auth) as response:
            check_types(EventReader(response).next(), EVENT_KEYS)


def open_tasks(server: ServerThread) -> int:
    return len(server.server.server_state.tasks)


def test_stream_ends_when_the_client_leaves() -> None:
    with ServerThread(build_app(FakeEngine())) as running:
        with httpx.Client(base_url=running.url, timeout=10) as http, \
                http.stream("GET", "/dashboard/api/events", params={"interval": 5}) as response:
            events = EventReader(response)  # kept: an abandoned line iterator would close the response
            events.next()
            assert open_tasks(running) == 1
        # Noticed within a disconnect check (0.25 s), not at the next 5 s tick.
        deadline = time.monotonic() + 2
        while open_tasks(running):
            assert time.monotonic() < deadline, "the event stream outlived its client"
            time.sleep(0.02)


def shut_down_with_a_stream_open(running: ServerThread) -> None:
    """Starts shutting the server down while a page's event stream is open; returns once both have ended."""
    ended = threading.Event()
    with running:
        with httpx.Client(base_url=running.url, timeout=10) as http, \
                http.stream("GET", "/dashboard/api/events", params={"interval": 0.2}) as response:
            events = EventReader(response)
            events.next()

            def read_to_end() -> None:
                try:
                    while True:
                        events.next()
                except (AssertionError, httpx.HTTPError):
                    ended.set()

            reader = threading.Thread(target=read_to_end, daemon=True)
            reader.start()
            running.server.should_exit = True
            running.thread.join(timeout=5)
            assert not running.thread.is_alive(), "the server did not shut down with a dashboard open"
            assert ended.wait(5), "the event stream did not end"
        assert open_tasks(running) == 0


def test_stream_ends_as_soon_as_the_server_shuts_down() -> None:
    """Under `lmserve serve` the stream sees the app's is_shutting_down and ends at once: no graceful-shutdown
    wait (None here: without the check, shutdown would wait for the page forever) and no cancelled task."""
    app = build_app(FakeEngine())
    running = ServerThread(app)
    assert running.server.config.timeout_graceful_shutdown is None
    app.state.is_shutting_down = lambda: running.server.should_exit  # as serve() does
    started = time.monotonic()
    shut_down_with_a_stream_open(running)
    assert time.monotonic() - started < 3


def test_stream_is_cancelled_cleanly_by_a_graceful_timeout() -> None:
    """Without is_shutting_down (an app run by someone else), uvicorn's graceful-shutdown timeout cancels it."""
    running = ServerThread(build_app(FakeEngine()))
    running.server.config.timeout_graceful_shutdown = 0.5  # as `lmserve serve` sets it (3 s)
    shut_down_with_a_stream_open(running)


def test_step_cursor_is_kept_per_engine_replica() -> None:
    """Data-parallel replicas count their steps separately: a replica far behind another still has its new steps
    sent."""
    from lmserve.api.dashboard import steps_after

    def step(engine: int, index: int) -> StepRecord:
        return StepRecord(index, 0.0, 0.1, 0.05, {}, {}, [], 1, 0, engine=engine)

    steps = [step(0, 500), step(1, 3), step(0, 501), step(1, 4)]
    assert steps_after(steps, {}) == steps
    assert steps_after(steps, {0: 500, 1: 3}) == [steps[2], steps[3]]
    assert steps_after(steps + [step(1, 5)], {0: 501, 1: 4}) == [step(1, 5)]
