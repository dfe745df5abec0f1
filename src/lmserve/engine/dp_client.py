"""Data parallel: N engine-core processes, each with its own scheduler and KV cache, behind one client.

DataParallelClient speaks to the front-end exactly as one EngineCoreClient does (send, recv, is_alive, shutdown), so
AsyncLLM does not know how many replicas there are: a request goes to the replica the router picks, its aborts and
finishes follow it there, stats are asked of every replica and come back as one reply (the sums, and each replica's
own), and Ready comes once, when the last replica is ready. Any replica failing is the engine failing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import msgspec

from lmserve.config import EngineConfig, cpu_share
from lmserve.engine.client import EngineCoreClient
from lmserve.engine.dp_router import DataParallelRouter
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
    StatsReply,
    StepOutputs,
)
from lmserve.metrics.stats import EngineStats, sum_engine_stats

logger = logging.getLogger(__name__)

# Stats calls whose replies are still being gathered; past this the oldest are dropped (a replica that never
# answers fails the server anyway, through its death or EngineFailed).
MAX_PENDING_STATS_CALLS = 256


def make_engine_client(config: EngineConfig, log_level: str = "INFO") -> EngineCoreClient | DataParallelClient:
    """One engine process, or a data-parallel set of them: the front-end talks to either the same way."""
    if config.parallel.data_parallel_size == 1:
        return EngineCoreClient(config, log_level)
    return DataParallelClient(config, log_level)


def replica_config(config: EngineConfig, index: int = 0) -> EngineConfig:
    """Replica `index`'s config: its data_parallel_rank (its ranks' GPUs follow the other replicas'), and without an
    explicit --engine-threads, its own share of this machine's CPUs (--engine-cpus, else the process's) among the
    replicas that run here, so that they do not each start a compute thread per CPU and fight over them; the
    replica's ranks then split that share between them (worker.Worker), never all of it each."""
    config = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, data_parallel_rank=index))
    if config.placement.engine_threads is not None:
        return config
    here = config.parallel.local_replicas
    cpus = cpu_share(config.placement.engine_cpus or sorted(os.sched_getaffinity(0)), len(here), index - here.start)
    return dataclasses.replace(config, placement=dataclasses.replace(config.placement, engine_cpus=cpus))


