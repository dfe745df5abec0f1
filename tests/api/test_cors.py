"""CORS (--allowed-origins): browser pages from the listed origins may call the API; by default none may, since
a page the user visits could otherwise reach a server on their own machine."""

from __future__ import annotations

import httpx
from test_api_fake_engine import MODEL, FakeEngine, ServerThread

from lmserve.api.server import build_app

APP_ORIGIN = "http://localhost:3000"
PREFLIGHT = {"Origin": APP_ORIGIN, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


def test_listed_origins_pass_the_preflight_even_with_a_key() -> None:
    with ServerThread(build_app(FakeEngine(), api_key="secret", allowed_origins=[APP_ORIGIN])) as running:
        url = f"{running.url}/v1/completions"
        preflight = httpx.options(url, headers=PREFLIGHT)
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == APP_ORIGIN
        assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
        answer = httpx.post(url, json={"model": MODEL, "prompt": "a b", "max_tokens": 2},
                            headers={"Origin": APP_ORIGIN, "Authorization": "Bearer secret"})
        assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == APP_ORIGIN
        # The key is still required; a page from another origin gets no CORS answer.
        assert httpx.post(url, json={"prompt": "a"}, headers={"Origin": APP_ORIGIN}).status_code == 401
        other = httpx.options(url, headers={**PREFLIGHT, "Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in other.headers


def test_no_origin_is_allowed_by_default() -> None:
    with ServerThread(build_app(FakeEngine())) as running:
        preflight = httpx.options(f"{running.url}/v1/completions", headers=PREFLIGHT)
        assert "access-control-allow-origin" not in preflight.headers
        answer = httpx.post(f"{running.url}/v1/completions", json={"prompt": "a b", "max_tokens": 2},
                            headers={"Origin": APP_ORIGIN})
        assert answer.status_code == 200 and "access-control-allow-origin" not in answer.headers
