"""`lmserve serve MODEL ... --headless`: a node that serves no API, as vLLM's headless mode. It starts this node's
share of a deployment whose front-end runs on node 0, and watches it:

- `--nnodes N --node-rank K`: the ranks of one engine that runs on node 0 (executor/multiproc.py): they connect to
  node 0's engine and take their configuration from it.
- `-dp N --data-parallel-size-local L --data-parallel-start-rank S`: engine replicas S ... S + L - 1 of node 0's
  front-end (engine/dp_client.py): each connects to the front-end's sockets for it.

A process that exits with an error is reported to node 0 where it can be (a rank: "exited"; a replica's engine is
seen by its lost connection). When node 0 goes away (stopped, killed, or its machine silent: ZMQ heartbeats notice),
this node's processes are stopped and it exits, so that nothing waits for a front-end that is gone. It exits when
its processes have all exited: 0 after node 0's shutdown, 1 after a failure.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import time
from collections.abc import Callable

import zmq

from lmserve.config import EngineConfig
from lmserve.connection_watch import ConnectionWatch, heartbeats

logger = logging.getLogger(__name__)

POLL_S = 0.1
STOP_S = 5.0


class NodeSupervisor:
    """Watches this node's processes (by name: "rank 2", "replica 1") and its connection to node 0 (`node0`, a
    PUSH socket connected there that `report` may send on)."""

    def __init__(self, node: str, processes: dict[str, subprocess.Popen], node0: zmq.Socket,
                 report: Callable[[str, str], None] | None = None) -> None:
        self.node = node
        self.procs = processes
        self._watch = ConnectionWatch(node0)
        self._report = report

    def run(self) -> int:
        failed = False
        reported: set[str] = set()
        while True:
            if self._watch.poll():
                return self._after_node0_gone()
            codes = {name: proc.poll() for name, proc in self.procs.items()}
            for name, code in codes.items():
                if code not in (None, 0) and name not in reported:
                    reported.add(name)
                    failed = True
                    message = f"{name} (pid {self.procs[name].pid}) on {self.node} exited with code {code}"
                    logger.error("%s", message)
                    if self._report is not None:
                        self._report(name, message)
            if all(code is not None for code in codes.values()):
                logger.info("%s: all processes exited", self.node)
                return 1 if failed else 0
            time.sleep(POLL_S)

    def _after_node0_gone(self) -> int:
        """0 if the processes exit by themselves soon (node 0 shut down and told them), else 1 once they are
        stopped (node 0 or its machine died)."""
        deadline = time.monotonic() + STOP_S
        while time.monotonic() < deadline and any(proc.poll() is None for proc in self.procs.values()):
            time.sleep(POLL_S)
        if all(proc.poll() == 0 for proc in self.procs.values()):
            logger.info("%s: node 0 shut down; all processes exited", self.node)
            return 0
        logger.error("%s: lost the connection to node 0: stopping this node's processes", self.node)
        self.stop()
        return 1

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
        self._watch.close()


def rank_supervisor(config: EngineConfig, ctx: zmq.Context) -> NodeSupervisor:
    """This node's ranks of node 0's engine (--nnodes), on this machine's CPUs as this node's flags say: their exits
    reported on the engine's results socket."""
    from lmserve.distributed.signed_frames import SignedFrames, curve_client
    from lmserve.executor.multiproc import RankAddresses, engine_key, start_rank

    parallel = config.parallel
    addresses = RankAddresses.for_engine(parallel, None)
    key = engine_key(parallel)  # the operator's secret (docs/security.md): node 0's engine derives the same
    frames = SignedFrames(key)
    results = ctx.socket(zmq.PUSH)
    results.setsockopt(zmq.LINGER, 1000)
    heartbeats(results)
    curve_client(results, key)

    def report(name: str, message: str) -> None:
        rank = int(name.removeprefix("rank "))
        try:
            frames.send(results, ("exited", rank, message), zmq.NOBLOCK)
        except zmq.Again:
            pass  # node 0 is not connected: its engine learns it from the broken collective

    supervisor = NodeSupervisor(f"node {parallel.node_rank}", {}, results, report)
    results.connect(addresses.results)
    ranks = parallel.node_ranks(parallel.node_rank)
    supervisor.procs = {f"rank {rank}": start_rank(addresses, config, rank, len(ranks), key, config.placement)
                        for rank in ranks}
    logger.info("node %d of %d: ranks %d-%d started, engine at %s", parallel.node_rank, parallel.nnodes, ranks[0],
                ranks[-1], addresses.init_method)
    return supervisor


def replica_supervisor(config: EngineConfig, ctx: zmq.Context, log_level: str) -> NodeSupervisor:
    """This node's data-parallel replicas of node 0's front-end (--data-parallel-start-rank ...)."""
    from lmserve.engine.client import EngineProcess, remote_engine_addresses
    from lmserve.engine.dp_client import replica_config

    parallel = config.parallel
    replicas = parallel.local_replicas
    first_input, first_output = remote_engine_addresses(parallel, replicas[0])
    watch = ctx.socket(zmq.PUSH)  # never sends: it only holds a connection to the front-end, to notice it gone
    heartbeats(watch)
    supervisor = NodeSupervisor("this node", {}, watch)
    watch.connect(first_output)
    supervisor.procs = {
        f"replica {index}": EngineProcess(replica_config(config, index), *remote_engine_addresses(parallel, index),
                                          log_level, f"lmserve-engine-{index}").popen
        for index in replicas
    }
    logger.info("data parallel replicas %d-%d of %d started, front-end at %s", replicas[0], replicas[-1],
                parallel.data_parallel_size, first_input.rsplit(":", 1)[0])
    return supervisor


def run_headless(config: EngineConfig, log_level: str = "INFO") -> int:
    parallel = config.parallel
    ranks = parallel.nnodes > 1 and parallel.node_rank > 0
    if not ranks and parallel.data_parallel_start_rank == 0:
        raise ValueError("--headless runs a node other than node 0: give --nnodes > 1 and --node-rank >= 1 (ranks "
                         "of one engine), or -dp with --data-parallel-start-rank >= 1 (replicas); node 0 runs "
                         "`lmserve serve` without --headless")
    ctx = zmq.Context()
    supervisor = rank_supervisor(config, ctx) if ranks else replica_supervisor(config, ctx, log_level)

    def stop(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(signum)

    signal.signal(signal.SIGTERM, stop)
    try:
        return supervisor.run()
    except KeyboardInterrupt:
        logger.info("%s: stopping", supervisor.node)
        supervisor.stop()
        return 0
    finally:
        supervisor.close()
        ctx.destroy(linger=1000)
