"""The front-end's handle on the engine-core process: start it, send inputs, receive outputs (ZMQ + msgspec)."""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from lmserve.config import EngineConfig, ParallelConfig
from lmserve.connection_watch import ConnectionWatch, heartbeats
from lmserve.engine.core_proc import SOCKET_DIRECTORY_PREFIX
from lmserve.engine.messages import EngineInput, EngineOutput, Shutdown

logger = logging.getLogger(__name__)


def remote_engine_addresses(parallel: ParallelConfig, replica: int) -> tuple[str, str]:
    """The front-end's input and output sockets for a data-parallel replica on another machine: on
    --data-parallel-address, two ports per replica from --data-parallel-rpc-port, so that both sides derive them."""
    host = f"[{parallel.data_parallel_address}]" if ":" in parallel.data_parallel_address \
        else parallel.data_parallel_address
    port = parallel.data_parallel_rpc_port + 2 * replica
    return f"tcp://{host}:{port}", f"tcp://{host}:{port + 1}"


class EngineCoreClient:
    """remote_replica: the engine of that data-parallel replica runs on another machine (started there by
    `lmserve serve --headless`, lmserve/headless.py), which connects to this client's TCP sockets; else this client
    starts the engine process here, on ipc sockets."""

    def __init__(self, config: EngineConfig, log_level: str = "INFO", name: str = "lmserve-engine",
                 remote_replica: int | None = None) -> None:
        self._dir = tempfile.mkdtemp(prefix=SOCKET_DIRECTORY_PREFIX)
        if remote_replica is None:
            input_addr, output_addr = f"ipc://{self._dir}/input", f"ipc://{self._dir}/output"
        else:
            input_addr, output_addr = remote_engine_addresses(config.parallel, remote_replica)
        # Inputs go out on a plain socket that never blocks: no high-water mark while the engine reads, and a
        # non-blocking send that fails at once when the engine is gone. So an abort can be sent from any
        # synchronous cleanup path (a generator's finally), and shutdown cannot hang on a dead engine.
        self._sync_ctx = zmq.Context()
        self._input = self._sync_ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._input.setsockopt(zmq.LINGER, 0)
        if remote_replica is not None:
            heartbeats(self._input)
            self.process: EngineProcess | RemoteEngine = RemoteEngine(remote_replica, ConnectionWatch(self._input))
        self._input.bind(input_addr)
        self._async_ctx = zmq.asyncio.Context()
        self._output = self._async_ctx.socket(zmq.PULL)
        self._output.bind(output_addr)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineOutput)
        if remote_replica is None:
            self.process = EngineProcess(config, input_addr, output_addr, log_level, name)

    def send(self, message: EngineInput) -> bool:
        """False when no engine is connected to take it (not started yet, or gone)."""
        try:
            self._input.send(self._encoder.encode(message), zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        return True

    async def recv(self) -> EngineOutput:
        return self.decode(await self.next_frame())

    def next_frame(self) -> asyncio.Future[zmq.Frame]:
        """The next output frame, as a future that can wait beside other replicas' (and be cancelled without
        losing a message: cancelled before it completes, the message stays in the socket)."""
        return self._output.recv(copy=False)

    def decode(self, frame: zmq.Frame) -> EngineOutput:
        return self._decoder.decode(frame.buffer)

    @property
    def is_alive(self) -> bool:
        return self.process.is_alive()

    def exit_description(self) -> str:
        """Why the engine is gone, once is_alive is False."""
        return self.process.exit_description()

    @property
    def exitcode(self) -> int | None:
        """The engine process's, once it is gone (0: a signal stopped it cleanly); None while it runs."""
        return self.process.exitcode

    def shutdown(self, timeout: float = 5.0) -> None:
        if self.process.is_alive():
            try:
                sent = self.send(Shutdown())
            except zmq.ZMQError:
                sent = False
            self.process.join(timeout if sent else 0.5)
        if isinstance(self.process, RemoteEngine):
            self.process.close()  # its node stops it if it did not stop by itself: the connection goes now
        else:
            if self.process.is_alive():
                logger.warning("engine did not stop in %.0fs; terminating it", timeout)
                self.process.terminate()
                self.process.join(timeout)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._sync_ctx.term()
        self._async_ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)


class EngineProcess:
    """The engine's own Python process, started fresh (not forked: torch and a running event loop do not survive
    fork). A plain subprocess rather than multiprocessing's spawn, which also starts a resource-tracker process
    (12 MiB resident for the server's lifetime, tracking nothing of ours) and re-imports the parent's main module.
    The config goes over stdin, pickled, as spawn sends it."""

    def __init__(self, config: EngineConfig, input_addr: str, output_addr: str, log_level: str, name: str) -> None:
        package_root = str(Path(__file__).resolve().parents[2])  # the lmserve this process runs, not another one
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
        command = [sys.executable, *subprocess._args_from_interpreter_flags(), "-m", "lmserve.engine.core_proc",
                   input_addr, output_addr, log_level, name]
        self._popen = subprocess.Popen(command, stdin=subprocess.PIPE, env=env)
        assert self._popen.stdin is not None
        try:
            self._popen.stdin.write(pickle.dumps(config))
            self._popen.stdin.close()
        except BrokenPipeError:  # it died at once; exitcode says how
            pass

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def popen(self) -> subprocess.Popen:
        return self._popen

    def exit_description(self) -> str:
        return f"engine process died (exit code {self.exitcode})"

    @property
    def exitcode(self) -> int | None:
        """As multiprocessing gives it: None while running, -N after signal N."""
        return self._popen.poll()

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def terminate(self) -> None:
        if self.is_alive():
            self._popen.terminate()

    def kill(self) -> None:
        if self.is_alive():
            self._popen.kill()


class RemoteEngine:
    """A data-parallel replica's engine on another machine: alive until its connection to this front-end drops (its
    process exited, or its machine went silent past the heartbeats' timeout). Its own node starts and stops it."""

    def __init__(self, replica: int, watch: ConnectionWatch) -> None:
        self.replica = replica
        self._watch = watch
        self.pid = None

    @property
    def exitcode(self) -> int | None:
        return None

    def exit_description(self) -> str:
        return (f"engine replica {self.replica} on another machine disconnected (its engine process exited, or its "
                "machine stopped answering)")

    def is_alive(self) -> bool:
        return not self._watch.poll()

    def join(self, timeout: float | None = None) -> None:
        deadline = time.monotonic() + (timeout if timeout is not None else float("inf"))
        while self.is_alive() and self._watch.connected and time.monotonic() < deadline:
            time.sleep(0.05)

    def terminate(self) -> None:
        """Nothing to do here: its node stops it once this front-end's connection goes."""

    kill = terminate

    def close(self) -> None:
        self._watch.close()
