"""Data-parallel routing and the DP client's bookkeeping, without processes: the router alone, and the client over
fake replicas (what it sends where, what it passes on, how it merges)."""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from typing import Any

import pytest

from lmserve.config import make_engine_config
from lmserve.engine.dp_client import DataParallelClient, replica_config
from lmserve.engine.dp_router import LOAD_SLACK, DataParallelRouter, prompt_block_hashes
from lmserve.engine.kv_cache import KVCacheManager
from lmserve.engine.messages import (
    AbortRequests,
    AddRequest,
    EngineFailed,
    FinishRequests,
    GetStats,
    Ready,
    StatsReply,
    StepOutputs,
)
from lmserve.engine.outputs import EngineCoreOutput
from lmserve.engine.request import Request
from lmserve.metrics.stats import EngineStats, StepRecord
from lmserve.sampling_params import SamplingParams

BS = 16
SHARED = list(range(1000, 1064))  # 4 full blocks


def test_prompt_hashes_are_the_kv_cache_managers() -> None:
    """Routing and caching agree on what a block is: same tokens, same salt, same hash."""
    tokens = SHARED + [7, 8, 9]
    for salt in (None, "tenant-a"):
        request = Request("r", tokens, SamplingParams(max_tokens=1), cache_salt=salt)
        manager = KVCacheManager(num_blocks=16, block_size=BS)
        assert prompt_block_hashes(tokens, BS, salt) == manager._block_hashes(request, request.all_token_ids)
    assert prompt_block_hashes(tokens, BS, "a") != prompt_block_hashes(tokens, BS, "b")
    assert prompt_block_hashes(tokens[:BS - 1], BS) == []


def test_routing_rules() -> None:
    router = DataParallelRouter(3, BS)
    assert router.route("a", SHARED[:32] + [1] * 20) == 0  # idle server: replica 0 first
    assert router.route("b", [5] * 40) == 1  # nothing shared: least loaded
    assert router.route("c", [6] * 40) == 2
    # d shares a's first two blocks: replica 0, though it is no less loaded than the others.
    assert router.route("d", SHARED + [3]) == 0
    # e shares all four blocks of d (the deepest remembered one, on replica 0).
    assert router.route("e", SHARED + [4, 4]) == 0
    # Shorter than a block: no hash to match, least loaded (1 and 2 have one each, 0 has three).
    assert router.route("f", [1, 2, 3]) == 1
    assert router.in_flight == [3, 2, 1]
    router.release(["a", "d", "e", "e"])  # idempotent
    assert router.in_flight == [0, 2, 1]
    assert router.route("g", [9] * 40) == 0


def test_a_shared_system_prompt_spreads_over_the_replicas() -> None:
    """Every chat without a system message starts with the template's default one (more than a block): followed
    alone, the prefix sent all of them to one replica. Within LOAD_SLACK requests of the least loaded a prefix still
    wins; past it the least loaded replica takes the request (and then holds the prefix too)."""
    router = DataParallelRouter(2, BS)
    replicas = [router.route(f"chat{i}", SHARED + [100 + i] * 5) for i in range(32)]
    assert set(replicas) == {0, 1} and min(Counter(replicas).values()) >= 16 - LOAD_SLACK
    assert max(router.in_flight) - min(router.in_flight) <= LOAD_SLACK
    assert replicas[: LOAD_SLACK + 1] == [0] * (LOAD_SLACK + 1)  # the prefix holds while the slack allows
    # With the load even, the prefix decides again: its latest holder takes a follower.
    router.release([f"chat{i}" for i in range(32)])
    owner = router.longest_prefix_owner(prompt_block_hashes(SHARED, BS))
    assert router.route("later", SHARED + [7]) == owner


