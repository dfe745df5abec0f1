"""Ranks as processes on this machine (`--distributed-executor-backend mp`).

The engine process spawns one process per rank (lmserve.executor.rank_process) and talks to them over ZMQ on ipc
sockets: each step's plan goes to every rank (pickled once, each request's lists as what changed since the last
step: executor/step_messages.py), and the driver rank sends back its output; the ranks talk among themselves
through torch.distributed (gloo on CPU, NCCL on CUDA). Outputs come back in the order the
steps were submitted, so several steps may be in flight (pipeline parallel).

A rank that dies or raises fails the engine with the reason (RankFailedError); the ranks die with the engine
process (PR_SET_PDEATHSIG), and shutdown stops them, so no rank outlives its engine.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import zmq

from lmserve.config import EngineConfig
from lmserve.distributed.parallel_state import RankLayout
from lmserve.executor.base import Executor, RankFailedError, batches_in_flight, reconciled_info
from lmserve.executor.step_messages import StepEncoder
from lmserve.step import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

POLL_MS = 100  # how often a wait for ranks checks that they are all alive
SHUTDOWN_S = 5.0
DEATH_SEEN_S = 1.0  # how long a rank's failure waits to see whether another rank's exit caused it


def free_local_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PendingOutput(Future):
    """The driver rank's output of one submitted step: waiting for it reads the ranks' messages."""

    def __init__(self, executor: MultiprocExecutor) -> None:
        super().__init__()
        self._executor = executor

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        self._executor.wait_for(self.done)
        return super().result(timeout)


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        parallel = config.parallel
        self.world_size = parallel.world_size
        self.pp_size = parallel.pipeline_parallel_size
        self.driver_rank = RankLayout.driver_rank(parallel.tensor_parallel_size, self.pp_size)
        self.max_concurrent_batches = batches_in_flight(config)
        self._dir = Path(tempfile.mkdtemp(prefix="lmserve-ranks-"))
        (self._dir / "config.pkl").write_bytes(pickle.dumps(config))
        self._ctx = zmq.Context()
        self._inputs = []
        for rank in range(self.world_size):
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(f"ipc://{self._dir}/rank{rank}")
            self._inputs.append(sock)
        self._results = self._ctx.socket(zmq.PULL)
        self._results.bind(f"ipc://{self._dir}/results")
        self._pending: deque[PendingOutput] = deque()
        self._steps = StepEncoder()  # what the ranks hold of each request: each step sends what changed
        self._stats: dict[int, dict[str, int]] = {}
        self._ready: dict[int, Any] = {}
        init_method = f"tcp://127.0.0.1:{free_local_port()}"
        # The ranks log at the engine's level unless told otherwise.
        env = {"LMSERVE_LOG_LEVEL": logging.getLevelName(logging.getLogger().getEffectiveLevel()), **os.environ}
        self.procs = [
            subprocess.Popen([sys.executable, "-m", "lmserve.executor.rank_process", str(self._dir), str(rank),
                              init_method], env=env)
            for rank in range(self.world_size)
        ]
        try:
            self.wait_for(lambda: len(self._ready) == self.world_size)
        except BaseException:
            self.shutdown()
            raise
        self.info = reconciled_info([self._ready[rank] for rank in range(self.world_size)], self.driver_rank)
        logger.info("%d ranks ready (pids %s)", self.world_size, ", ".join(str(p.pid) for p in self.procs))

    def _broadcast(self, message: tuple) -> None:
        """Never blocks: a PUSH socket whose rank is gone would wait for it forever; that rank's death is
        reported by check_health instead."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for sock in self._inputs:
            try:
                sock.send(data, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                pass

    def submit(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        self.check_health()
        self._broadcast(("execute", self._steps.encode(scheduler_output)))
        pending = PendingOutput(self)
        self._pending.append(pending)
        return pending

    def wait_for(self, condition) -> None:
        """Handles the ranks' messages until `condition()` holds; raises RankFailedError if a rank fails first."""
        while not condition():
            if not self._results.poll(POLL_MS):
                self.check_health()
                continue
            kind, rank, payload = pickle.loads(self._results.recv())
            if kind == "output":
                self._pending.popleft().set_result(payload)
            elif kind == "ready":
                self._ready[rank] = payload
            elif kind == "stats":
                self._stats[rank] = payload
            elif kind == "failed":
                # A rank's error inside a collective is most often another rank's death (gloo: "Connection reset by
                # peer"): name the rank that died first, then what the survivor saw.
                cause = self._another_rank_exited(rank)
                failed = f"rank {rank} failed: {payload}"
                raise RankFailedError(f"{cause}; then {failed}" if cause else failed)

    def _another_rank_exited(self, failed_rank: int, wait_s: float = DEATH_SEEN_S) -> str | None:
        """How another rank than `failed_rank` exited, if one did (waiting up to wait_s for the exit to be seen)."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank, proc in enumerate(self.procs):
                code = proc.poll() if rank != failed_rank else None
                if code is not None:
                    return f"rank {rank} (pid {proc.pid}) exited with code {code}"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    def check_health(self) -> None:
        for rank, proc in enumerate(self.procs):
            code = proc.poll()
            if code is not None:
                raise RankFailedError(f"rank {rank} (pid {proc.pid}) exited with code {code}")

    def communication_stats(self) -> list[dict[str, int]]:
        self._stats.clear()
        self._broadcast(("stats", None))
        self.wait_for(lambda: len(self._stats) == self.world_size)
        return [self._stats[rank] for rank in range(self.world_size)]

    def shutdown(self) -> None:
        if self._ctx.closed:
            return
        if any(proc.poll() is not None for proc in self.procs):
            # A rank is gone: the others may be stuck in a collective with it, and nothing they hold is needed.
            for proc in self.procs:
                proc.kill()
        try:
            self._broadcast(("shutdown", None))
        except zmq.ZMQError:
            pass
        deadline = time.monotonic() + SHUTDOWN_S
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for sock in self._inputs:
            sock.close(linger=0)
        self._results.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)
