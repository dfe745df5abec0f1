"""`lmserve router` in front of scripted instances (FastAPI apps over real HTTP): requests spread over several
prefill and decode instances, a client that leaves is cancelled wherever its request is, and an instance that cannot
be reached, or dies mid-stream, is named to the client. The router against real lmserve instances is
tests/api/test_disaggregation_e2e.py."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from server_thread import ServerThread

from lmserve.api.router import build_router_app, prefill_request, router_keys

SLOW = "slow"  # the instance answers only when the client has gone (and records that it saw it go)
DIE = "die"  # a stream that breaks off after two events


class Instance:
    """An lmserve instance as the router sees it: it answers with its own name, streams three events, and records
    every request it got and every client that left it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.requests: list[dict] = []
        self.authorizations: list[str | None] = []
        self.left: list[str] = []  # prompts whose client went away
        self.app = FastAPI()
        self.app.post("/v1/completions")(self.completions)
        self.app.get("/health")(lambda: {"ok": True})
        self.paths: list[str] = []
        for path in ("/v1/messages", "/infill", "/v1/messages/count_tokens"):
            self.app.post(path)(self.echo)

    async def echo(self, request: Request) -> Any:
        """The coding tools' endpoints: the path, the body and the key as they arrived."""
        self.paths.append(request.url.path)
        self.requests.append(await request.json())
        self.authorizations.append(request.headers.get("x-api-key") or request.headers.get("authorization"))
        return JSONResponse({"instance": self.name, "path": request.url.path})

    async def completions(self, request: Request) -> Any:
        payload = await request.json()
        self.requests.append(payload)
        self.authorizations.append(request.headers.get("authorization"))
        prompt = payload["prompt"]
        if payload.get("stream"):
            if prompt == SLOW + "-headers":  # the stream's headers never come before the client goes
                while not await request.is_disconnected():
                    await asyncio.sleep(0.02)
                self.left.append(prompt)
            return StreamingResponse(self.events(prompt), media_type="text/event-stream")
        if prompt == SLOW and payload["max_tokens"] > 1 or prompt == SLOW + "-prefill":
            while not await request.is_disconnected():
                await asyncio.sleep(0.02)
            self.left.append(prompt)
        return JSONResponse({"instance": self.name, "max_tokens": payload["max_tokens"]})

    async def events(self, prompt: str) -> AsyncIterator[str]:
        try:
            for index in range(1000 if prompt == SLOW else 3):
                yield f"data: {json.dumps({'instance': self.name, 'index': index})}\n\n"
                if prompt == DIE and index == 1:
                    raise RuntimeError("the instance died")
                await asyncio.sleep(0.05 if prompt == SLOW else 0)
            yield "data: [DONE]\n\n"
        except (asyncio.CancelledError, GeneratorExit):
            self.left.append(prompt)
            raise


@pytest.fixture
def cluster() -> Iterator[tuple[list[Instance], list[Instance], ServerThread, dict]]:
    prefill, decode = [Instance("p0"), Instance("p1")], [Instance("d0"), Instance("d1")]
    with (ServerThread(prefill[0].app) as p0, ServerThread(prefill[1].app) as p1,
          ServerThread(decode[0].app) as d0, ServerThread(decode[1].app) as d1):
        app = build_router_app([p0.url, p1.url], [d0.url, d1.url], max_body_bytes=1 << 20)
        with ServerThread(app) as router:
            yield prefill, decode, router, app.state.instances


def ask(router: ServerThread, prompt: str = "hello", **fields: Any) -> httpx.Response:
    return httpx.post(f"{router.url}/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 8,
                                                            **fields}, timeout=10)