def test_the_deepest_remembered_block_wins() -> None:
    """A chained hash stands for its whole prefix: the replica that got block 2 of this prompt has blocks 1-2,
    whoever got block 1 alone since (possible once the LRU map dropped and relearned it)."""
    router = DataParallelRouter(3, BS)
    hashes = prompt_block_hashes(SHARED, BS)
    router.block_owner.update({hashes[0]: 1, hashes[1]: 2})
    assert router.longest_prefix_owner(hashes) == 2
    assert router.route("a", SHARED + [1]) == 2
    assert all(router.block_owner[h] == 2 for h in hashes)  # all its blocks now point at where it went


def test_cache_salt_keeps_prefixes_apart() -> None:
    router = DataParallelRouter(2, BS)
    assert router.route("a", SHARED, cache_salt="t1") == 0
    assert router.route("b", SHARED, cache_salt="t2") == 1  # other salt: no match, least loaded
    assert router.route("c", SHARED, cache_salt="t2") == 1


def test_no_prefix_caching_means_least_loaded_only() -> None:
    router = DataParallelRouter(2, BS, enable_prefix_caching=False)
    assert [router.route(r, SHARED) for r in "abcd"] == [0, 1, 0, 1]
    assert not router.block_owner


def test_remembered_blocks_are_bounded_lru() -> None:
    router = DataParallelRouter(2, BS, max_remembered_blocks=8)
    for i in range(20):
        router.route(f"r{i}", [i] * (2 * BS))
        assert len(router.block_owner) <= 8
    assert len(router.block_owner) == 8
    newest = prompt_block_hashes([19] * (2 * BS), BS)
    assert all(h in router.block_owner for h in newest)
    assert not any(h in router.block_owner for h in prompt_block_hashes([0] * (2 * BS), BS))


def test_children_of_one_request_stay_together() -> None:
    router = DataParallelRouter(2, BS)
    # A prompt shorter than a block has no hash: without the parent rule the second child would go to replica 1.
    assert [router.route(f"p-{i}", [1, 2], parent_id="p") for i in range(3)] == [0, 0, 0]
    router.release(["p-0", "p-1", "p-2"])
    assert router.parents == {} and router.child_parent == {}
    router.route("q", [5])
    assert router.route("p2-0", [1, 2], parent_id="p2") == 1


def test_by_replica_groups_in_flight_ids_only() -> None:
    router = DataParallelRouter(2, BS)
    router.route("a", [1])
    router.route("b", [2])
    assert router.by_replica(["a", "b", "gone"]) == {0: ["a"], 1: ["b"]}


@pytest.mark.parametrize(("cpus", "dp", "threads", "expected"), [
    (8, 2, None, [[0, 1, 2, 3], [4, 5, 6, 7]]),
    (2, 4, None, [[0], [1], [0], [1]]),  # fewer CPUs than replicas: one each, in turn
    (8, 2, 3, [list(range(8))] * 2),  # --engine-threads given: as the user said
])
def test_each_replica_gets_its_own_share_of_the_cpus(cpus: int, dp: int, threads: int | None,
                                                     expected: list[list[int]]) -> None:
    config = make_engine_config(data_parallel_size=dp, engine_threads=threads, engine_cpus=f"0-{cpus - 1}")
    placements = [replica_config(config, i).placement for i in range(dp)]
    assert [p.engine_cpus for p in placements] == expected
    assert all(p.engine_threads == threads for p in placements)
    assert config.placement.engine_threads == threads  # the server's own config is left as it was


def test_the_ranks_of_a_replica_split_its_share() -> None:
    """-dp 2 -tp 2 on 8 CPUs: each rank pinned to 2 CPUs of its own with 2 threads, 8 threads in all (each rank took
    cpus / dp = 4 threads on every CPU before: 16 threads on 8 cores)."""
    from lmserve.worker.worker import rank_placement

    config = make_engine_config(data_parallel_size=2, tensor_parallel_size=2, engine_cpus="0-7")
    seen = []
    for replica in range(2):
        for rank in range(2):
            placement = rank_placement(replica_config(config, replica), rank)
            seen.append((placement.engine_cpus, placement.engine_threads))
    assert seen == [([0, 1], 2), ([2, 3], 2), ([4, 5], 2), ([6, 7], 2)]


