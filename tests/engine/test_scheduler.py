"""Scheduler: the token budget, admission, preemption, policies, finishing and aborts, without a model."""

from __future__ import annotations

import itertools
import random
from collections import Counter, deque
from collections.abc import Callable

import pytest

from lmserve.config import CacheConfig, SchedulerConfig
from lmserve.engine.grammar import GrammarManager
from lmserve.engine.outputs import EngineCoreOutput
from lmserve.engine.request import Request, RequestStatus
from lmserve.engine.scheduler import Scheduler
from lmserve.kv_groups import KVCacheGroups, kv_cache_groups
from lmserve.sampling_params import SamplingParams
from lmserve.step import ModelRunnerOutput, ScheduledRequest, SchedulerOutput

_arrivals = itertools.count()


def make_scheduler(
    budget: int = 64,
    max_num_seqs: int = 16,
    threshold: int = 0,
    policy: str = "fcfs",
    num_blocks: int = 64,
    block_size: int = 4,
    max_model_len: int = 1024,
    caching: bool = True,
    grammar: GrammarManager | None = None,
    async_scheduling: bool = False,
    kv_groups: KVCacheGroups | None = None,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(budget, max_num_seqs, threshold, policy, async_scheduling=async_scheduling),
        CacheConfig(block_size=block_size, enable_prefix_caching=caching),
        num_blocks,
        max_model_len,
        grammar,
        kv_groups=kv_groups,
    )


def make_request(
    rid: str,
    prompt: list[int],
    max_tokens: int | None = 100,
    priority: int = 0,
    arrival: float | None = None,
    eos: int | None = None,
    **params: object,
) -> Request:
    return Request(
        rid,
        list(prompt),
        SamplingParams(max_tokens=max_tokens, **params),
        eos_token_ids=[] if eos is None else [eos],
        priority=priority,
        arrival_time=float(next(_arrivals)) if arrival is None else arrival,
    )