def wait_for(condition: Any, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


def test_the_prefill_instance_gets_one_token_and_the_decode_instance_the_request() -> None:
    payload = {"model": "m", "prompt": "p", "max_tokens": 50, "stream": True, "n": 3,
               "stream_options": {"include_usage": True}, "min_tokens": 5}
    assert prefill_request(payload) == {"model": "m", "prompt": "p", "max_tokens": 1, "stream": False, "n": 1}
    responses = {"model": "m", "input": "p", "max_output_tokens": 50, "stream": True}
    assert prefill_request(responses, "/v1/responses") == {"model": "m", "input": "p", "max_output_tokens": 1,
                                                            "stream": False}  # no n: the Responses API has none
    messages = {"model": "claude-x", "messages": [], "max_tokens": 50, "stream": True, "system": "s"}
    assert prefill_request(messages, "/v1/messages") == {"model": "claude-x", "messages": [], "max_tokens": 1,
                                                          "stream": False, "system": "s"}  # no n in Anthropic's API
    infill = {"input_prefix": "a", "input_suffix": "b", "n_predict": 64, "stream": True}
    assert prefill_request(infill, "/infill") == {"input_prefix": "a", "input_suffix": "b", "max_tokens": 1,
                                                  "stream": False}
    chat = {"model": "m", "messages": [], "max_completion_tokens": 50, "max_tokens": 50}
    assert prefill_request(chat) == {"model": "m", "messages": [], "max_completion_tokens": 1, "stream": False,
                                     "n": 1}


def test_requests_take_turns_and_go_where_fewest_are_in_flight(cluster) -> None:
    prefill, decode, router, instances = cluster
    answers = [ask(router).json()["instance"] for _ in range(4)]
    assert answers == ["d0", "d1", "d0", "d1"]
    assert [len(p.requests) for p in prefill] == [2, 2]
    assert all(r["max_tokens"] == 1 and r["stream"] is False for p in prefill for r in p.requests)
    assert all(r["max_tokens"] == 8 for d in decode for r in d.requests)

    # A stream in flight on d0: the next requests go to d1 until it ends.
    with httpx.stream("POST", f"{router.url}/v1/completions", timeout=10,
                      json={"model": "m", "prompt": SLOW, "max_tokens": 8, "stream": True}) as stream:
        lines = stream.iter_lines()  # kept: a dropped iterator closes the stream
        assert json.loads(next(lines).removeprefix("data: "))["instance"] == "d0"
        assert instances["decode"].in_flight == [1, 0]
        assert [ask(router).json()["instance"] for _ in range(2)] == ["d1", "d1"]
    assert wait_for(lambda: decode[0].left == [SLOW])  # the client closed the stream: d0's request ended too
    assert wait_for(lambda: instances["decode"].in_flight == [0, 0] and instances["prefill"].in_flight == [0, 0])


def test_a_client_that_leaves_is_cancelled_wherever_its_request_is(cluster) -> None:
    prefill, decode, router, instances = cluster
    for prompt, where in ((SLOW + "-prefill", prefill), (SLOW, decode)):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{router.url}/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 8},
                       timeout=0.5)
        assert wait_for(lambda w=where, p=prompt: any(i.left == [p] for i in w)), prompt
    with pytest.raises(httpx.ReadTimeout):  # a stream whose instance has not answered yet
        httpx.post(f"{router.url}/v1/completions", timeout=0.5,
                   json={"model": "m", "prompt": SLOW + "-headers", "max_tokens": 8, "stream": True})
    assert wait_for(lambda: any(SLOW + "-headers" in d.left for d in decode))
    assert all(r["prompt"] != SLOW + "-prefill" for d in decode for r in d.requests)  # it never got that far
    assert wait_for(lambda: instances["decode"].in_flight == [0, 0] and instances["prefill"].in_flight == [0, 0])


def test_an_instance_that_is_gone_or_dies_is_named(cluster) -> None:
    _prefill, _decode, router, instances = cluster
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        gone = f"http://127.0.0.1:{closed.getsockname()[1]}"  # bound, never listening: connections are refused
        with ServerThread(build_router_app([gone], [router.url], max_body_bytes=1 << 20)) as broken:
            answer = ask(broken)
            assert answer.status_code == 502
            assert f"the prefill instance {gone} failed: ConnectError" in answer.json()["error"]["message"]
            health = httpx.get(f"{broken.url}/health", timeout=10)
            assert health.status_code == 503 and health.json()["prefill"] == {gone: None}
        # /v1/models from the first decode instance that answers.
        with ServerThread(build_router_app([router.url], [gone, router.url], max_body_bytes=1 << 20)) as second:
            assert httpx.get(f"{second.url}/v1/models", timeout=10).status_code == 404  # the scripted one has none
        with ServerThread(build_router_app([router.url], [gone], max_body_bytes=1 << 20)) as none:
            listed = httpx.get(f"{none.url}/v1/models", timeout=10)
            assert listed.status_code == 502 and f"the decode instance {gone} failed" in listed.json()["error"]["message"]

    oai = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0, timeout=10)
    events = []
    with pytest.raises(openai.APIError, match="the decode instance .* failed"):
        events.extend(oai.completions.create(model="m", prompt=DIE, max_tokens=8, stream=True))
    assert len(events) == 2  # both events before the instance died, whole
    health = httpx.get(f"{router.url}/health", timeout=10)
    assert health.status_code == 200
    assert health.json() == {role: {url: 200 for url in instances[role].urls} for role in ("prefill", "decode")}