def test_ranks_on_several_machines_split_their_own_machines_cpus() -> None:
    """-tp 4 --nnodes 2: ranks 0-1 on node 0 and ranks 2-3 on node 1 each take half of their machine's 8 CPUs."""
    from lmserve.worker.worker import rank_placement

    config = make_engine_config(tensor_parallel_size=4, nnodes=2, engine_cpus="0-7")
    seen = [rank_placement(config, rank) for rank in range(4)]
    assert [(p.engine_cpus, p.engine_threads) for p in seen] == [([0, 1, 2, 3], 4), ([4, 5, 6, 7], 4)] * 2


# ------------------------------------------------------------------------------------------------ the client


class FakeReplica:
    """An EngineCoreClient without a process: records what it is sent; `emit` queues a message to receive."""

    def __init__(self) -> None:
        self.sent: list[Any] = []
        self.frames: asyncio.Queue = asyncio.Queue()
        self.alive = True

    def send(self, message: Any) -> bool:
        self.sent.append(message)
        return True

    def next_frame(self) -> asyncio.Future:
        return asyncio.ensure_future(self.frames.get())

    def decode(self, frame: Any) -> Any:
        return frame

    def emit(self, message: Any) -> None:
        self.frames.put_nowait(message)


def fake_client(num_replicas: int) -> tuple[DataParallelClient, list[FakeReplica]]:
    client = DataParallelClient.__new__(DataParallelClient)
    replicas = [FakeReplica() for _ in range(num_replicas)]
    client.router = DataParallelRouter(num_replicas, BS)
    client.replicas = replicas  # type: ignore[assignment]
    client._ready = [None] * num_replicas
    client._stats = {}
    client._receiving = {}
    client._outputs = deque()
    return client, replicas


def add(request_id: str, tokens: list[int], parent_id: str | None = None) -> AddRequest:
    return AddRequest(request_id, tokens, SamplingParams(max_tokens=4), [], 0, 0.0, parent_id)


def step(index: int) -> StepRecord:
    return StepRecord(index, 0.0, 0.1, 0.05, {}, {}, [], 1, 0)


def test_client_routes_aborts_and_finishes_to_the_owner_and_merges_what_comes_back() -> None:
    async def scenario() -> None:
        client, replicas = fake_client(2)
        assert client.send(add("a", SHARED))
        assert client.send(add("b", [5] * 40))
        assert client.send(add("c", SHARED + [1]))  # a's prefix: replica 0
        assert [[m.request_id for m in r.sent] for r in replicas] == [["a", "c"], ["b"]]

        # Ready once, when both are: with the replicas' blocks added up.
        replicas[0].emit(Ready(512, 100, 10, BS))
        replicas[1].emit(StepOutputs([EngineCoreOutput("b", [1])], step=step(7)))
        out = await client.recv()
        assert isinstance(out, StepOutputs) and out.step.engine == 1
        replicas[1].emit(Ready(512, 100, 12, BS))
        ready = await client.recv()
        assert isinstance(ready, Ready) and ready.num_blocks == 22

        assert client.send(AbortRequests(["a", "b", "unknown"]))
        assert client.send(FinishRequests(["c"]))
        assert replicas[0].sent[2:] == [AbortRequests(["a"]), FinishRequests(["c"])]
        assert replicas[1].sent[1:] == [AbortRequests(["b"])]
        assert client.router.in_flight == [0, 0]

        client.send(add("d", [9] * 3))
        replicas[0].emit(StepOutputs([EngineCoreOutput("d", [1], finish_reason="length")], step=step(3)))
        assert (await client.recv()).step.engine == 0
        assert client.router.in_flight == [0, 0]

        # Stats: asked of every replica, answered once with the sums and each replica's own.
        assert client.send(GetStats(5, ["d"]))
        assert all(isinstance(r.sent[-1], GetStats) for r in replicas)
        replicas[0].emit(StatsReply(5, EngineStats(kv_blocks_total=10, kv_blocks_used=4, prefix_cache_hits=32,
                                                   request_status={"d": "running"}, request_positions={"d": 3})))
        replicas[1].emit(StatsReply(5, EngineStats(kv_blocks_total=12, kv_blocks_used=1,
                                                   request_status={"d": "gone"}, request_positions={"d": 0})))
        reply = await client.recv()
        assert isinstance(reply, StatsReply) and reply.call_id == 5
        stats = reply.stats
        assert (stats.kv_blocks_total, stats.kv_blocks_used, stats.prefix_cache_hits) == (22, 5, 32)
        assert stats.kv_cache_usage_perc == pytest.approx(5 / 22)
        assert stats.request_status == {"d": "running"} and stats.request_positions == {"d": 3}
        assert [e.kv_blocks_used for e in stats.engines] == [4, 1]

        replicas[1].emit(EngineFailed("boom"))
        failed = await client.recv()
        assert isinstance(failed, EngineFailed) and failed.message == "replica 1: boom"

    asyncio.run(scenario())