class FakeRunner:
    """Returns a token for every scheduled request that samples (by default 1000, 1001, ... in order)."""

    def __init__(self, token_for: Callable[[ScheduledRequest], int] | None = None) -> None:
        counter = itertools.count(1000)
        self.token_for = token_for or (lambda _: next(counter))

    def __call__(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return ModelRunnerOutput({s.request_id: self.token_for(s) for s in out.scheduled if s.samples})


def step(
    sched: Scheduler, runner: FakeRunner | None = None
) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    out = sched.schedule()
    return out, sched.update_from_output(out, (runner or FakeRunner())(out))


def shares(out: SchedulerOutput) -> dict[str, int]:
    return {s.request_id: s.num_tokens for s in out.scheduled}


def run_to_completion(sched: Scheduler, runner: FakeRunner, max_steps: int = 200) -> dict[str, list[int]]:
    streamed: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return streamed
        for o in step(sched, runner)[1]:
            streamed.setdefault(o.request_id, []).extend(o.new_token_ids)
    raise AssertionError("requests did not finish")


def assert_all_free(sched: Scheduler) -> None:
    kv = sched.kv_cache_manager
    assert kv.ref_counts() == [0] * kv.num_blocks and kv.num_used_blocks == 0 and not kv.tables


# ---- the token budget ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("budget", "expected_chunks"), [(6, [4, 4, 2]), (12, [10])])
def test_budget_example(budget: int, expected_chunks: list[int]) -> None:
    sched = make_scheduler(budget=budget, block_size=16)
    sched.add_request(make_request("a", [1]))
    sched.add_request(make_request("b", [2]))
    out, _ = step(sched)
    assert shares(out) == {"a": 1, "b": 1}

    p = make_request("p", list(range(100, 110)))
    sched.add_request(p)
    chunks = []
    for iteration in range(1, len(expected_chunks) + 1):
        out, results = step(sched)
        got = shares(out)
        assert got["a"] == 1 and got["b"] == 1  # both decodes get a token in every iteration
        chunks.append(got["p"])
        assert {o.request_id for o in results} >= {"a", "b"}
        last = iteration == len(expected_chunks)
        assert ("p" in {o.request_id for o in results}) == last
        assert [s.samples for s in out.scheduled if s.request_id == "p"] == [last]
    assert chunks == expected_chunks
    assert p.num_output_tokens == 1 and p.num_computed_tokens == 10


def test_chunks_carry_positions_and_tokens() -> None:
    sched = make_scheduler(budget=4)
    prompt = list(range(10, 20))
    sched.add_request(make_request("p", prompt))
    starts = []
    for _ in range(3):
        out, _ = step(sched)
        (s,) = out.scheduled
        assert s.token_ids == prompt[s.start_position : s.start_position + s.num_tokens]
        starts.append(s.start_position)
    assert starts == [0, 4, 8]


def test_long_prefill_threshold_lets_prefills_share_a_step() -> None:
    sched = make_scheduler(budget=100, threshold=4)
    sched.add_request(make_request("d", [1]))
    step(sched)
    sched.add_request(make_request("p", list(range(10))))
    sched.add_request(make_request("q", list(range(20, 30))))
    history = [shares(step(sched)[0]) for _ in range(3)]
    assert history == [{"d": 1, "p": 4, "q": 4}, {"d": 1, "p": 4, "q": 4}, {"d": 1, "p": 2, "q": 2}]


def test_max_num_seqs_caps_the_running_set() -> None:
    sched = make_scheduler(max_num_seqs=2)
    for rid in "abc":
        sched.add_request(make_request(rid, [1, 2], max_tokens=2))
    out, _ = step(sched)
    assert set(shares(out)) == {"a", "b"} and sched.num_running == 2 and sched.num_waiting == 1
    step(sched)  # a and b finish
    out, _ = step(sched)
    assert set(shares(out)) == {"c"}


@pytest.mark.parametrize(
    ("policy", "expected"), [("fcfs", ["p3", "p1", "p2", "p1b"]), ("priority", ["p1", "p1b", "p2", "p3"])]
)
def test_policy_order(policy: str, expected: list[str]) -> None:
    sched = make_scheduler(policy=policy, max_num_seqs=1)
    for rid, prio in [("p3", 3), ("p1", 1), ("p2", 2), ("p1b", 1)]:
        sched.add_request(make_request(rid, [1, 2, 3], max_tokens=1, priority=prio))
    order = []
    while sched.has_unfinished_requests():
        order += [s.request_id for s in step(sched)[0].scheduled]
    assert order == expected


def test_admission_needs_the_whole_prompt_and_is_head_of_line() -> None:
    sched = make_scheduler(budget=4, num_blocks=4, block_size=4)
    sched.add_request(make_request("a", [1, 2, 3, 4, 5], max_tokens=1))  # 2 blocks
    sched.add_request(make_request("big", list(range(12))))  # 3 blocks: does not fit beside a
    sched.add_request(make_request("small", [9]))  # would fit, but waits behind big
    out, _ = step(sched)
    assert shares(out) == {"a": 4}  # a's first chunk; its whole prompt's blocks are taken
    out, _ = step(sched)
    assert shares(out) == {"a": 1}  # a finishes
    out, _ = step(sched)
    assert shares(out) == {"big": 4}
    assert [r.request_id for r in sched.waiting] == ["small"]  # big's 3 blocks leave 1: small fits now
    out, _ = step(sched)
    assert shares(out) == {"big": 4}  # the budget is spent by big, so small still waits


def test_prompt_longer_than_max_model_len_is_rejected() -> None:
    sched = make_scheduler(max_model_len=40)
    with pytest.raises(ValueError, match=r"50.*40"):
        sched.add_request(make_request("r", list(range(50))))
    small_pool = make_scheduler(num_blocks=2, block_size=4, max_model_len=100)
    with pytest.raises(ValueError, match=r"9.*8"):
        small_pool.add_request(make_request("r", list(range(9))))
    with pytest.raises(ValueError):
        sched.add_request(make_request("empty", []))
    sched.add_request(make_request("ok", list(range(40)), max_tokens=5))
    _, results = step(sched)
    assert results[0].finish_reason == "length"  # a prompt of exactly max_model_len gets one token


# ---- prefix cache through the scheduler ----------------------------------------------------------------------


def test_prefix_hit_second_request() -> None:
    sched = make_scheduler(block_size=16)
    prompt = list(range(40))
    sched.add_request(make_request("x", prompt, max_tokens=1))
    step(sched)
    y = make_request("y", prompt)
    sched.add_request(y)
    out, results = step(sched)
    (s,) = out.scheduled
    assert (s.start_position, s.token_ids, s.samples) == (32, prompt[32:], True)
    assert y.num_cached_tokens == 32 and results[0].num_cached_tokens == 32
    kv = sched.kv_cache_manager
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (80, 32)


def test_full_prompt_hit_recomputes_last_position() -> None:
    sched = make_scheduler(block_size=16)
    prompt = list(range(32))
    sched.add_request(make_request("x", prompt, max_tokens=1))
    step(sched)
    sched.add_request(make_request("y", prompt, max_tokens=1))
    out, results = step(sched)
    (s,) = out.scheduled
    assert s.start_position == 16 and s.num_tokens == 16 and s.samples
    assert len(results[0].new_token_ids) == 1


def test_salted_requests_do_not_share() -> None:
    sched = make_scheduler(block_size=4)
    prompt = list(range(12))
    first = make_request("x", prompt, max_tokens=1)
    first.cache_salt = "alice"
    sched.add_request(first)
    step(sched)
    other = make_request("y", prompt, max_tokens=1)
    other.cache_salt = "bob"
    sched.add_request(other)
    assert step(sched)[0].scheduled[0].start_position == 0


def test_blocked_request_counts_one_prefix_query() -> None:
    sched = make_scheduler(budget=64, num_blocks=3, block_size=4)
    sched.add_request(make_request("a", list(range(8)), max_tokens=3))
    sched.add_request(make_request("b", list(range(100, 108))))
    for _ in range(3):
        step(sched)  # b waits for a's blocks
    assert sched.kv_cache_manager.prefix_cache_queries == 8
    step(sched)
    assert sched.kv_cache_manager.prefix_cache_queries == 16


# ---- preemption ------------------------------------------------------------------------------------------------


def step_until_preemption(sched: Scheduler, runner: FakeRunner) -> SchedulerOutput:
    for _ in range(20):
        out, _ = step(sched, runner)
        if out.preempted_request_ids:
            return out
    raise AssertionError("no preemption")


@pytest.mark.parametrize(
    ("policy", "victim", "survivor"), [("fcfs", "high", "low"), ("priority", "low", "high")]
)
def test_preemption_victim_and_no_admission(policy: str, victim: str, survivor: str) -> None:
    # 4 blocks of 4: two requests of 4-token prompts fill the pool after 4 decodes each; the 5th needs a block.
    sched = make_scheduler(policy=policy, num_blocks=4, block_size=4)
    runner = FakeRunner()
    reqs = {
        "low": make_request("low", [1, 2, 3, 4], max_tokens=8, priority=5, arrival=0.0),
        "high": make_request("high", [5, 6, 7, 8], max_tokens=8, priority=0, arrival=1.0),
    }
    for r in reqs.values():
        sched.add_request(r)
    out = step_until_preemption(sched, runner)
    assert out.preempted_request_ids == {victim} and victim in out.finished_request_ids
    assert shares(out) == {survivor: 1}
    v = reqs[victim]
    assert v.status == RequestStatus.PREEMPTED and v.num_computed_tokens == 0 and v.num_preemptions == 1
    assert sched.waiting[0] is v
    outputs_at_preemption = list(v.output_token_ids)

    # Resumed later: prompt + outputs so far are recomputed as its prompt (a cached prefix may be reused).
    sched.add_request(make_request("late", [42]))
    streamed: dict[str, list[int]] = {}
    resumed: ScheduledRequest | None = None
    while sched.has_unfinished_requests():
        out, results = step(sched, runner)
        for s in out.scheduled:
            if s.request_id == victim and resumed is None:
                resumed = s
        for o in results:
            streamed.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert resumed is not None and resumed.samples
    all_tokens = v.prompt_token_ids + outputs_at_preemption
    assert resumed.start_position % 4 == 0
    assert resumed.token_ids == all_tokens[resumed.start_position :]
    # Nothing lost: outputs before the preemption are kept and streamed once.
    assert v.output_token_ids[: len(outputs_at_preemption)] == outputs_at_preemption
    assert (
        len(v.output_token_ids) == 8 and streamed[victim] == v.output_token_ids[len(outputs_at_preemption) :]
    )
    assert all(len(r.output_token_ids) == 8 for r in reqs.values())
    assert_all_free(sched)


def test_request_can_be_its_own_victim() -> None:
    # FCFS victim is the latest arrival even when it comes first in the running order.
    sched = make_scheduler(num_blocks=4, block_size=4)
    late = make_request("late", [1, 2, 3, 4], max_tokens=8, arrival=1.0)
    early = make_request("early", [5, 6, 7, 8], max_tokens=8, arrival=0.0)
    sched.add_request(late)
    sched.add_request(early)
    out = step_until_preemption(sched, FakeRunner())
    assert out.preempted_request_ids == {"late"} and shares(out) == {"early": 1}
    run_to_completion(sched, FakeRunner())
    assert_all_free(sched)


def test_victim_already_scheduled_in_this_step_is_taken_back() -> None:
    sched = make_scheduler(policy="priority", budget=8, num_blocks=3, block_size=4)
    low = make_request("low", [1, 2, 3], priority=5)
    sched.add_request(low)
    step(sched)
    sched.add_request(make_request("high", [5, 6, 7, 8], priority=0))
    assert shares(step(sched)[0]) == {"low": 1, "high": 4}
    # low crosses into a new block (the last free one), then high needs one: low, already planned, is the victim.
    out, results = step(sched)
    assert out.preempted_request_ids == {"low"}
    assert shares(out) == {"high": 1} and out.num_batched_tokens == 1
    assert [o.request_id for o in results] == ["high"]
    assert low.num_computed_tokens == 0 and low.num_output_tokens == 2
    kv = sched.kv_cache_manager
    assert kv.num_used_blocks == 2 and sorted(kv.ref_counts()) == [0, 1, 1]


# ---- finishing -------------------------------------------------------------------------------------------------


def finish_of(
    sched: Scheduler, request: Request, token: int | Callable[[ScheduledRequest], int]
) -> EngineCoreOutput:
    sched.add_request(request)
    runner = FakeRunner(token if callable(token) else (lambda _: token))
    for _ in range(50):
        for o in step(sched, runner)[1]:
            if o.finish_reason is not None:
                assert_all_free(sched)
                assert request.request_id in sched.schedule().finished_request_ids
                return o
    raise AssertionError("did not finish")


def test_finish_on_eos() -> None:
    r = make_request("r", [1, 2], eos=7)
    o = finish_of(make_scheduler(), r, 7)
    assert (o.finish_reason, o.stop_reason, r.output_token_ids) == ("stop", None, [7])


def test_eos_and_stop_tokens_wait_for_min_tokens() -> None:
    r = make_request("r", [1, 2], eos=7, min_tokens=3)
    assert finish_of(make_scheduler(), r, 7).finish_reason == "stop" and r.num_output_tokens == 3
    s = make_request("s", [1, 2], min_tokens=2, stop_token_ids=[9])
    o = finish_of(make_scheduler(), s, 9)
    assert (o.finish_reason, o.stop_reason, s.num_output_tokens) == ("stop", 9, 2)


def test_finish_on_stop_token_id() -> None:
    r = make_request("r", [1, 2], stop_token_ids=[9, 11])
    tokens = iter([5, 6, 11, 9])
    o = finish_of(make_scheduler(), r, lambda _: next(tokens))
    assert (o.finish_reason, o.stop_reason, r.output_token_ids) == ("stop", 11, [5, 6, 11])


def test_ignore_eos_runs_to_max_tokens() -> None:
    r = make_request("r", [1, 2], max_tokens=5, eos=7, ignore_eos=True)
    assert finish_of(make_scheduler(), r, 7).finish_reason == "length" and r.output_token_ids == [7] * 5


def test_finish_on_max_tokens_and_max_model_len() -> None:
    r = make_request("r", [1, 2], max_tokens=3)
    o = finish_of(make_scheduler(), r, 5)
    assert (o.finish_reason, r.num_output_tokens, o.stop_reason) == ("length", 3, None)
    s = make_request("s", [1, 2, 3, 4], max_tokens=None)
    assert finish_of(make_scheduler(max_model_len=6), s, 5).finish_reason == "length" and s.num_tokens == 6


def test_eos_beats_max_tokens_on_the_same_token() -> None:
    r = make_request("r", [1], max_tokens=1, eos=7)
    assert finish_of(make_scheduler(), r, 7).finish_reason == "stop"


def test_finish_requests_from_the_front_end() -> None:
    sched = make_scheduler()
    r = make_request("r", [1, 2, 3])
    sched.add_request(r)
    step(sched)
    outputs = sched.finish_requests(["r"], RequestStatus.FINISHED_STOPPED)
    assert [o.finish_reason for o in outputs] == ["stop"] and r.status == RequestStatus.FINISHED_STOPPED
    assert_all_free(sched)
    assert sched.finish_requests(["r"], RequestStatus.FINISHED_STOPPED) == []
    with pytest.raises(ValueError):
        sched.finish_requests(["x"], RequestStatus.RUNNING)


# ---- aborts ----------------------------------------------------------------------------------------------------


def test_abort_is_idempotent_and_frees_at_once() -> None:
    sched = make_scheduler()
    running, waiting = make_request("run", list(range(10))), make_request("wait", [1])
    sched.add_request(running)
    step(sched)
    sched.add_request(waiting)
    outputs = sched.abort_requests(["run", "wait", "unknown", "run"])
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("run", "abort"), ("wait", "abort")]
    assert sched.abort_requests(["run", "wait"]) == []
    assert not sched.has_unfinished_requests() and sched.get_request("run") is None
    assert_all_free(sched)
    out = sched.schedule()
    assert out.is_empty and out.finished_request_ids == {"run", "wait"}
    assert sched.schedule().finished_request_ids == set()


