"""The engine core in its own process: a ZMQ loop around EngineCore.

Each iteration drains adds and aborts in arrival order, runs one step, applies aborts that arrived during the step,
and sends the outputs. When there is nothing to run it blocks on the input socket: an idle server uses no CPU.

The engine never outlives the API process: it checks its parent between steps and while idle, and its sends never
block (no high-water mark on the output socket, so a parent that stopped reading cannot wedge a step).
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import msgspec
import zmq

from lmserve.config import EngineConfig
from lmserve.engine.messages import (
    AbortRequests,
    AddRequest,
    EngineFailed,
    EngineInput,
    EngineOutput,
    FinishRequests,
    GetStats,
    Ready,
    RequestRejected,
    Shutdown,
    StatsReply,
    StepOutputs,
)
from lmserve.engine.request import Request
from lmserve.metrics.clock import now
from lmserve.process_exit import exit_closed

logger = logging.getLogger(__name__)

# EngineCoreClient's directory of an engine's ipc sockets (tempfile.mkdtemp's prefix).
SOCKET_DIRECTORY_PREFIX = "lmserve-"
# While idle, wake up this often to notice that the parent process is gone.
PARENT_CHECK_MS = 1000


class EngineCoreProc:
    def __init__(self, config: EngineConfig, input_addr: str, output_addr: str) -> None:
        self.ctx = zmq.Context()
        self.input = self.ctx.socket(zmq.PULL)
        self.input.connect(input_addr)
        self.output = self.ctx.socket(zmq.PUSH)
        self.output.setsockopt(zmq.SNDHWM, 0)
        self.output.connect(output_addr)
        self.decoder = msgspec.msgpack.Decoder(EngineInput)
        self.encoder = msgspec.msgpack.Encoder()
        self.parent_pid = os.getppid()
        self.parent_gone = False
        self.running = True
        self.queued: dict[str, float] = {}  # received since the last message that reported them
        try:
            # Here, not at the top: the in-process tests import this module and must not wait for torch.
            from lmserve.engine.core import EngineCore

            self.engine = EngineCore(config)
        except Exception as exc:
            logger.exception("engine failed to start")
            self.send(EngineFailed(f"{type(exc).__name__}: {exc}"))
            raise
        self.send(Ready(self.engine.max_model_len, self.engine.vocab_size, self.engine.num_blocks,
                        config.cache.block_size, self.engine.eos_token_ids))

    def send(self, message: EngineOutput) -> None:
        if isinstance(message, StepOutputs) and self.queued:
            message.queued, self.queued = self.queued, {}
        self.output.send(self.encoder.encode(message), copy=False)

    def handle(self, message: EngineInput) -> None:
        engine = self.engine
        if isinstance(message, AddRequest):
            self.queued[message.request_id] = now()
            request = Request(
                request_id=message.request_id, prompt_token_ids=message.prompt_token_ids,
                sampling_params=message.sampling_params, eos_token_ids=message.eos_token_ids,
                priority=message.priority, arrival_time=message.arrival_time, parent_id=message.parent_id,
                index=message.index, cache_salt=message.cache_salt, pooling_params=message.pooling_params,
            )
            try:
                engine.add_request(request)
            except ValueError as exc:  # the front-end validates first; this is a last line of defence
                logger.warning("rejected request %s: %s", message.request_id, exc)
                self.queued.pop(message.request_id, None)
                self.send(RequestRejected(message.request_id, str(exc)))
        elif isinstance(message, AbortRequests):
            outputs = engine.abort_requests(message.request_ids)
            if outputs:
                self.send(StepOutputs(outputs))
        elif isinstance(message, FinishRequests):
            engine.finish_requests(message.request_ids)
        elif isinstance(message, GetStats):
            self.send(StatsReply(message.call_id, engine.stats(message.request_ids)))
        elif isinstance(message, Shutdown):
            self.running = False

    def check_parent(self) -> None:
        if os.getppid() != self.parent_pid:
            logger.warning("parent process is gone; engine exiting")
            self.parent_gone = True
            self.running = False

    def drain(self, block: bool) -> None:
        """Handles every waiting input in arrival order; with block, first waits for one (or the parent check)."""
        if block and not self.input.poll(PARENT_CHECK_MS):
            self.check_parent()
            self.engine.check_health()
            return
        while self.running:
            try:
                frame = self.input.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.handle(self.decoder.decode(frame.buffer))

    def run(self) -> None:
        """Steps until Shutdown or the parent's death. A step that raises fails the engine: the front-end gets
        EngineFailed with the reason before the exception leaves this process."""
        try:
            while self.running:
                self.drain(block=not self.engine.has_unfinished_requests())
                if not self.running or not self.engine.has_unfinished_requests():
                    continue
                outputs = self.engine.step(after_execute=lambda: self.drain(block=False))
                # Sent even without outputs: a prefill chunk's step belongs in the requests' timelines. An
                # iteration that only started a pipeline batch (last_step None) has nothing to tell.
                if outputs or self.engine.last_step is not None:
                    self.send(StepOutputs(outputs, step=self.engine.last_step))
                self.check_parent()
        except Exception as exc:
            self.send(EngineFailed(f"engine step failed: {type(exc).__name__}: {exc}"))
            raise

    def close(self) -> None:
        if hasattr(self, "engine"):
            self.engine.shutdown()
        self.input.close(linger=0)
        self.output.close(linger=1000)
        self.ctx.term()


def run_engine_core(config: EngineConfig, input_addr: str, output_addr: str, log_level: str = "INFO") -> None:
    """Entry point of the engine process."""
    # Ctrl-C reaches the whole process group; the API process decides how to shut us down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s engine: %(message)s")
    proc = None
    try:
        proc = EngineCoreProc(config, input_addr, output_addr)
        proc.run()
    except Exception:
        logger.exception("engine core crashed")
        sys.exit(1)
    finally:
        if proc is not None:
            proc.close()
            if proc.parent_gone:
                remove_socket_directory(socket_directory(input_addr))


def socket_directory(input_addr: str) -> Path | None:
    """The directory of the client's ipc sockets (EngineCoreClient makes one for each engine; None over TCP)."""
    if not input_addr.startswith("ipc://"):
        return None
    directory = Path(input_addr.removeprefix("ipc://")).parent
    return directory if directory.name.startswith(SOCKET_DIRECTORY_PREFIX) else None


def keep_temporary_files_in(directory: Path | None) -> None:
    """The engine's temporary files (its ranks' sockets, multiprocessing's fork server) go into its sockets' directory,
    which the client removes at its shutdown whether this process stopped or was killed outright: made in /tmp, a
    killed engine left them there."""
    if directory is not None:
        tempfile.tempdir = str(directory)


def remove_socket_directory(directory: Path | None) -> None:
    """The sockets' directory and what is in it: the client in the API process removes it at its shutdown, but an API
    process killed outright never does, and the engine is then the last one that knows it."""
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":  # started by engine/client.py: addresses, log level and name as arguments, config on stdin
    _input_addr, _output_addr, _log_level = sys.argv[1:4]  # argv[4], the engine's name, is there for ps
    keep_temporary_files_in(socket_directory(_input_addr))
    try:
        run_engine_core(pickle.load(sys.stdin.buffer), _input_addr, _output_addr, _log_level)
    except SystemExit as stopped:  # SIGTERM (0) closed everything too; a crash (1) leaves the slow, usual way
        if stopped.code not in (0, None):
            raise
    exit_closed(0)