def test_a_cancelled_recv_loses_no_message() -> None:
    async def scenario() -> None:
        client, replicas = fake_client(2)
        waiting = asyncio.ensure_future(client.recv())
        await asyncio.sleep(0.01)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        replicas[1].emit(StepOutputs([], step=step(1)))
        out = await asyncio.wait_for(client.recv(), 1)
        assert out.step.engine == 1

    asyncio.run(scenario())


def test_offline_llm_refuses_data_parallel() -> None:
    from lmserve import LLM

    with pytest.raises(ValueError, match=r"server feature.*lmserve serve -dp 2"):
        LLM(data_parallel_size=2)


def test_each_replica_gets_gpus_of_its_own() -> None:
    """-dp 2 -tp 2 on 4 GPUs: replica 0's ranks on GPUs 0-1, replica 1's on 2-3 (every replica took GPUs 0-1 before:
    `rank % device_count`); more replicas than the GPUs allow wrap around."""
    config = make_engine_config(data_parallel_size=2, tensor_parallel_size=2)
    replicas = [replica_config(config, i).parallel for i in range(2)]
    assert [p.data_parallel_rank for p in replicas] == [0, 1] and config.parallel.data_parallel_rank == 0
    gpus = [p.cuda_device(rank, 4) for p in replicas for rank in range(2)]  # what worker.Worker asks
    assert gpus == [0, 1, 2, 3] and replicas[0].gpus_shared(4) is None
    wrapped = [replica_config(make_engine_config(data_parallel_size=4), r).parallel for r in range(4)]
    assert [p.cuda_device(0, 2) for p in wrapped] == [0, 1, 0, 1]
    assert "4 replica(s) of 1 rank(s) on this machine share its 2 GPU(s)" in wrapped[0].gpus_shared(2)


def test_a_machine_running_later_replicas_gives_them_its_gpus_from_the_first() -> None:
    """Replicas 2 and 3 of -dp 4 -tp 2 on a second machine with 8 GPUs: GPUs 0-3, as on the first machine (before,
    counted from the global replica index: 4-7, or wrapped onto each other with other counts)."""
    config = make_engine_config(data_parallel_size=4, tensor_parallel_size=2, data_parallel_size_local=2,
                                data_parallel_start_rank=2, data_parallel_address="10.0.0.1")
    replicas = [replica_config(config, i).parallel for i in config.parallel.local_replicas]
    assert [p.cuda_device(rank, 8) for p in replicas for rank in range(2)] == [0, 1, 2, 3]
    assert [p.cuda_device(rank, 6) for p in replicas for rank in range(2)] == [0, 1, 2, 3]
    assert replicas[0].gpus_shared(8) is None and replicas[0].gpus_shared(2) is not None