def test_abort_during_a_step_drops_its_output() -> None:
    sched = make_scheduler()
    a, b = make_request("a", [1, 2]), make_request("b", [3, 4])
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    runner_output = FakeRunner()(out)
    sched.abort_requests(["a"])  # arrives while the step runs
    results = sched.update_from_output(out, runner_output)
    assert [o.request_id for o in results] == ["b"]
    assert a.output_token_ids == [] and a.status == RequestStatus.FINISHED_ABORTED
    assert "a" in sched.schedule().finished_request_ids


# ---- randomized invariants -------------------------------------------------------------------------------------


def check_invariants(sched: Scheduler) -> None:
    kv = sched.kv_cache_manager
    live = {r.request_id for r in sched.running} | {r.request_id for r in sched.waiting}
    assert set(sched.requests) == live
    assert set(kv.tables) <= {r.request_id for r in sched.running}
    holders = Counter(b.block_id for tables in kv.tables.values() for table in tables
                      for b in set(table) if b is not None)
    assert kv.ref_counts() == [holders[i] for i in range(kv.num_blocks)]
    assert kv.num_used_blocks == len(holders)
    assert set(kv.pool.free_queue) == {i for i in range(kv.num_blocks) if holders[i] == 0}
    for block in kv.pool.cached.values():
        assert block.block_hash is not None and block.cache_key is not None
    ahead = 1 if sched.config.async_scheduling else 0  # a position planned before its token is known
    for r in sched.running:
        for group, table in enumerate(kv.tables.get(r.request_id, [[]] * kv.num_groups)):
            assert len(table) * kv.block_size >= r.num_computed_tokens
            # A sliding group holds nothing wholly before the window of the next position it computes.
            cap = kv._held_cap(group)  # a sliding group gives back what fell out of its window
            assert cap is None or sum(b is not None for b in table) <= cap
        assert r.num_computed_tokens <= r.num_tokens + ahead
        assert r.status == RequestStatus.RUNNING
    assert len(sched.running) <= sched.config.max_num_seqs


