"""A hybrid model's state slots in the engine (engine/kv_cache.py's StateSlots): a request takes one at admission
beside its blocks and holds it until it finishes, is aborted or is preempted; one that cannot get a slot waits as one
that cannot get blocks; every scheduled row names its request's slot; and prefix caching is off for such a model."""

from __future__ import annotations

import logging

import pytest
from test_scheduler import FakeRunner, assert_all_free, make_request, run_to_completion, shares, step

from lmserve.config import CacheConfig, SchedulerConfig
from lmserve.engine.request import RequestStatus
from lmserve.engine.scheduler import Scheduler


def hybrid_scheduler(num_state_slots: int, budget: int = 64, max_num_seqs: int = 16, num_blocks: int = 64,
                     block_size: int = 4) -> Scheduler:
    return Scheduler(SchedulerConfig(budget, max_num_seqs), CacheConfig(block_size=block_size), num_blocks, 1024,
                     num_state_slots=num_state_slots)


def assert_no_slot_held(sched: Scheduler) -> None:
    slots = sched.kv_cache_manager.state_slots
    assert slots is not None and not slots.owners and slots.num_free == slots.num_slots
    assert_all_free(sched)


def test_a_request_without_a_free_slot_waits_and_takes_the_slot_freed_by_a_finish() -> None:
    sched = hybrid_scheduler(num_state_slots=2)
    for rid, n in (("a", 2), ("b", 4), ("c", 3)):
        sched.add_request(make_request(rid, [1, 2, 3], max_tokens=n))
    out, _ = step(sched)
    assert shares(out) == {"a": 3, "b": 3}  # c has blocks enough but no slot: it waits
    assert {s.request_id: s.state_slot for s in out.scheduled} == {"a": 0, "b": 1}
    assert [r.request_id for r in sched.waiting] == ["c"]
    step(sched)  # a finishes (its 2nd token): its slot is free for the next step
    assert "a" not in sched.requests and sched.kv_cache_manager.state_slot("a") == -1
    out, _ = step(sched)
    assert {s.request_id: s.state_slot for s in out.scheduled} == {"b": 1, "c": 0}
    run_to_completion(sched, FakeRunner())
    assert_no_slot_held(sched)


def test_aborts_free_the_slot_at_once() -> None:
    sched = hybrid_scheduler(num_state_slots=1)
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=50))
    sched.add_request(make_request("b", [4, 5], max_tokens=2))
    out, _ = step(sched)
    assert shares(out) == {"a": 3}
    sched.abort_requests(["a"])
    out, _ = step(sched)
    assert {s.request_id: (s.state_slot, s.start_position) for s in out.scheduled} == {"b": (0, 0)}
    sched.abort_requests(["a", "b", "b"])  # idempotent, unknown ids ignored
    assert_no_slot_held(sched)


def test_preemption_frees_the_slot_and_the_victim_starts_from_position_0_with_a_slot_again() -> None:
    # 4 blocks of 4: two 4-token prompts fill the pool after 4 decodes each; then the later one is preempted.
    sched = hybrid_scheduler(num_state_slots=2, num_blocks=4)
    sched.add_request(make_request("early", [1, 2, 3, 4], max_tokens=8, arrival=0.0))
    sched.add_request(make_request("late", [5, 6, 7, 8], max_tokens=8, arrival=1.0))
    runner = FakeRunner()
    resumed = None
    preempted = False
    for _ in range(60):
        if not sched.has_unfinished_requests():
            break
        out, _ = step(sched, runner)
        if out.preempted_request_ids:
            assert out.preempted_request_ids == {"late"}
            assert sched.kv_cache_manager.state_slot("late") == -1  # freed with its blocks
            assert sched.requests["late"].status == RequestStatus.PREEMPTED
            preempted = True
        for s in out.scheduled:
            assert s.state_slot >= 0
            if preempted and s.request_id == "late" and resumed is None:
                resumed = s
    assert preempted and resumed is not None and resumed.start_position == 0  # recomputes its state
    assert_no_slot_held(sched)


def test_every_row_names_its_own_slot_and_no_slot_is_shared() -> None:
    sched = hybrid_scheduler(num_state_slots=3, budget=8, max_num_seqs=4)
    for i in range(6):
        sched.add_request(make_request(f"r{i}", list(range(10 + i)), max_tokens=3 + i % 3))
    while sched.has_unfinished_requests():
        out, _ = step(sched)
        slots = [s.state_slot for s in out.scheduled]
        assert all(0 <= slot < 3 for slot in slots) and len(set(slots)) == len(slots)
        held = sched.kv_cache_manager.state_slots.owners
        assert set(held) == {r.request_id for r in sched.running}
    assert_no_slot_held(sched)


@pytest.mark.parametrize(("budget", "expected_chunks"), [(6, [4, 4, 2]), (12, [10])])
def test_the_budget_example_holds_for_a_hybrid_model(budget: int, expected_chunks: list[int]) -> None:
    sched = hybrid_scheduler(num_state_slots=4, budget=budget, block_size=16)
    sched.add_request(make_request("a", [1]))
    sched.add_request(make_request("b", [2]))
    step(sched)
    sched.add_request(make_request("p", list(range(100, 110))))
    chunks = []
    for _ in expected_chunks:
        out, _ = step(sched)
        assert shares(out)["a"] == 1 and shares(out)["b"] == 1
        chunks.append(shares(out)["p"])
        assert {s.request_id: s.state_slot for s in out.scheduled}["p"] == 2  # the same slot for every chunk
    assert chunks == expected_chunks


def test_prefix_caching_is_off_for_a_hybrid_model_and_the_log_says_so(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="lmserve.engine.scheduler"):
        sched = hybrid_scheduler(num_state_slots=2, block_size=4)
    assert "prefix caching is off for this hybrid" in caplog.text
    prompt = list(range(20))
    sched.add_request(make_request("a", prompt, max_tokens=1))
    run_to_completion(sched, FakeRunner())
    sched.add_request(make_request("b", prompt, max_tokens=1))
    out, _ = step(sched)
    assert shares(out) == {"b": 20} and out.scheduled[0].start_position == 0  # no hit: the state must be computed
    assert_no_slot_held(sched)


def test_prefix_caching_setting_is_honoured_for_other_models() -> None:
    """(The manager used to be built without the setting, so --no-enable-prefix-caching was ignored.)"""
    sched = Scheduler(SchedulerConfig(64, 16), CacheConfig(block_size=4, enable_prefix_caching=False), 64, 1024)
    assert not sched.kv_cache_manager.enable_prefix_caching and sched.kv_cache_manager.state_slots is None
