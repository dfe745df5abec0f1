"""RequestStream: outputs merged for a slow consumer, and an error never lost behind an unread output."""

from __future__ import annotations

import asyncio

import pytest

from lmserve.frontend.async_llm import RequestStream
from lmserve.frontend.errors import EngineDeadError
from lmserve.outputs import CompletionOutput, RequestOutput


def delta(text: str, token: int, finished: bool = False) -> RequestOutput:
    return RequestOutput("r", None, [1], [CompletionOutput(index=0, text=text, token_ids=[token])], finished=finished)


def test_put_then_fail_before_reading_gives_the_output_then_the_error() -> None:
    async def scenario() -> None:
        stream = RequestStream()
        stream.put(delta("a", 1))
        stream.put(delta("b", 2))
        stream.fail(EngineDeadError("engine died"))
        out = await asyncio.wait_for(stream.get(), 1)
        assert out.outputs[0].text == "ab" and out.outputs[0].token_ids == [1, 2]
        with pytest.raises(EngineDeadError, match="engine died"):
            await asyncio.wait_for(stream.get(), 1)  # waited forever before the fix

    asyncio.run(scenario())


def test_get_waits_for_the_next_output() -> None:
    async def scenario() -> None:
        stream = RequestStream()
        reader = asyncio.ensure_future(stream.get())
        await asyncio.sleep(0.01)
        assert not reader.done()
        stream.put(delta("x", 3, finished=True))
        out = await asyncio.wait_for(reader, 1)
        assert out.finished and out.outputs[0].text == "x"

    asyncio.run(scenario())
