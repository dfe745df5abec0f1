"""Ranks as processes (`--distributed-executor-backend mp`), on this machine or on several (`--nnodes`).

The engine process spawns one process per rank of its node (lmserve.executor.rank_process) and talks to every rank
over ZMQ (ipc sockets on one machine, TCP on node 0's --master-addr over several; the other nodes' ranks are started
by `lmserve serve --headless` there, lmserve/headless.py): each rank first gets the configuration, then each step's
plan (pickled once, each request's lists as what changed since the last step: executor/step_messages.py), and the
driver rank sends back its output. Every message is signed with the engine's key and checked before it is unpickled,
and over TCP the sockets are CurveZMQ's (distributed/signed_frames.py): a process that does not hold the key can
neither run code in the engine nor join it; the ranks talk among themselves through torch.distributed (gloo on CPU, NCCL on
CUDA). Outputs come back in the order the steps were submitted, so several steps may be in flight (pipeline parallel).

A rank that dies or raises fails the engine with the reason (RankFailedError; another node reports its ranks' exits);
the ranks die with the process that started them (PR_SET_PDEATHSIG), and shutdown stops them, so no rank outlives
its engine.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import socket
import subprocess
import tempfile
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from lmserve.config import EngineConfig, ParallelConfig, PlacementConfig
from lmserve.distributed.layout import RankLayout
from lmserve.distributed.signed_frames import (
    RANK_KEY_ENV,
    SignedFrames,
    curve_server,
    new_engine_key,
    node_secret,
)
from lmserve.executor.base import Executor, RankFailedError, batches_in_flight, reconciled_info
from lmserve.executor.rank_starter import RankProcess, start_rank_process
from lmserve.executor.step_messages import StepEncoder
from lmserve.models import resolve_model
from lmserve.step import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

POLL_MS = 100  # how often a wait for ranks checks that they are all alive
SHUTDOWN_S = 5.0
DEATH_SEEN_S = 1.0  # how long a rank's failure waits to see whether another rank's exit caused it


def free_local_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class RankAddresses:
    """Where an engine's ranks meet: each rank's step socket, the results socket and torch.distributed's rendezvous.
    On one machine: ipc sockets in a private folder and a free loopback port. Over several (--nnodes): node 0's
    --master-addr, the rendezvous at --master-port and the sockets on the ports after it, so that every node derives
    them from the same flags."""

    rank_inputs: tuple[str, ...]
    results: str
    init_method: str

    @classmethod
    def for_engine(cls, parallel: ParallelConfig, ipc_dir: Path | None) -> RankAddresses:
        if parallel.nnodes == 1:
            assert ipc_dir is not None
            return cls(tuple(f"ipc://{ipc_dir}/rank{rank}" for rank in range(parallel.world_size)),
                       f"ipc://{ipc_dir}/results", f"tcp://127.0.0.1:{free_local_port()}")
        host, port = parallel.master_addr, parallel.master_port
        host = f"[{host}]" if ":" in host else host  # an IPv6 address
        return cls(tuple(f"tcp://{host}:{port + 2 + rank}" for rank in range(parallel.world_size)),
                   f"tcp://{host}:{port + 1}", f"tcp://{host}:{port}")


def engine_key(parallel: ParallelConfig) -> bytes:
    """The key an engine's messages are signed with: a fresh one on one machine (only the ranks it starts hold it);
    over several, the operator's secret, which every node derives the same key from."""
    if parallel.nnodes == 1:
        return new_engine_key()
    return node_secret([parallel.master_addr], f"--nnodes {parallel.nnodes} --master-addr {parallel.master_addr}")


def start_rank(addresses: RankAddresses, config: EngineConfig, rank: int, ranks_here: int, key: bytes,
               placement: PlacementConfig | None = None) -> RankProcess:
    """One rank process (lmserve.executor.rank_process, forked where it can be: executor/rank_starter.py); it logs at
    the engine's level unless told otherwise. `placement`: this machine's CPUs and threads where they are not the
    engine's (a --headless node's own flags)."""
    parallel = config.parallel
    machine = [] if placement is None else [json.dumps(dataclasses.asdict(placement))]
    arguments = [addresses.rank_inputs[rank], addresses.results, str(rank), addresses.init_method,
                 f"{parallel.world_size}/{parallel.nnodes}", *machine]
    hf_model = resolve_model(config.model.model).kind == "hf"
    log_level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
    return start_rank_process(arguments, log_level, hf_model, fork=ranks_here > 1,
                              environment={RANK_KEY_ENV: key.hex()})


class PendingOutput(Future):
    """The driver rank's output of one submitted step: waiting for it reads the ranks' messages."""

    def __init__(self, executor: MultiprocExecutor) -> None:
        super().__init__()
        self._executor = executor

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        self._executor.wait_for(self.done)
        return super().result(timeout)


