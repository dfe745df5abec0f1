"""`lmserve serve MODEL ... --nnodes N --node-rank K --headless`: the ranks of one node other than node 0, as vLLM's
headless mode. This process serves no API and runs no engine: it starts the node's ranks, which connect to node 0's
engine (executor/multiproc.py) and take their configuration from it, and it watches them.

- A rank that exits with an error is reported to the engine ("exited"), which fails with the rank named: a rank
  killed on this node would otherwise show on node 0 only as its peers' broken collective.
- When node 0 goes away (its engine stopped, or the connection to it was lost: ZMQ heartbeats notice a silent
  machine), the ranks are stopped and this process exits, so that no rank waits for an engine that is gone.
- It exits when its ranks have all exited: 0 after the engine's shutdown, 1 after a failure.
"""

from __future__ import annotations

import logging
import pickle
import signal
import subprocess
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from lmserve.config import ParallelConfig
from lmserve.executor.multiproc import RankAddresses, start_rank

logger = logging.getLogger(__name__)

POLL_S = 0.1
HEARTBEAT_MS = 2_000  # a silent node 0 is noticed within HEARTBEAT_TIMEOUT_MS
HEARTBEAT_TIMEOUT_MS = 10_000
STOP_S = 5.0


class NodeSupervisor:
    def __init__(self, parallel: ParallelConfig) -> None:
        if parallel.nnodes == 1 or parallel.node_rank == 0:
            raise ValueError("--headless runs the ranks of a node other than node 0: give --nnodes > 1 and "
                             "--node-rank >= 1 (node 0 runs `lmserve serve` without --headless)")
        self.parallel = parallel
        self.addresses = RankAddresses.for_engine(parallel, None)
        self._ctx = zmq.Context()
        self._results = self._ctx.socket(zmq.PUSH)
        self._results.setsockopt(zmq.LINGER, 1000)
        self._results.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
        self._results.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        self._monitor = self._results.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._results.connect(self.addresses.results)
        self._connected = False
        self.procs: dict[int, subprocess.Popen] = {}

    def run(self) -> int:
        ranks = self.parallel.node_ranks(self.parallel.node_rank)
        self.procs = {rank: start_rank(self.addresses, self.parallel, rank) for rank in ranks}
        logger.info("node %d of %d: ranks %d-%d started (pids %s), engine at %s", self.parallel.node_rank,
                    self.parallel.nnodes, ranks[0], ranks[-1], ", ".join(str(p.pid) for p in self.procs.values()),
                    self.addresses.init_method)
        failed = False
        reported: set[int] = set()
        while True:
            if self._engine_gone():
                return self._after_engine_gone()
            codes = {rank: proc.poll() for rank, proc in self.procs.items()}
            for rank, code in codes.items():
                if code not in (None, 0) and rank not in reported:
                    reported.add(rank)
                    failed = True
                    self._report(rank, f"rank {rank} (pid {self.procs[rank].pid}) on node {self.parallel.node_rank} "
                                       f"exited with code {code}")
            if all(code is not None for code in codes.values()):
                logger.info("node %d: all ranks exited", self.parallel.node_rank)
                return 1 if failed else 0
            time.sleep(POLL_S)

    def _engine_gone(self) -> bool:
        """Whether the connection to node 0 dropped after it was made (no engine yet is not gone: nodes may start
        in any order)."""
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)["event"]
            if event == zmq.EVENT_CONNECTED:
                self._connected = True
            elif event == zmq.EVENT_DISCONNECTED and self._connected:
                return True
        return False

    def _after_engine_gone(self) -> int:
        """0 if the ranks exit by themselves soon (the engine shut down and told them), else 1 once they are
        stopped (the engine or its machine died)."""
        deadline = time.monotonic() + STOP_S
        while time.monotonic() < deadline and any(proc.poll() is None for proc in self.procs.values()):
            time.sleep(POLL_S)
        if all(proc.poll() == 0 for proc in self.procs.values()):
            logger.info("node %d: the engine shut down; all ranks exited", self.parallel.node_rank)
            return 0
        logger.error("lost the connection to node 0's engine (%s): stopping this node's ranks",
                     self.addresses.results)
        self.stop()
        return 1

    def _report(self, rank: int, message: str) -> None:
        logger.error("%s", message)
        try:
            self._results.send(pickle.dumps(("exited", rank, message)), zmq.NOBLOCK)
        except zmq.Again:
            pass  # node 0 is not connected: its engine learns it from the broken collective

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + STOP_S
        for proc in self.procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def close(self) -> None:
        self._results.disable_monitor()
        self._monitor.close(linger=0)
        self._results.close()
        self._ctx.term()


def run_headless(parallel: ParallelConfig) -> int:
    supervisor = NodeSupervisor(parallel)

    def stop(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(signum)

    signal.signal(signal.SIGTERM, stop)
    try:
        return supervisor.run()
    except KeyboardInterrupt:
        logger.info("stopping node %d's ranks", parallel.node_rank)
        supervisor.stop()
        return 0
    finally:
        supervisor.close()