class FakeKV:
    """Stands in for the paged KV tensors: each slot remembers which token prefix it was computed for, so a
    request attending over a block it shares (prefix hit) or got back after a preemption sees only its own tokens."""

    def __init__(self, block_size: int, windows: tuple[int, ...] = (0,)) -> None:
        self.block_size = block_size
        self.windows = windows  # per KV-cache group: a group's slots are its own (group, block, offset)
        self.slots: dict[tuple[int, int, int], tuple[int, ...]] = {}

    def run(self, out: SchedulerOutput, last_sampled: dict[str, int] | None = None) -> None:
        """`last_sampled`: the runner's last token per request, which fills in a placeholder (async scheduling)."""
        bs = self.block_size
        rows = []
        for s in out.scheduled:
            tokens, token_ids = s.prompt_token_ids + s.output_token_ids, s.token_ids
            if s.uses_previous_token:
                assert last_sampled is not None and token_ids == [-1]
                token_ids = [last_sampled[s.request_id]]
                tokens = tokens[: s.start_position] + token_ids  # its own token may not be appended yet
            rows.append((s, tokens, token_ids))
        # A forward pass writes every new position's K/V before anyone attends (as a layer does).
        for s, tokens, _ in rows:
            for group, table in enumerate(s.group_block_ids or [s.block_ids]):
                for pos in range(s.start_position, s.start_position + s.num_tokens):
                    self.slots[group, table[pos // bs], pos % bs] = tuple(tokens[: pos + 1])
        for s, tokens, token_ids in rows:
            assert token_ids == tokens[s.start_position : s.start_position + s.num_tokens]
            assert len(s.group_block_ids or [s.block_ids]) == len(self.windows)
            for group, table in enumerate(s.group_block_ids or [s.block_ids]):
                window = self.windows[group]
                # The keys the step's first query sees: all, or those of its window.
                first = max(0, s.start_position - window + 1) if window else 0
                for pos in range(first, s.start_position + s.num_tokens):
                    assert self.slots.get((group, table[pos // bs], pos % bs)) == tuple(tokens[: pos + 1]), (
                        f"{s.request_id} reads wrong KV at position {pos} in group {group}"
                    )


def run_random_workload(seed: int, async_scheduling: bool = False, hybrid: bool = False) -> Counter[str]:
    """Random adds, aborts (also during a step), front-end finishes and preemptions; returns how often the paths
    worth guarding were taken. With async scheduling two batches are in flight, as the engine keeps them: the next
    one is planned (and computed, by a runner that runs batches in order) before the previous one's update."""
    rng = random.Random(seed)
    block_size = rng.choice([2, 4])
    kv_groups = None
    if hybrid:  # Gemma-like (local and global layers in groups) or every layer sliding, windows of 3-9 positions
        kinds = rng.choice([["sliding_attention", "full_attention"] * 2, ["sliding_attention"] * 3])
        kv_groups = kv_cache_groups(kinds, rng.randint(3, 9))
    sched = make_scheduler(
        budget=rng.randint(3, 24),
        max_num_seqs=rng.randint(1, 6),
        threshold=rng.choice([0, 0, 2, 5]),
        policy=rng.choice(["fcfs", "priority"]),
        num_blocks=rng.randint(4, 14),
        block_size=block_size,
        max_model_len=rng.randint(16, 40),
        caching=rng.random() < 0.8,
        async_scheduling=async_scheduling,
        kv_groups=kv_groups,
    )
    fake_kv = FakeKV(block_size, kv_groups.windows if kv_groups else (0,))
    last_sampled: dict[str, int] = {}
    in_flight: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
    seen: Counter[str] = Counter()
    prefixes = [[rng.randrange(5) for _ in range(rng.randint(0, 12))] for _ in range(3)]
    streamed: dict[str, list[int]] = {}
    ended: dict[str, Request] = {}
    added: list[str] = []

    def add() -> None:
        rid = f"r{len(added)}"
        added.append(rid)
        prompt = rng.choice(prefixes) + [rng.randrange(5) for _ in range(rng.randint(1, 10))]
        prompt = prompt[: min(sched.max_model_len, len(prompt))]
        params = {"min_tokens": rng.choice([0, 0, 2]), "stop_token_ids": rng.choice([[], [6]])}
        r = make_request(
            rid, prompt, max_tokens=rng.randint(2, 20), priority=rng.randint(0, 3), eos=7, **params
        )
        r.cache_salt = rng.choice([None, None, "s"])
        sched.add_request(r)
        ended[rid] = r

    def collect(outputs: list[EngineCoreOutput]) -> None:
        for o in outputs:
            assert o.request_id not in finished, f"{o.request_id} got an output after it finished"
            streamed.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                finished.add(o.request_id)

    finished: set[str] = set()

    for i in range(5000):
        if i < 220 and rng.random() < 0.4:
            add()
        if rng.random() < 0.05 and added:
            collect(sched.abort_requests([rng.choice(added) for _ in range(2)] + ["unknown"]))
        if rng.random() < 0.03 and sched.running:
            collect(
                sched.finish_requests([rng.choice(sched.running).request_id], RequestStatus.FINISHED_STOPPED)
            )
        check_invariants(sched)
        flying = {s.request_id for batch, _ in in_flight for s in batch.scheduled}
        out = sched.schedule()
        seen["preemptions"] += len(out.preempted_request_ids)
        seen["preempted_in_flight"] += len(out.preempted_request_ids & flying)
        seen["placeholders"] += sum(s.uses_previous_token for s in out.scheduled)
        seen["windows_dropped"] += sum(b is None for tables in sched.kv_cache_manager.tables.values()
                                       for table in tables for b in table)
        seen["prefill_ahead"] += sum(s.request_id in flying and not s.uses_previous_token for s in out.scheduled)
        assert out.num_batched_tokens <= sched.config.max_num_batched_tokens
        assert out.num_batched_tokens == sum(s.num_tokens for s in out.scheduled)
        assert len({s.request_id for s in out.scheduled}) == len(out.scheduled)
        check_invariants(sched)
        if out.scheduled or not async_scheduling:  # the engine submits no empty batch while one is in flight
            fake_kv.run(out, last_sampled)
            runner_output = ModelRunnerOutput(
                {s.request_id: rng.randrange(10) for s in out.scheduled if s.samples}
            )
            last_sampled.update(runner_output.sampled_token_ids)
            in_flight.append((out, runner_output))
            if len(in_flight) < (2 if async_scheduling else 1):
                continue
        if not in_flight:
            continue
        out, runner_output = in_flight.popleft()
        if rng.random() < 0.05 and out.scheduled:
            collect(sched.abort_requests([rng.choice(out.scheduled).request_id]))  # during the step
        collect(sched.update_from_output(out, runner_output))
        check_invariants(sched)
        if i >= 220 and not sched.has_unfinished_requests() and not in_flight:
            break
    assert not sched.has_unfinished_requests() and not in_flight, "the workload did not drain"
    assert_all_free(sched)
    for rid, r in ended.items():
        assert r.status.finished
        assert streamed.get(rid, []) == r.output_token_ids  # every token streamed exactly once
        assert r.sampling_params.max_tokens is None or r.num_output_tokens <= r.sampling_params.max_tokens
        assert r.num_tokens <= max(sched.max_model_len, r.num_prompt_tokens + 1)
    assert sched._in_flight == Counter()
    seen["prefix_hits"] = sched.kv_cache_manager.prefix_cache_hits
    return seen


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("seed", range(12))
def test_random_workload_keeps_block_accounting(seed: int, async_scheduling: bool) -> None:
    run_random_workload(seed, async_scheduling)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("seed", range(12))
def test_random_workload_with_sliding_window_groups_keeps_block_accounting_and_every_window(
    seed: int, async_scheduling: bool
) -> None:
    """Sliding groups give blocks back as requests advance: no block is held twice or lost, prefix hits, preemptions
    and aborts keep their meaning, and every key a step's queries see in each group is the request's own."""
    run_random_workload(seed, async_scheduling, hybrid=True)


def test_sliding_window_random_workloads_drop_blocks_and_hit_the_prefix_cache() -> None:
    # Guards the randomized test above against never giving a block back, or never hitting across groups.
    seen = sum((run_random_workload(seed, hybrid=True) for seed in range(12)), Counter())
    assert seen["windows_dropped"] > 0 and seen["prefix_hits"] > 0 and seen["preemptions"] > 0, seen


def test_random_workloads_reach_preemption() -> None:
    # Guards the randomized test against silently never taking the preemption path.
    assert sum(run_random_workload(seed)["preemptions"] for seed in range(12)) > 0


def test_async_random_workloads_reach_every_path() -> None:
    # Guards the randomized async test against silently degrading to synchronous scheduling.
    seen = sum((run_random_workload(seed, async_scheduling=True) for seed in range(12)), Counter())
    assert all(seen[k] > 0 for k in ("preemptions", "preempted_in_flight", "placeholders", "prefill_ahead")), seen


def test_a_request_in_a_batch_still_in_flight_is_not_scheduled_again_until_its_output_returns() -> None:
    """Pipeline stages keep several batches in flight: a second schedule() before the first batch's output must
    leave that batch's requests out (a prefill chunk would otherwise run twice at once, a decode without its
    token), and schedule the others."""
    scheduler = make_scheduler(budget=8, block_size=4)
    scheduler.add_request(make_request("a", list(range(20)), max_tokens=2))
    first = scheduler.schedule()
    assert [s.request_id for s in first.scheduled] == ["a"] and first.scheduled[0].num_tokens == 8
    scheduler.add_request(make_request("b", list(range(100, 106)), max_tokens=2))
    second = scheduler.schedule()
    assert [s.request_id for s in second.scheduled] == ["b"]  # a's next chunk waits for its batch
    assert scheduler.schedule().is_empty  # both in flight
    scheduler.update_from_output(first, ModelRunnerOutput(sampled_token_ids={}))
    third = scheduler.schedule()
    assert [(s.request_id, s.start_position) for s in third.scheduled] == [("a", 8)]
    outputs = scheduler.update_from_output(second, ModelRunnerOutput(sampled_token_ids={"b": 7}))
    assert [o.new_token_ids for o in outputs] == [[7]]
    assert [s.request_id for s in scheduler.schedule().scheduled] == ["b"]  # b decodes; a still in flight