class MultiprocExecutor(Executor):
    takes_grammar_masks_later = True

    def __init__(self, config: EngineConfig) -> None:
        parallel = config.parallel
        self.world_size = parallel.world_size
        self.pp_size = parallel.pipeline_parallel_size
        self.driver_rank = RankLayout.driver_rank(parallel.tensor_parallel_size, self.pp_size)
        self.max_concurrent_batches = batches_in_flight(config)
        if parallel.node_rank != 0:
            raise ValueError(f"node_rank {parallel.node_rank} runs no engine, only its ranks: start that node with "
                             "`lmserve serve ... --headless`")
        self.nnodes = parallel.nnodes
        self._dir = Path(tempfile.mkdtemp(prefix="lmserve-ranks-"))
        addresses = RankAddresses.for_engine(parallel, self._dir)
        key = engine_key(parallel)
        self._frames = SignedFrames(key)
        self._ctx = zmq.Context()
        self._inputs = []
        for rank in range(self.world_size):
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.LINGER, 0)
            if self.nnodes > 1:
                curve_server(sock, key)
            sock.bind(addresses.rank_inputs[rank])
            self._inputs.append(sock)
        self._results = self._ctx.socket(zmq.PULL)
        if self.nnodes > 1:
            curve_server(self._results, key)
        self._results.bind(addresses.results)
        self._pending: deque[PendingOutput] = deque()
        self._steps = StepEncoder()  # what the ranks hold of each request: each step sends what changed
        self._stats: dict[int, dict[str, int]] = {}
        self._ready: dict[int, Any] = {}
        # A rank takes its configuration from its step socket, first: the ranks of other nodes read no file here.
        self._unconfigured = {rank: self._frames.seal(("config", config)) for rank in range(self.world_size)}
        self._remote_exits: dict[int, str] = {}  # ranks on other nodes whose exit their node reported
        here = parallel.node_ranks(0)
        self.procs = [start_rank(addresses, config, rank, len(here), key) for rank in here]
        if self.nnodes > 1:
            logger.info("waiting for ranks %d-%d of nodes 1-%d (lmserve serve ... --node-rank N --headless; "
                        "rendezvous %s)", len(self.procs), self.world_size - 1, self.nnodes - 1,
                        addresses.init_method)
        try:
            self.wait_for(lambda: len(self._ready) == self.world_size)
        except BaseException:
            self.shutdown()
            raise
        self.info = reconciled_info([self._ready[rank] for rank in range(self.world_size)], self.driver_rank)
        logger.info("%d ranks ready (pids here %s)", self.world_size, ", ".join(str(p.pid) for p in self.procs))

    def _send_configs(self) -> None:
        """Hands each rank its configuration as soon as its step socket is connected (a PUSH socket with no peer
        yet takes no message)."""
        for rank, message in list(self._unconfigured.items()):
            try:
                self._inputs[rank].send_multipart(message, zmq.NOBLOCK)
            except zmq.Again:
                continue
            del self._unconfigured[rank]

    def _broadcast(self, message: tuple) -> None:
        """Never blocks: a PUSH socket whose rank is gone would wait for it forever; that rank's death is
        reported by check_health instead."""
        frames = self._frames.seal(message)
        for sock in self._inputs:
            try:
                self._frames.send_sealed(sock, frames, zmq.NOBLOCK)
            except zmq.Again:
                pass

    def submit(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        self.check_health()
        self._broadcast(("execute", self._steps.encode(scheduler_output)))
        pending = PendingOutput(self)
        self._pending.append(pending)
        return pending

    def send_grammar_masks(self, mask: Any) -> None:
        try:
            self._frames.send(self._inputs[self.driver_rank], ("grammar", mask), zmq.NOBLOCK)
        except zmq.Again:
            pass  # the driver rank is gone: check_health reports it

    def wait_for(self, condition) -> None:
        """Handles the ranks' messages until `condition()` holds; raises RankFailedError if a rank fails first."""
        while not condition():
            if self._unconfigured:
                self._send_configs()
            if not self._results.poll(POLL_MS):
                self.check_health()
                continue
            message = self._frames.recv(self._results)
            if message is None:
                continue  # forged: dropped unread
            kind, rank, payload = message
            if kind == "output":
                self._pending.popleft().set_result(payload)
            elif kind == "ready":
                self._ready[rank] = payload
            elif kind == "stats":
                self._stats[rank] = payload
            elif kind == "exited":  # a rank of another node, as its node saw it exit
                self._remote_exits[rank] = payload
                raise RankFailedError(payload)
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
            remote = [message for rank, message in self._remote_exits.items() if rank != failed_rank]
            if remote:
                return remote[0]
            if time.monotonic() >= deadline:
                return None
            self._read_remote_exits(0.02)

    def _read_remote_exits(self, wait_s: float) -> None:
        """Waits up to wait_s for the other nodes' reports of ranks that exited (other messages are dropped: the
        engine is failing)."""
        if self.nnodes == 1:
            time.sleep(wait_s)
        elif self._results.poll(int(wait_s * 1000)):
            message = self._frames.recv(self._results)
            kind, rank, payload = message if message is not None else ("forged", None, None)
            if kind == "exited":
                self._remote_exits[rank] = payload

    def check_health(self) -> None:
        for rank, proc in enumerate(self.procs):
            code = proc.poll()
            if code is not None:
                raise RankFailedError(f"rank {rank} (pid {proc.pid}) exited with code {code}")
        if self._remote_exits:
            raise RankFailedError(next(iter(self._remote_exits.values())))

    def communication_stats(self) -> list[dict[str, int]]:
        self._stats.clear()
        self._broadcast(("stats", None))
        self.wait_for(lambda: len(self._stats) == self.world_size)
        return [self._stats[rank] for rank in range(self.world_size)]

    def shutdown(self) -> None:
        if self._ctx.closed:
            return
        if any(proc.poll() is not None for proc in self.procs) or len(self._ready) < self.world_size:
            # A rank is gone, or never started: the others may be stuck in a collective or the rendezvous with it,
            # and nothing they hold is needed.
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