@pytest.fixture
def one_of_each() -> Iterator[tuple[Instance, Instance, str, str]]:
    prefill, decode = Instance("p0"), Instance("d0")
    with ServerThread(prefill.app) as p0, ServerThread(decode.app) as d0:
        yield prefill, decode, p0.url, d0.url


def test_the_routers_own_key_guards_it_and_its_health_names_no_instance_to_strangers(one_of_each) -> None:
    """--api-key (or LMSERVE_API_KEY) is the router's own: without it a client gets a 401 in OpenAI's shape; the
    instances get --instance-api-key in its stead. /health says to everyone whether the instances are healthy, and
    names them (their URLs map the deployment's inside) only to a client with the key."""
    prefill, decode, p0, d0 = one_of_each
    app = build_router_app([p0], [d0], max_body_bytes=1 << 20, api_key="router-key", instance_api_key="inner-key")
    with ServerThread(app) as router:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "router-key"}):
            refused = httpx.post(f"{router.url}/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2},
                                 headers=headers, timeout=10)
            assert refused.status_code == 401 and "API key" in refused.json()["error"]["message"]
            assert httpx.get(f"{router.url}/v1/models", headers=headers, timeout=10).status_code == 401
        assert prefill.requests == [] and decode.requests == []
        oai = openai.OpenAI(base_url=f"{router.url}/v1", api_key="router-key", max_retries=0, timeout=10)
        assert oai.completions.with_raw_response.create(model="m", prompt="hi", max_tokens=2).http_response.json() \
            == {"instance": "d0", "max_tokens": 2}
        assert prefill.authorizations == decode.authorizations == ["Bearer inner-key"]
        stranger = httpx.get(f"{router.url}/health", timeout=10)
        assert stranger.status_code == 200 and stranger.json() == {"status": "healthy"}
        assert p0 not in stranger.text and d0 not in stranger.text
        insider = httpx.get(f"{router.url}/health", headers={"Authorization": "Bearer router-key"}, timeout=10)
        assert insider.json() == {"prefill": {p0: 200}, "decode": {d0: 200}}


def test_the_keys_come_from_the_environment_where_no_flag_gives_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMSERVE_API_KEY", "from-env")
    monkeypatch.setenv("LMSERVE_INSTANCE_API_KEY", "inner-from-env")
    assert router_keys(None, None) == ("from-env", "inner-from-env")
    assert router_keys("flag", "inner-flag") == ("flag", "inner-flag")
    monkeypatch.delenv("LMSERVE_API_KEY")
    monkeypatch.delenv("LMSERVE_INSTANCE_API_KEY")
    assert router_keys(None, None) == (None, None)


@pytest.mark.parametrize("body", [
    b"[" * 5000 + b"]" * 5000,
    b'{"model": "m", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    b'{"model": "m", "prompt": "hi", "temperature": NaN}',
    b'{"model": "m", "prompt": "hi", "temperature": Infinity}',
    b'{"model": "m", "prompt": "hi", "temperature": -Infinity}',
    b'{"model": "m", "prompt": "hi", "temperature": 1e999}',
    b'{"model": "m", "prompt": "hi", "logit_bias": {"1": -1e999}}',
    b'{"model": "m", "prompt": "\\ud800"}',
    b'{"model": "m", "prompt": "\xed\xa0\x80"}',
], ids=["nested-5000", "nested-field", "nan", "infinity", "minus-infinity", "1e999", "1e999-deep", "lone-surrogate",
        "surrogate-bytes"])
