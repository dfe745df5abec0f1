"""RequestGroup, the one owner of a request group's life: whatever way its context is left (the answer done, the
client gone while it starts or collects, a start that fails, a stream closed early), every engine request that has
not finished is aborted and the group's timelines are recorded exactly once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import pytest

from lmserve.frontend import request_group
from lmserve.frontend.errors import ClientDisconnected
from lmserve.frontend.request_group import RequestGroup
from lmserve.metrics.clock import now
from lmserve.metrics.stats import RequestTimeline
from lmserve.outputs import CompletionOutput, RequestOutput
from lmserve.sampling_params import SamplingParams

FINISH_AT_ONCE = "once"  # one output, finished
ENDLESS = "endless"  # an output now and then, never finished
SILENT = "silent"  # never a first output
FAIL = "fail"  # raises before its first output


class FakeClient:
    """An EngineClient whose prompts say how their engine request behaves."""

    def __init__(self) -> None:
        self.aborted: list[str] = []
        self.closed_early: set[str] = set()
        self.timelines: dict[str, list[RequestTimeline]] = {}

    async def generate(self, prompt: str, params: SamplingParams, request_id: str, priority: int = 0,
                       arrival_time: float | None = None, final_only: bool = False,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        timeline = RequestTimeline(request_id, request_id, arrival_time or now(), now(), num_prompt_tokens=1)
        self.timelines[request_id] = [timeline]
        finished = False
        try:
            if prompt == FAIL:
                raise ValueError("parameter prompt: not this one")
            if prompt == SILENT:
                await asyncio.Event().wait()
            for token in range(1, 1_000_000):
                finished = prompt == FINISH_AT_ONCE
                if finished:
                    timeline.finished, timeline.finish_reason = now(), "stop"
                yield RequestOutput(request_id, prompt, [0], [CompletionOutput(0, "x", [token])], finished=finished)
                if finished:
                    return
                await asyncio.sleep(0.001)
        finally:
            if not finished and prompt != FAIL:
                self.closed_early.add(request_id)

    async def abort(self, request_id: str) -> None:
        await asyncio.sleep(0)  # suspends, as a real client does: it must get through a cancelled scope too
        self.aborted.append(request_id)
        for timeline in self.timelines.get(request_id, []):
            timeline.finished, timeline.finish_reason = now(), "abort"

    def get_timelines(self, request_id: str) -> list[RequestTimeline]:
        return list(self.timelines.get(request_id, ()))

    def pop_timelines(self, request_id: str) -> list[RequestTimeline]:
        return self.timelines.pop(request_id, [])


class FakeRecorder:
    def __init__(self) -> None:
        self.calls: list[list[RequestTimeline]] = []

    def record(self, timelines: Sequence[RequestTimeline]) -> None:
        self.calls.append(list(timelines))


class Client:
    """What the group asks whether the HTTP client has gone."""

    def __init__(self) -> None:
        self.gone = False

    async def is_gone(self) -> bool:
        return self.gone


def make_group(prompts: list[str], client_gone: Callable[[], Awaitable[bool]] | None = None,
               ) -> tuple[RequestGroup, FakeClient, FakeRecorder, list[int]]:
    client, recorder, aborts = FakeClient(), FakeRecorder(), [0]

    def count_abort() -> None:
        aborts[0] += 1

    extra = {} if client_gone is None else {"client_gone": client_gone}
    group = RequestGroup(client, prompts, SamplingParams(), [f"g-{i}" for i in range(len(prompts))], 0,
                         count_abort, now(), recorder, **extra)
    return group, client, recorder, aborts


@pytest.fixture(autouse=True)
def quick_disconnect_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(request_group, "DISCONNECT_POLL_S", 0.01)


def stamps(recorder: FakeRecorder) -> dict[str, tuple[str | None, float | None]]:
    (timelines,) = recorder.calls  # recorded exactly once
    return {t.request_id: (t.finish_reason, t.last_byte) for t in timelines}


def test_a_finished_answer_aborts_nothing_and_stamps_its_last_byte() -> None:
    async def scenario() -> None:
        group, client, recorder, aborts = make_group([FINISH_AT_ONCE, FINISH_AT_ONCE])
        async with group:
            seen = [index async for index, _ in group.outputs()]
            assert sorted(seen) == [0, 1]
            assert recorder.calls == []  # not before the answer is done
        assert client.aborted == [] and aborts == [0]
        recorded = stamps(recorder)
        assert {rid: reason for rid, (reason, _) in recorded.items()} == {"g-0": "stop", "g-1": "stop"}
        assert all(last_byte is not None for _, last_byte in recorded.values())

    asyncio.run(scenario())


def test_leaving_early_aborts_what_has_not_finished_and_records_once() -> None:
    async def scenario() -> None:
        group, client, recorder, aborts = make_group([FINISH_AT_ONCE, ENDLESS])
        async with group:
            outputs = group.outputs()
            endless_seen = 0
            async for index, _ in outputs:  # left suspended, as by a response whose client went away
                endless_seen += index == 1
                if endless_seen == 3:
                    break
        assert client.aborted == ["g-1"] and aborts == [1]  # the finished request is not aborted
        assert client.closed_early == {"g-1"}
        recorded = stamps(recorder)
        assert recorded["g-1"] == ("abort", None)
        assert recorded["g-0"][0] == "stop" and recorded["g-0"][1] is not None  # its answer was delivered
        await group.__aexit__(None, None, None)  # leaving again changes nothing
        await outputs.aclose()
        assert len(recorder.calls) == 1 and client.aborted == ["g-1"]

    asyncio.run(scenario())


def test_a_client_gone_while_the_group_starts_aborts_it_and_records_it_undelivered() -> None:
    async def scenario() -> None:
        client_state = Client()
        group, client, recorder, aborts = make_group([ENDLESS, SILENT], client_state.is_gone)
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, setattr, client_state, "gone", True)
        with pytest.raises(ClientDisconnected):
            async with group:
                pytest.fail("the group started without its silent request's first output")
        assert sorted(client.aborted) == ["g-0", "g-1"] and aborts == [2]
        assert stamps(recorder) == {"g-0": ("abort", None), "g-1": ("abort", None)}

    asyncio.run(scenario())


def test_a_client_gone_while_the_group_collects_aborts_it() -> None:
    async def scenario() -> None:
        client_state = Client()
        group, client, recorder, _ = make_group([ENDLESS], client_state.is_gone)
        with pytest.raises(ClientDisconnected):
            async with group:
                asyncio.get_running_loop().call_later(0.05, setattr, client_state, "gone", True)
                await group.collect()
        assert client.aborted == ["g-0"] and client.closed_early == {"g-0"}
        assert stamps(recorder) == {"g-0": ("abort", None)}

    asyncio.run(scenario())


def test_a_start_that_fails_aborts_the_rest_of_the_group() -> None:
    async def scenario() -> None:
        group, client, recorder, _ = make_group([ENDLESS, FAIL])
        with pytest.raises(ValueError, match="not this one"):
            async with group:
                pytest.fail("a group whose start failed was entered")
        assert client.aborted == ["g-0"]  # the request that raised has ended: nothing to abort
        assert set(stamps(recorder)) == {"g-0", "g-1"}

    asyncio.run(scenario())