class DataParallelClient:
    def __init__(self, config: EngineConfig, log_level: str = "INFO") -> None:
        num_replicas = config.parallel.data_parallel_size
        self.router = DataParallelRouter(num_replicas, config.cache.block_size, config.cache.enable_prefix_caching)
        self.replicas: list[EngineCoreClient] = []
        here = config.parallel.local_replicas
        if here.start != 0:
            raise ValueError(f"data_parallel_start_rank {here.start}: this machine runs no front-end, only replicas: "
                             "start it with `lmserve serve ... --headless`")
        try:
            for index in range(num_replicas):
                if index in here:
                    self.replicas.append(EngineCoreClient(replica_config(config, index), log_level,
                                                          name=f"lmserve-engine-{index}"))
                else:  # started on another machine (--headless), which connects to this client's sockets
                    self.replicas.append(EngineCoreClient(config, log_level, remote_replica=index))
        except BaseException:
            self.shutdown()  # no replica outlives a failed start
            raise
        logger.info("data parallel: %d engine replicas, CPUs %s", num_replicas,
                    " | ".join(",".join(map(str, replica_config(config, i).placement.engine_cpus or ["all"]))
                               for i in here))
        if len(here) < num_replicas:
            logger.info("waiting for replicas %d-%d from other machines (lmserve serve ... --data-parallel-start-rank "
                        "N --headless), front-end sockets on %s from port %d", here.stop, num_replicas - 1,
                        config.parallel.data_parallel_address, config.parallel.data_parallel_rpc_port + 2 * here.stop)
        self._ready: list[Ready | None] = [None] * num_replicas
        self._stats: dict[int, list[EngineStats | None]] = {}  # call id -> each replica's reply so far
        self._receiving: dict[int, asyncio.Future] = {}  # replica -> its socket's receive in flight
        self._outputs: deque[EngineOutput] = deque()

    # ---- to the engines ------------------------------------------------------------------------------------
    def send(self, message: EngineInput) -> bool:
        """False when a replica it goes to has no reader (not started yet, or gone), as EngineCoreClient.send."""
        if isinstance(message, AddRequest):
            replica = self.router.route(message.request_id, message.prompt_token_ids, message.cache_salt,
                                        message.parent_id)
            sent = self.replicas[replica].send(message)
            if not sent:
                self.router.release([message.request_id])
            return sent
        if isinstance(message, AbortRequests | FinishRequests):
            # Both end the requests in the engine (a finish sends nothing back): they stop counting now.
            groups = self.router.by_replica(message.request_ids)
            self.router.release(message.request_ids)
            sent = [self.replicas[r].send(type(message)(ids)) for r, ids in groups.items()]  # all of them, even after one fails
            return all(sent)
        if isinstance(message, GetStats):
            self._stats[message.call_id] = [None] * len(self.replicas)
            while len(self._stats) > MAX_PENDING_STATS_CALLS:
                del self._stats[next(iter(self._stats))]
        sent = [replica.send(message) for replica in self.replicas]  # GetStats, Shutdown: to every replica
        return all(sent)

    # ---- from the engines ----------------------------------------------------------------------------------
    async def recv(self) -> EngineOutput:
        while not self._outputs:
            for index, replica in enumerate(self.replicas):
                if index not in self._receiving:
                    self._receiving[index] = replica.next_frame()
            try:
                await asyncio.wait(self._receiving.values(), return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                # Receives not yet done are cancelled, their messages left in the sockets; done ones are kept.
                for index, future in list(self._receiving.items()):
                    if not future.done() or future.cancelled():
                        future.cancel()
                        del self._receiving[index]
                raise
            for index, future in sorted(self._receiving.items()):
                if future.done():
                    del self._receiving[index]
                    self._take(index, self.replicas[index].decode(future.result()))
        return self._outputs.popleft()

    def _take(self, index: int, message: EngineOutput) -> None:
        """One replica's message: passed on, merged with the others', or held until they all have answered."""
        if isinstance(message, StepOutputs):
            self.router.release(o.request_id for o in message.outputs if o.finish_reason is not None)
            if message.step is not None:
                message.step.engine = index
            self._outputs.append(message)
        elif isinstance(message, StatsReply):
            replies = self._stats.get(message.call_id)
            if replies is None:
                return  # a call given up on
            replies[index] = message.stats
            if all(r is not None for r in replies):
                del self._stats[message.call_id]
                self._outputs.append(StatsReply(message.call_id, sum_engine_stats(replies)))
        elif isinstance(message, Ready):
            logger.info("engine replica %d ready: %d KV blocks", index, message.num_blocks)
            self._ready[index] = message
            if all(r is not None for r in self._ready):
                total_blocks = sum(r.num_blocks for r in self._ready)
                self._outputs.append(msgspec.structs.replace(message, num_blocks=total_blocks))
        elif isinstance(message, RequestRejected):
            self.router.release([message.request_id])
            self._outputs.append(message)
        elif isinstance(message, EngineFailed):
            self._outputs.append(EngineFailed(f"replica {index}: {message.message}"))

    # ---- lifecycle -----------------------------------------------------------------------------------------
    @property
    def is_alive(self) -> bool:
        return all(replica.is_alive for replica in self.replicas)

    def exit_description(self) -> str:
        for index, replica in enumerate(self.replicas):
            if not replica.is_alive:
                return f"{replica.exit_description()} (replica {index} of {len(self.replicas)})"
        return "no engine replica has died"

    @property
    def exitcode(self) -> int | None:
        """The first gone replica's exit code (None while all run, or for one on another machine)."""
        return next((replica.exitcode for replica in self.replicas if not replica.is_alive), None)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stops every replica at once (a slow one does not hold up the others' stop)."""
        if not self.replicas:
            return
        with ThreadPoolExecutor(len(self.replicas), thread_name_prefix="lmserve-dp-shutdown") as pool:
            for future in [pool.submit(replica.shutdown, timeout) for replica in self.replicas]:
                try:
                    future.result()
                except Exception:  # the others still stop; this one is a daemon process and dies with us
                    logger.exception("a replica's shutdown failed")