def test_hostile_bodies_get_a_json_400_and_reach_no_instance(one_of_each, body: bytes) -> None:
    """What the instances refuse with a 400 the router refused with a plain-text 500 (json.loads took it, and
    forwarding it failed): now a 400 in OpenAI's shape, and no instance sees it."""
    prefill, decode, p0, d0 = one_of_each
    with ServerThread(build_router_app([p0], [d0], max_body_bytes=1 << 20)) as router:
        for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages", "/infill",
                     "/v1/messages/count_tokens"):
            answer = httpx.post(f"{router.url}{path}", content=body, timeout=10,
                                headers={"content-type": "application/json"})
            assert answer.status_code == 400, answer.text
            error = answer.json()["error"]
            assert error["type"] == "BadRequestError" and error["code"] == 400 and error["message"], error
    assert prefill.requests == [] and decode.requests == []


def test_streams_holding_every_decode_connection_starve_neither_prefill_nor_health(one_of_each) -> None:
    """Prefill calls, decode calls and health checks have pools of their own, and a call waits a bounded time for
    a connection: with the decode pool (one connection here) held by a stream, another stream gets a 503 naming the
    cause within the wait (it waited up to 600 s), its prefill call still went through, and /health still reports
    the healthy instances as healthy (it reported them down)."""
    prefill, decode, p0, d0 = one_of_each
    app = build_router_app([p0], [d0], max_body_bytes=1 << 20, max_connections=1, pool_wait_s=0.5)
    with ServerThread(app) as router, httpx.stream(
            "POST", f"{router.url}/v1/completions", timeout=10,
            json={"model": "m", "prompt": SLOW, "max_tokens": 8, "stream": True}) as held:
        lines = held.iter_lines()
        assert json.loads(next(lines).removeprefix("data: "))["instance"] == "d0"
        for _ in range(2):
            health = httpx.get(f"{router.url}/health", timeout=10)
            assert health.status_code == 200 and health.json() == {"prefill": {p0: 200}, "decode": {d0: 200}}
        busy = httpx.post(f"{router.url}/v1/completions", timeout=30,
                          json={"model": "m", "prompt": "another", "max_tokens": 8, "stream": True})
        assert busy.status_code == 503
        assert "every connection of this router to its decode instances is busy" in busy.json()["error"]["message"]
        assert [r["prompt"] for r in prefill.requests] == [SLOW, "another"]  # the prefill pool was free
        assert [r["prompt"] for r in decode.requests] == [SLOW]


def test_the_coding_tools_endpoints_are_prefilled_and_decoded_as_the_others(one_of_each) -> None:
    """/v1/messages and /infill go to a prefill instance for one token and then to a decode instance; counting tokens
    goes to a decode instance alone; Anthropic's x-api-key opens the router as a bearer token does."""
    prefill, decode, p0, d0 = one_of_each
    app = build_router_app([p0], [d0], max_body_bytes=1 << 20, api_key="router-key", instance_api_key="inner-key")
    with ServerThread(app) as router:
        message = {"model": "claude-x", "max_tokens": 20, "messages": [{"role": "user", "content": "hi"}]}
        refused = httpx.post(f"{router.url}/v1/messages", json=message, headers={"x-api-key": "wrong"}, timeout=10)
        assert refused.status_code == 401 and prefill.requests == decode.requests == []
        for path, body in (("/v1/messages", message), ("/infill", {"input_prefix": "def f(", "n_predict": 9})):
            answer = httpx.post(f"{router.url}{path}", json=body, headers={"x-api-key": "router-key"}, timeout=10)
            assert answer.status_code == 200 and answer.json() == {"instance": "d0", "path": path}
        counted = httpx.post(f"{router.url}/v1/messages/count_tokens", json={"model": "m", "messages": []},
                             headers={"authorization": "Bearer router-key"}, timeout=10)
        assert counted.json() == {"instance": "d0", "path": "/v1/messages/count_tokens"}
    assert prefill.paths == ["/v1/messages", "/infill"]
    assert decode.paths == ["/v1/messages", "/infill", "/v1/messages/count_tokens"]
    assert [r.get("max_tokens") for r in prefill.requests] == [1, 1]
    assert decode.requests[0] == message and decode.requests[1]["n_predict"] == 9
    assert set(prefill.authorizations + decode.authorizations) == {"Bearer inner-key"}
