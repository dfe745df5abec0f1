"""Pooling requests (embeddings) in the scheduler: a prompt with no decode, through the same token budget and
max_num_seqs, each run whole in one step, never holding a KV block, ended by its vector."""

from __future__ import annotations

import pytest

from lmserve.config import CacheConfig, SchedulerConfig
from lmserve.engine.request import Request, RequestStatus
from lmserve.engine.scheduler import Scheduler
from lmserve.pooling_params import PoolingParams
from lmserve.sampling_params import SamplingParams
from lmserve.step import ModelRunnerOutput, SchedulerOutput


def pooling_scheduler(budget: int = 16, max_num_seqs: int = 8, threshold: int = 0,
                      async_scheduling: bool = False) -> Scheduler:
    # A pooling runner reports no KV blocks at all.
    return Scheduler(SchedulerConfig(budget, max_num_seqs, threshold, async_scheduling=async_scheduling),
                     CacheConfig(block_size=4), num_blocks=0, max_model_len=64, pooling=True)


def pooling_request(rid: str, num_tokens: int) -> Request:
    return Request(rid, list(range(1, num_tokens + 1)), SamplingParams(max_tokens=1), pooling_params=PoolingParams())


def run_step(scheduler: Scheduler) -> tuple[SchedulerOutput, dict[str, bytes]]:
    plan = scheduler.schedule()
    vectors = {s.request_id: bytes([len(s.token_ids)]) * 4 for s in plan.scheduled}
    outputs = scheduler.update_from_output(plan, ModelRunnerOutput(sampled_token_ids={}, pooled=vectors))
    return plan, {o.request_id: o.pooled for o in outputs if o.pooled is not None}


def test_each_prompt_runs_whole_in_one_step_within_the_budget_and_ends_with_its_vector() -> None:
    scheduler = pooling_scheduler(budget=16)
    for rid, n in (("a", 6), ("b", 7), ("c", 5)):
        scheduler.add_request(pooling_request(rid, n))
    plan, vectors = run_step(scheduler)
    # a and b fit the 16 positions together; c (5 more) would not, and is never cut into chunks.
    assert [(s.request_id, s.start_position, s.num_tokens) for s in plan.scheduled] == [("a", 0, 6), ("b", 0, 7)]
    assert all(not s.samples and s.block_ids == [] and s.pooling_params is not None for s in plan.scheduled)
    assert vectors == {"a": bytes([6]) * 4, "b": bytes([7]) * 4}
    plan, vectors = run_step(scheduler)
    assert [s.request_id for s in plan.scheduled] == ["c"] and set(vectors) == {"c"}
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.num_used_blocks == 0


def test_a_prompt_longer_than_the_budget_runs_alone_not_never() -> None:
    scheduler = pooling_scheduler(budget=8, threshold=4)  # the long-prefill cap does not cut a pooling prompt
    scheduler.add_request(pooling_request("short", 3))
    scheduler.add_request(pooling_request("long", 20))
    plan, _ = run_step(scheduler)
    assert [(s.request_id, s.num_tokens) for s in plan.scheduled] == [("short", 3)]
    plan, vectors = run_step(scheduler)
    assert [(s.request_id, s.num_tokens) for s in plan.scheduled] == [("long", 20)] and set(vectors) == {"long"}


def test_max_num_seqs_caps_a_step() -> None:
    scheduler = pooling_scheduler(budget=64, max_num_seqs=2)
    for i in range(5):
        scheduler.add_request(pooling_request(f"r{i}", 2))
    sizes = []
    while scheduler.has_unfinished_requests():
        plan, _ = run_step(scheduler)
        sizes.append(len(plan.scheduled))
    assert sizes == [2, 2, 1]


def test_abort_of_a_waiting_pooling_request_and_a_step_in_flight() -> None:
    scheduler = pooling_scheduler(budget=4)
    scheduler.add_request(pooling_request("a", 4))
    scheduler.add_request(pooling_request("b", 4))
    plan = scheduler.schedule()
    assert [s.request_id for s in plan.scheduled] == ["a"]
    scheduler.abort_requests(["a", "b"])  # a while its step computes, b while it waits
    outputs = scheduler.update_from_output(plan, ModelRunnerOutput(sampled_token_ids={}, pooled={"a": b"1234"}))
    assert outputs == [] and not scheduler.has_unfinished_requests()


def test_async_scheduling_never_plans_a_pooling_request_twice() -> None:
    scheduler = pooling_scheduler(budget=16, async_scheduling=True)
    scheduler.add_request(pooling_request("a", 4))
    first = scheduler.schedule()
    second = scheduler.schedule()  # planned while the first computes
    assert [s.request_id for s in first.scheduled] == ["a"] and second.scheduled == []
    outputs = scheduler.update_from_output(first, ModelRunnerOutput(sampled_token_ids={}, pooled={"a": b"1234"}))
    assert [o.request_id for o in outputs] == ["a"] and outputs[0].finish_reason == RequestStatus.FINISHED_STOPPED.value


def test_requests_of_the_wrong_kind_are_refused() -> None:
    with pytest.raises(ValueError, match="embedding model"):
        pooling_scheduler().add_request(Request("gen", [1, 2], SamplingParams(max_tokens=4)))
    generating = Scheduler(SchedulerConfig(16, 8), CacheConfig(block_size=4), num_blocks=16, max_model_len=64)
    with pytest.raises(ValueError, match="generates text"):
        generating.add_request(pooling_request("emb", 3))
