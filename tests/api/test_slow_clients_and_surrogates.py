"""What a real server cannot easily be made to show, against the fake engine over real HTTP: slow senders cut off
by the header and body deadlines, and a model's tool call carrying a lone surrogate escape (`\\ud800`), which
json.loads makes a character UTF-8 cannot carry, served whole and streamed on chat and Responses."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from test_api_fake_engine import MODEL
from test_responses import RenderingEngine

from lmserve.api.connections import DeadlineH11Protocol, uvicorn_config
from lmserve.api.server import build_app
from lmserve.api.serving import ToolConfig
from lmserve.cli import build_parser, http_limits

HEADER_TIMEOUT_S = 0.5
BODY_TIMEOUT_S = 1.0


class QuickDeadlines(DeadlineH11Protocol):
    header_timeout = HEADER_TIMEOUT_S


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    tools = ToolConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")
    app = build_app(RenderingEngine(), tools=tools, body_timeout=BODY_TIMEOUT_S)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", http=QuickDeadlines))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not uv.started:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    uv.should_exit = True
    thread.join(5)


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def closed_within(conn: socket.socket, seconds: float, trickle: bytes = b"") -> tuple[bool, bytes]:
    """Sends `trickle` a byte every 0.1 s until the server closes the connection or `seconds` pass."""
    deadline = time.monotonic() + seconds
    conn.settimeout(0.1)
    received = b""
    for byte in [trickle[i:i + 1] for i in range(len(trickle))] or [b""] * int(seconds * 10):
        if time.monotonic() > deadline:
            return False, received
        try:
            if byte:
                conn.sendall(byte)
            chunk = conn.recv(65536)
            if not chunk:
                return True, received
            received += chunk
        except TimeoutError:
            continue
        except (ConnectionResetError, BrokenPipeError):
            return True, received
    return False, received


def test_headers_trickled_a_byte_at_a_time_are_cut_off(server: str) -> None:
    conn = connect(server)
    trickle = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200
    closed, _ = closed_within(conn, HEADER_TIMEOUT_S * 6, trickle)
    assert closed, "the connection was still open after the header deadline"


def test_a_silent_connection_is_closed(server: str) -> None:
    closed, _ = closed_within(connect(server), HEADER_TIMEOUT_S * 6)
    assert closed


def test_a_body_trickled_a_byte_at_a_time_is_a_408(server: str) -> None:
    conn = connect(server)
    body = json.dumps({"messages": [{"role": "user", "content": "hi " * 100}]}).encode()
    conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body))
    closed, received = closed_within(conn, BODY_TIMEOUT_S * 6, body)
    assert received.startswith(b"HTTP/1.1 408"), received[:200]
    assert b"did not arrive within" in received and closed, "a 408, then the connection closed"


def test_the_connection_answers_requests_after_a_deadline_was_armed(server: str) -> None:
    with httpx.Client(base_url=server, timeout=10) as client:  # keep-alive: the deadline is re-armed in between
        for _ in range(3):
            assert client.get("/health").status_code == 200
            time.sleep(HEADER_TIMEOUT_S / 5)


SURROGATE_CALL = '<tool_call> {"name": "get_weather", "arguments": {"city": "Pa\\ud800ris"}} </tool_call>'
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def sse_events(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_with_a_lone_surrogate_is_served_on_chat(server: str, stream: bool) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": SURROGATE_CALL}], "tools": [WEATHER],
            "stream": stream}
    response = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=10)
    assert response.status_code == 200, response.text
    response.content.decode("utf-8")  # strict: valid UTF-8 all through
    if stream:
        events = sse_events(response.text)
        assert not any("error" in event for event in events), events
        arguments = "".join(call["function"].get("arguments", "") for event in events for choice in event["choices"]
                            for call in choice["delta"].get("tool_calls", ()))
    else:
        arguments = response.json()["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
    assert json.loads(arguments) == {"city": "Pa\ud800ris"}  # the same value, its surrogate escaped


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_with_a_lone_surrogate_is_served_on_responses(server: str, stream: bool) -> None:
    tool = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
    body = {"model": MODEL, "input": SURROGATE_CALL, "tools": [tool], "stream": stream}
    response = httpx.post(f"{server}/v1/responses", json=body, timeout=10)
    assert response.status_code == 200, response.text
    response.content.decode("utf-8")
    if stream:
        events = sse_events(response.text)
        assert events[-1]["type"] == "response.completed", events[-1]
        output = events[-1]["response"]["output"]
    else:
        output = response.json()["output"]
    calls = [item for item in output if item["type"] == "function_call"]
    assert [json.loads(c["arguments"]) for c in calls] == [{"city": "Pa\ud800ris"}]


# ---- the flags: --header-timeout, --body-timeout, --limit-concurrency ------------------------------------------


@contextlib.contextmanager
def served_with(*flags: str) -> Iterator[str]:
    """The fake engine's app under the deadlines and cap that `lmserve serve FLAGS` passes to serve()."""
    limits = http_limits(build_parser().parse_args(["serve", *flags]))
    app = build_app(RenderingEngine(), body_timeout=limits["body_timeout"])
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uv = uvicorn.Server(uvicorn_config(app, header_timeout=limits["header_timeout"],
                                       limit_concurrency=limits["limit_concurrency"], log_level="warning",
                                       lifespan="off"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not uv.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        uv.should_exit = True
        thread.join(5)


def test_the_deadline_flags_change_when_slow_clients_are_cut_off() -> None:
    assert http_limits(build_parser().parse_args(["serve"])) == {
        "header_timeout": 10.0, "body_timeout": 60.0, "limit_concurrency": 1024}
    with served_with("--header-timeout", "0.5", "--body-timeout", "1") as url:
        closed, _ = closed_within(connect(url), 3.0)  # silent: the default 10 s would keep it open
        assert closed, "--header-timeout 0.5 did not close a silent connection"
        conn = connect(url)
        body = json.dumps({"messages": [{"role": "user", "content": "hi " * 100}]}).encode()
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body))
        closed, received = closed_within(conn, 6.0, body)  # trickled over ~30 s
        assert received.startswith(b"HTTP/1.1 408") and b"within 1 s" in received, received[:200]
    with served_with("--header-timeout", "30") as url:
        closed, _ = closed_within(connect(url), 1.0)
        assert not closed, "--header-timeout 30 closed a connection within a second"


def test_limit_concurrency_flag_caps_open_connections() -> None:
    with served_with("--limit-concurrency", "2") as url:
        held = connect(url)  # an open connection counts, requests or not
        with httpx.Client(base_url=url, timeout=10) as client:
            assert client.get("/health").status_code == 503
            held.close()
            deadline = time.monotonic() + 10
            while (status := client.get("/health").status_code) == 503 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert status == 200
    with served_with() as url:  # the default cap, 1,024
        held = connect(url)
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        held.close()
