"""The dashboard in headless Chromium (Playwright) against a live `lmserve serve` with the default model.

Chromium comes from the system (`apt-get install chromium`), not from `playwright install`: nothing is downloaded.
Full-page screenshots land in test-artifacts/dashboard/ at the repository root.
"""

from __future__ import annotations

import json
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, Page, sync_playwright
from prometheus_client.parser import text_string_to_metric_families
from server_process import Server, start_server, wait_for
from test_api_fake_engine import FakeEngine, ServerThread

from lmserve.api.server import build_app

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "dashboard"
CHROMIUM = "/usr/bin/chromium"
INTERVAL_S = 0.2  # the fastest event interval: short requests still show up as running
VIEWPORT = {"width": 1440, "height": 900}


def chromium_path() -> str:
    path = shutil.which("chromium") or (CHROMIUM if Path(CHROMIUM).exists() else None)
    if path is None:
        pytest.fail("Chromium is not installed: install it with `apt-get install chromium` (the browser tests use "
                    "the system's Chromium and never download one)", pytrace=False)
    return path


def screenshot(page: Page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / name), full_page=True)


def log_line(path: Path, request_id: str) -> dict[str, Any] | None:
    if not path.exists():
        return None
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        if entry["request_id"] == request_id:
            return entry
    return None


def aborted_total(server: Server) -> float:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "lmserve:request_success_total" and sample.labels.get("finished_reason") == "abort"
    )


def expected_stages(line: dict[str, Any]) -> list[tuple[str, float, float]]:
    """(stage, start ms, duration ms) as the waterfall defines them, computed from a request-log line."""
    stamps, steps = line["stamps"], line["steps"]
    stages: list[tuple[str, float, float]] = []

    def add(stage: str, start: float | None, end: float | None) -> None:
        if start is not None and end is not None and end >= start:
            stages.append((stage, start, end))

    add("input", stamps["arrival"], stamps["input_processed"])
    add("to_engine", stamps["input_processed"], stamps["queued"])
    add("queue", stamps["queued"], stamps["scheduled"])
    decode: list[float] | None = None  # [start, end] of the current run of decode steps
    for _, start, end, _, prefill, _ in steps:
        if prefill:
            decode = None
            add("prefill", start, end)
        elif decode is None:
            decode = [start, end]
            stages.append(("decode", start, end))
        else:
            decode[1] = end
            stages[-1] = ("decode", decode[0], end)
    add("hold_back", stamps["first_token"], stamps["first_chunk"])
    add("output", steps[-1][2] if steps else None, stamps["finished"])
    add("transport", stamps["finished"], stamps["last_byte"])
    stages.sort(key=lambda stage: stage[1])
    return [(name, start * 1000, (end - start) * 1000) for name, start, end in stages]


# ------------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def request_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("log") / "requests.jsonl"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, request_log: Path) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("server"), "--request-log", str(request_log))
    yield srv
    srv.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    executable = chromium_path()
    with sync_playwright() as playwright:
        # As root in a container Chromium needs --no-sandbox; a small /dev/shm needs the other flag.
        browser = playwright.chromium.launch(executable_path=executable,
                                             args=["--no-sandbox", "--disable-dev-shm-usage"])
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def console_errors() -> list[str]:
    return []


@pytest.fixture(scope="module")
def page(browser: Browser, server: Server, console_errors: list[str]) -> Iterator[Page]:
    page = browser.new_page(viewport=VIEWPORT)
    page.on("console", lambda message: message.type == "error" and console_errors.append(message.text))
    page.on("pageerror", lambda error: console_errors.append(f"uncaught: {error}"))
    page.set_default_timeout(30_000)
    page.goto(f"{server.base_url}/dashboard?interval={INTERVAL_S}")
    yield page
    page.close()


def number(page: Page, selector: str) -> int:
    return int(page.inner_text(selector).replace(",", "").replace("–", "0") or 0)


@dataclass
class SentRequests:
    ids: list[str]
    finished_before: int
    steps_before: int


