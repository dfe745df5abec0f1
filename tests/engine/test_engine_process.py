"""The engine process's failure paths: EngineCoreProc runs in this process on the tiny random Llama and talks over
real ZMQ sockets, bound as the front-end binds them."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from lmserve import SamplingParams
from lmserve.config import make_engine_config
from lmserve.engine.core_proc import EngineCoreProc
from lmserve.engine.messages import (
    AddRequest,
    EngineFailed,
    EngineOutput,
    Ready,
    RequestRejected,
    Shutdown,
    StepOutputs,
)


class EngineSockets:
    """The front-end's two sockets, bound as EngineCoreClient binds them."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="lmserve-test-")
        self.input_addr, self.output_addr = f"ipc://{self.dir}/input", f"ipc://{self.dir}/output"
        self.ctx = zmq.Context()
        self.input = self.ctx.socket(zmq.PUSH)
        self.input.bind(self.input_addr)
        self.output = self.ctx.socket(zmq.PULL)
        self.output.bind(self.output_addr)
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(EngineOutput)

    def send(self, message: object) -> None:
        self.input.send(self.encoder.encode(message))

    def received(self, timeout_ms: int = 2000) -> list[object]:
        messages = []
        while self.output.poll(timeout_ms):
            messages.append(self.decoder.decode(self.output.recv()))
            timeout_ms = 100
        return messages

    def close(self) -> None:
        self.input.close(linger=0)
        self.output.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def sockets() -> Iterator[EngineSockets]:
    s = EngineSockets()
    yield s
    s.close()


def _proc(tiny_llama_dir: Path, sockets: EngineSockets) -> EngineCoreProc:
    config = make_engine_config(str(tiny_llama_dir), dtype="float32", num_blocks=16)
    return EngineCoreProc(config, sockets.input_addr, sockets.output_addr)


def _add(request_id: str, max_tokens: int) -> AddRequest:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return AddRequest(request_id, [1, 2, 3, 4], params, [], 0, 0.0)


def test_duplicate_request_id_is_rejected_without_touching_the_first(
    tiny_llama_dir: Path, sockets: EngineSockets
) -> None:
    proc = _proc(tiny_llama_dir, sockets)
    try:
        assert isinstance(sockets.received()[0], Ready)
        proc.handle(_add("r", max_tokens=3))
        proc.handle(_add("r", max_tokens=3))
        assert proc.engine.scheduler.get_request("r") is not None, "the duplicate aborted the existing request"
        (rejected,) = sockets.received()
        assert isinstance(rejected, RequestRejected) and rejected.request_id == "r"
        assert "already in use" in rejected.message
        proc.handle(Shutdown())
        proc.run()  # finishes nothing more: Shutdown stops the loop
    finally:
        proc.close()


def test_a_crash_inside_a_step_sends_engine_failed_with_the_reason(
    tiny_llama_dir: Path, sockets: EngineSockets, monkeypatch: pytest.MonkeyPatch
) -> None:
    proc = _proc(tiny_llama_dir, sockets)
    try:
        assert isinstance(sockets.received()[0], Ready)

        def broken_step(*_args: object, **_kwargs: object) -> None:
            raise RuntimeError("a kernel exploded")

        monkeypatch.setattr(proc.engine, "step", broken_step)
        sockets.send(_add("r", max_tokens=3))
        with pytest.raises(RuntimeError, match="a kernel exploded"):
            proc.run()
        failures = [m for m in sockets.received() if isinstance(m, EngineFailed)]
        assert failures and "a kernel exploded" in failures[0].message
        assert "RuntimeError" in failures[0].message
    finally:
        proc.close()


def test_engine_loop_stops_when_its_parent_is_gone(
    tiny_llama_dir: Path, sockets: EngineSockets
) -> None:
    """Between busy steps, not only while idle: a request of 400 tokens is cut short."""
    proc = _proc(tiny_llama_dir, sockets)
    try:
        sockets.received()
        proc.parent_pid = -1  # as if the API process had died and this one had been re-parented
        sockets.send(_add("r", max_tokens=400))
        proc.run()
        steps = [m for m in sockets.received() if isinstance(m, StepOutputs)]
        assert len(steps) <= 2
        assert proc.engine.has_unfinished_requests()
    finally:
        proc.close()