@pytest.fixture(scope="module")
def sent(page: Page, server: Server) -> SentRequests:
    """Three chat requests sent at once from the test, while the page records every running count it shows."""
    page.wait_for_selector("#conn-status[data-state=live]")
    page.evaluate("""() => {
        const node = document.querySelector('#running-count');
        window.runningSeen = [];
        new MutationObserver(() => window.runningSeen.push(node.textContent))
            .observe(node, {childList: true, characterData: true, subtree: true});
    }""")
    finished_before = number(page, "#finished-count")
    steps_before = int(page.get_attribute("#step-chart", "data-steps-total"))
    ids: list[str] = []

    def chat(i: int) -> None:
        body = {"messages": [{"role": "user", "content": f"Count slowly to twenty, attempt {i}."}],
                # ~1 s of decoding: at 16 tokens the three could finish between two of the page's 0.2 s events
                "max_tokens": 96, "temperature": 0, "ignore_eos": True}
        response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)
        response.raise_for_status()
        ids.append(response.json()["id"])

    threads = [threading.Thread(target=chat, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(ids) == 3
    return SentRequests(ids, finished_before, steps_before)


# ------------------------------------------------------------------------------------------------ tests


def test_page_loads_without_console_errors(page: Page, console_errors: list[str]) -> None:
    page.wait_for_selector("#conn-status[data-state=live]")
    page.wait_for_function("document.querySelector('#finished-count').textContent !== '–'")
    assert page.title() == "lmserve dashboard"
    screenshot(page, "01-loaded.png")
    assert console_errors == []


def test_counts_and_step_chart_follow_requests(page: Page, sent: SentRequests) -> None:
    page.wait_for_function(f"Number(document.querySelector('#finished-count').textContent) >= "
                           f"{sent.finished_before + 3}")
    page.wait_for_function(f"Number(document.querySelector('#step-chart').dataset.stepsTotal) > {sent.steps_before}")
    running_seen = [int(v) for v in page.evaluate("window.runningSeen") if v.isdigit()]
    assert max(running_seen, default=0) >= 1, f"the running count never moved: {running_seen}"
    assert int(page.get_attribute("#step-chart", "data-max-running")) >= 1
    assert int(page.get_attribute("#step-chart", "data-steps")) > 0
    assert page.locator("#step-chart .seg").count() > 0
    for request_id in sent.ids:
        page.wait_for_selector(f'#request-list tr[data-request-id="{request_id}"]')
    screenshot(page, "02-after-requests.png")


def test_waterfall_matches_the_request_log(page: Page, sent: SentRequests, request_log: Path) -> None:
    request_id = sent.ids[0]
    line = wait_for(lambda: log_line(request_log, request_id))
    assert line, f"{request_id} is not in the request log"
    page.click(f'#request-list tr[data-request-id="{request_id}"]')
    block = f'#waterfall .wf-request[data-request-id="{request_id}"]'
    page.wait_for_selector(f"{block} .wf-table tbody tr")
    rows = page.eval_on_selector_all(f"{block} .wf-table tbody tr", """rows => rows.map(row => [
        row.dataset.stage, Number(row.dataset.startMs), Number(row.cells[3].textContent)])""")
    expected = expected_stages(line)
    assert [r[0] for r in rows] == [e[0] for e in expected]
    assert [r[0] for r in rows[:4]] == ["input", "to_engine", "queue", "prefill"]
    starts = [r[1] for r in rows]
    assert starts == sorted(starts), "stages out of order"
    for (stage, start, shown), (_, expected_start, expected_ms) in zip(rows, expected, strict=True):
        assert abs(shown - expected_ms) <= 1.0, f"{stage}: shows {shown} ms, the log says {expected_ms:.3f} ms"
        assert abs(start - expected_start) <= 1.0, stage
    assert "transport" in [r[0] for r in rows]  # a delivered response has its last byte
    assert page.locator(f"{block} rect[data-stage]").count() >= len(rows)
    assert page.get_attribute(block, "data-aborted") == "0"
    screenshot(page, "03-waterfall.png")


def test_playground_streams_and_stop_aborts(page: Page, server: Server, request_log: Path,
                                            console_errors: list[str]) -> None:
    aborted_before = aborted_total(server)
    page.fill("#pg-prompt", "Write a very long story about a dragon who learns to cook. Use at least 1000 words.")
    page.fill("#pg-max-tokens", "400")
    page.click("#pg-send")
    page.wait_for_function("document.querySelector('#pg-output')?.textContent.trim().length > 0", timeout=60_000)
    page.click("#pg-stop")
    request_id = page.get_attribute("#pg-request-id", "data-request-id")
    assert request_id and request_id.startswith("chatcmpl-")

    assert wait_for(lambda: aborted_total(server) > aborted_before), "no abort counted in /metrics"
    page.wait_for_selector(f'#waterfall .wf-request[data-request-id="{request_id}"][data-aborted="1"] '
                           f'[data-mark="abort"]')
    line = wait_for(lambda: log_line(request_log, request_id))
    assert line and line["finish_reason"] == "abort" and line["num_output_tokens"] < 400
    assert page.is_disabled("#pg-stop") and "stopped" in page.inner_text("#pg-status")
    screenshot(page, "04-playground-abort.png")
    assert console_errors == []


def test_server_shuts_down_at_once_with_the_page_open(page: Page, server: Server) -> None:
    """SIGTERM with a dashboard open: the page's stream ends at once (no graceful-shutdown timeout, no cancelled
    task in the log) and the server exits 0. Last of the tests on this server."""
    page.wait_for_selector("#conn-status[data-state=live]")
    started = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    page.wait_for_selector("#conn-status:not([data-state=live])", timeout=5_000)
    stream_ended = time.monotonic() - started
    assert server.process.wait(60) == 0
    log = server.log()
    assert "graceful shutdown exceeded" not in log and "Exception in ASGI application" not in log, log[-3000:]
    assert stream_ended < 2.5, f"the page's stream ended {stream_ended:.1f} s after SIGTERM"


def test_api_key_is_asked_for_and_remembered(browser: Browser) -> None:
    """With --api-key the page loads, asks for the key, then streams with it; a reload keeps it (localStorage).

    The fake engine is enough here (no model to load): only the page and the auth are under test.
    """
    with ServerThread(build_app(FakeEngine(), api_key="sekret")) as running:
        context = browser.new_context(viewport=VIEWPORT)
        page = context.new_page()
        page.goto(f"{running.url}/dashboard?interval={INTERVAL_S}")
        page.wait_for_selector("#conn-status[data-state=auth]")
        page.fill("#api-key", "sekret")
        page.dispatch_event("#api-key", "change")
        page.wait_for_selector("#conn-status[data-state=live]")
        page.wait_for_function("document.querySelector('#running-count').textContent === '2'")  # the fake's
        page.reload()
        page.wait_for_selector("#conn-status[data-state=live]")
        assert page.input_value("#api-key") == "sekret"
        screenshot(page, "05-api-key.png")
        context.close()
