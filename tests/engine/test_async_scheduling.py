"""Async scheduling (--async-scheduling): the engine plans step N+1 while step N computes.

The scheduler rules without a model first (placeholders, limits, what stays synchronous, stops, preemption and
aborts with two batches in flight), then the tiny model end to end: the same tokens as synchronous scheduling for a
mixed workload, a proof that the next batch really is submitted before the previous one has computed, and an abort
while a request is in both batches in flight.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_scheduler import check_invariants, make_request, make_scheduler

from lmserve import LLM, SamplingParams
from lmserve.cli import build_parser
from lmserve.config import DEFAULT_ASYNC_SCHEDULING, engine_kwargs, make_engine_config
from lmserve.engine.outputs import EngineCoreOutput
from lmserve.engine.request import RequestStatus
from lmserve.engine.scheduler import Scheduler
from lmserve.sampling_params import StructuredOutputsParams
from lmserve.step import PLACEHOLDER_TOKEN_ID, ModelRunnerOutput, ScheduledRequest, SchedulerOutput

# ---- configuration ---------------------------------------------------------------------------------------------


def test_flag_keyword_and_default() -> None:
    parser = build_parser()
    assert engine_kwargs(parser.parse_args(["serve"]))["async_scheduling"] is DEFAULT_ASYNC_SCHEDULING
    assert engine_kwargs(parser.parse_args(["serve", "--async-scheduling"]))["async_scheduling"] is True
    assert engine_kwargs(parser.parse_args(["serve", "--no-async-scheduling"]))["async_scheduling"] is False
    assert make_engine_config(async_scheduling=True).scheduler.async_scheduling
    assert make_engine_config(async_scheduling=True, data_parallel_size=2).scheduler.async_scheduling
    for layout in ({"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}):
        with pytest.raises(ValueError, match="async_scheduling needs one rank per engine"):
            make_engine_config(async_scheduling=True, **layout)


# ---- the scheduler, without a model ----------------------------------------------------------------------------


def shares(out: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    return [(s.request_id, s.start_position, s.num_tokens, s.uses_previous_token) for s in out.scheduled]


def update(sched: Scheduler, out: SchedulerOutput, tokens: dict[str, int]) -> list[EngineCoreOutput]:
    outputs = sched.update_from_output(out, ModelRunnerOutput(tokens))
    check_invariants(sched)
    return outputs


def test_a_decoding_request_is_planned_ahead_of_its_token_with_a_placeholder() -> None:
    sched = make_scheduler(block_size=4, async_scheduling=True)
    a = make_request("a", [1, 2, 3, 4, 5, 6], max_tokens=50)
    sched.add_request(a)
    first = sched.schedule()
    assert shares(first) == [("a", 0, 6, False)] and first.scheduled[0].samples
    second = sched.schedule()  # while the first computes: a's next position holds the token being sampled
    (s,) = second.scheduled
    assert (s.start_position, s.token_ids, s.uses_previous_token, s.samples) == (6, [PLACEHOLDER_TOKEN_ID], True, True)
    assert s.block_ids == sched.kv_cache_manager.block_ids("a") and len(s.block_ids) == 2  # position 6's slot
    assert a.num_computed_tokens == a.num_tokens + 1
    assert sched.schedule().is_empty  # in both batches in flight: it waits for the first one's output
    assert [o.new_token_ids for o in update(sched, first, {"a": 10})] == [[10]]
    third = sched.schedule()
    assert shares(third) == [("a", 7, 1, True)]
    assert [o.new_token_ids for o in update(sched, second, {"a": 11})] == [[11]]
    assert [o.new_token_ids for o in update(sched, third, {"a": 12})] == [[12]]
    assert a.output_token_ids == [10, 11, 12] and a.num_computed_tokens == a.num_tokens - 1
    synchronous = make_scheduler(block_size=4)
    synchronous.add_request(make_request("a", [1, 2, 3], max_tokens=50))
    synchronous.schedule()
    assert synchronous.schedule().is_empty  # without the flag nothing goes ahead


def test_prefill_chunks_go_ahead_of_the_chunk_in_flight() -> None:
    sched = make_scheduler(budget=4, block_size=4, async_scheduling=True)
    sched.add_request(make_request("p", list(range(10, 20))))
    first, second = sched.schedule(), sched.schedule()
    assert shares(first) == [("p", 0, 4, False)] and shares(second) == [("p", 4, 4, False)]
    assert not first.scheduled[0].samples and not second.scheduled[0].samples
    assert sched.schedule().is_empty
    update(sched, first, {})
    third = sched.schedule()
    assert shares(third) == [("p", 8, 2, False)] and third.scheduled[0].samples
    assert third.scheduled[0].token_ids == [18, 19]


@pytest.mark.parametrize(("max_tokens", "max_model_len"), [(3, 100), (100, 9)])
def test_never_ahead_past_max_tokens_or_max_model_len(max_tokens: int, max_model_len: int) -> None:
    """The token in flight already counts: once it is the last one, the request waits for it and ends."""
    sched = make_scheduler(block_size=4, max_model_len=max_model_len, async_scheduling=True)
    a = make_request("a", [1, 2, 3, 4, 5, 6], max_tokens=max_tokens)
    sched.add_request(a)
    batches = [sched.schedule()]
    tokens = iter(range(100, 200))
    outputs: list[EngineCoreOutput] = []
    while batches:
        out = sched.schedule()
        if not out.is_empty:
            batches.append(out)
        done = batches.pop(0)
        outputs += update(sched, done, {s.request_id: next(tokens) for s in done.scheduled if s.samples})
    assert [t for o in outputs for t in o.new_token_ids] == [100, 101, 102]  # no token computed and dropped
    assert outputs[-1].finish_reason == "length" and a.num_computed_tokens == 8


def test_prompt_logprobs_requests_wait_for_their_batch() -> None:
    sched = make_scheduler(block_size=4, async_scheduling=True)
    sched.add_request(make_request("lp", [1, 2, 3], prompt_logprobs=1))
    sched.add_request(make_request("d", [4, 5, 6]))
    first = sched.schedule()
    assert [r for r, *_ in shares(sched.schedule())] == ["d"]
    update(sched, first, {"lp": 7, "d": 8})
    assert [(r, ahead) for r, _, _, ahead in shares(sched.schedule())] == [("lp", False), ("d", True)]


def test_a_stop_at_the_token_in_flight_drops_the_position_planned_after_it() -> None:
    sched = make_scheduler(block_size=4, async_scheduling=True)
    a = make_request("a", [1, 2, 3, 4], eos=7)
    b = make_request("b", [5, 6, 8, 9])
    sched.add_request(a)
    sched.add_request(b)
    first = sched.schedule()
    second = sched.schedule()
    assert [(r, ahead) for r, _, _, ahead in shares(second)] == [("a", True), ("b", True)]
    outputs = update(sched, first, {"a": 7, "b": 1})  # a samples EOS while its next position computes
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in outputs] == [("a", [7], "stop"), ("b", [1], None)]
    assert a.status == RequestStatus.FINISHED_STOPPED and "a" not in sched.kv_cache_manager.tables
    third = sched.schedule()
    assert "a" in third.finished_request_ids and [r for r, *_ in shares(third)] == ["b"]
    outputs = update(sched, second, {"a": 3, "b": 2})
    assert [(o.request_id, o.new_token_ids) for o in outputs] == [("b", [2])]  # a's token is not sent
    sched.abort_requests(["b"])
    update(sched, third, {"b": 4})
    assert not sched._in_flight and sched.kv_cache_manager.num_used_blocks == 0


def test_a_request_preempted_with_its_batch_in_flight_keeps_that_batchs_token() -> None:
    """Its token is what it would sample next anyway (a seeded generator has drawn it): it is appended, and the
    request resumes after it."""
    sched = make_scheduler(block_size=4, num_blocks=3, async_scheduling=True)
    a, b = make_request("a", [1, 2, 3, 4]), make_request("b", [11, 12, 13, 14])
    sched.add_request(a)
    sched.add_request(b)
    first = sched.schedule()
    second = sched.schedule()  # a's position 4 takes the last free block; b's needs one: b, the latest, is evicted
    assert shares(second) == [("a", 4, 1, True)] and second.preempted_request_ids == {"b"}
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    outputs = update(sched, first, {"a": 100, "b": 200})
    assert [(o.request_id, o.new_token_ids) for o in outputs] == [("a", [100]), ("b", [200])]
    assert b.output_token_ids == [200] and b.status == RequestStatus.PREEMPTED
    update(sched, second, {"a": 101})
    sched.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)
    resumed = sched.schedule()  # its first block from the prefix cache, then the kept token
    assert shares(resumed) == [("b", 4, 1, False)] and resumed.scheduled[0].token_ids == [200]
    assert resumed.scheduled[0].samples  # its second token
    update(sched, resumed, {"b": 201})
    assert b.output_token_ids == [200, 201]


def test_an_abort_while_a_request_is_in_two_batches_frees_everything() -> None:
    sched = make_scheduler(block_size=4, async_scheduling=True)
    a = make_request("a", [1, 2, 3, 4])
    sched.add_request(a)
    first, second = sched.schedule(), sched.schedule()
    assert sched._in_flight["a"] == 2
    outputs = sched.abort_requests(["a"])
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("a", "abort")]
    assert sched.kv_cache_manager.num_used_blocks == 0
    assert update(sched, first, {"a": 5}) == [] and update(sched, second, {"a": 6}) == []
    assert not sched._in_flight and a.output_token_ids == []
    assert "a" in sched.schedule().finished_request_ids


# ---- end to end on the tiny model ------------------------------------------------------------------------------

SHARED = list(range(300, 332))  # two full blocks that the mixed batch finds in the prefix cache
# A budget of 48 positions chunks the longer prompts beside decodes; 14 blocks of 16 force preemptions.
TINY = {"dtype": "float32", "quantization": "none", "max_num_batched_tokens": 48, "num_blocks": 14,
        "max_model_len": 512}
CHOICES = ["yes", "no", "maybe"]


def mixed_workload(eos: int) -> list[tuple[list[int], SamplingParams]]:
    """Prompts of different lengths; greedy, seeded (n=3 too), penalties and min_tokens (which read the output so
    far), logprobs; stops by EOS, by a stop token id and by max_tokens at different steps; a constrained request."""
    greedy = {"temperature": 0.0, "ignore_eos": True}
    longs = [list(range(100 + 9 * i, 140 + 13 * i)) for i in range(4)]
    return [
        (SHARED + [7, 8, 9, 10], SamplingParams(max_tokens=10, **greedy)),
        (longs[0], SamplingParams(max_tokens=12, logprobs=2, **greedy)),
        (longs[1], SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)),
        (longs[2], SamplingParams(max_tokens=9, temperature=0.8, top_p=0.9, seed=11, n=3, ignore_eos=True)),
        (longs[3], SamplingParams(max_tokens=10, temperature=1.0, seed=5, repetition_penalty=1.3,
                                  frequency_penalty=0.5, presence_penalty=0.3, ignore_eos=True)),
        # A logit bias makes the stop token the favourite; min_tokens holds it back until that many tokens.
        ([5, 6, 7], SamplingParams(max_tokens=20, temperature=0.0, logit_bias={eos: 100.0}, min_tokens=3)),
        ([8, 9, 10, 11, 12], SamplingParams(max_tokens=20, temperature=1.0, seed=3, stop_token_ids=[4242],
                                            logit_bias={4242: 100.0}, min_tokens=6)),
        ([13, 14], SamplingParams(max_tokens=1, **greedy)),
        (list(range(20, 45)), SamplingParams(max_tokens=2, **greedy)),
        ([1, 2, 3], SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=StructuredOutputsParams(
            choice=CHOICES))),
    ]


def run_workload(llm: LLM) -> tuple[list[Any], dict[str, Any]]:
    eos = llm.engine.eos_token_ids[0]
    llm.generate([SHARED + [1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    work = mixed_workload(eos)
    outputs = llm.generate([p for p, _ in work], [sp for _, sp in work])
    results = [[(c.token_ids, c.finish_reason, c.stop_reason, c.text) for c in out.outputs] for out in outputs]
    logprobs = [(lp.token_id, lp.rank, [t for t, _ in lp.top], lp.logprob) for lp in outputs[1].outputs[0].logprobs]
    stats = llm.engine.stats()
    assert stats.kv_blocks_used == 0 and not llm.engine.has_unfinished_requests()
    assert outputs[5].outputs[0].token_ids[-1] == eos and len(outputs[5].outputs[0].token_ids) == 4
    assert outputs[6].outputs[0].stop_reason == 4242 and len(outputs[6].outputs[0].token_ids) == 7
    assert outputs[-1].outputs[0].text in CHOICES
    return results, {"prefix_cache_hits": stats.prefix_cache_hits, "num_preemptions": stats.num_preemptions,
                     "logprobs": logprobs}


def assert_same(results: tuple[list[Any], dict[str, Any]], synchronous: tuple[list[Any], dict[str, Any]]) -> None:
    assert results[0] == synchronous[0]
    got, want = results[1]["logprobs"], synchronous[1]["logprobs"]
    assert [g[:3] for g in got] == [w[:3] for w in want]
    assert [g[3] for g in got] == pytest.approx([w[3] for w in want], abs=1e-4)


@pytest.fixture(scope="module")
def synchronous(tiny_llama_dir: Path) -> tuple[list[Any], dict[str, Any]]:
    with LLM(str(tiny_llama_dir), **TINY, async_scheduling=False) as llm:
        assert llm.engine.executor.max_concurrent_batches == 1
        results, stats = run_workload(llm)
    assert stats["prefix_cache_hits"] > 0 and stats["num_preemptions"] > 0, stats  # as mixed as it says
    return results, stats


class Recorder:
    """Wraps the scheduler: every planned row, and whether its request has a grammar."""

    def __init__(self, sched: Scheduler) -> None:
        self.rows: list[tuple[str, bool, bool]] = []  # (request id, uses_previous_token, constrained)
        schedule = sched.schedule

        def recorded() -> SchedulerOutput:
            out = schedule()
            self.rows += [(s.request_id, s.uses_previous_token, sched.requests[s.request_id].grammar is not None)
                          for s in out.scheduled]
            return out

        sched.schedule = recorded  # type: ignore[method-assign]


def test_async_scheduling_gives_the_synchronous_tokens(synchronous, tiny_llama_dir: Path) -> None:
    with LLM(str(tiny_llama_dir), **TINY, async_scheduling=True) as llm:
        assert llm.engine.executor.max_concurrent_batches == 2
        recorder = Recorder(llm.engine.scheduler)
        results, stats = run_workload(llm)
        assert not llm.engine.scheduler._in_flight
    assert_same((results, stats), synchronous)
    assert stats["prefix_cache_hits"] > 0 and stats["num_preemptions"] > 0, stats
    ahead = [r for r in recorder.rows if r[1]]
    assert len(ahead) > 20, "decodes did not go ahead of their tokens"
    assert not any(constrained for _, _, constrained in ahead)
    assert any(constrained for _, _, constrained in recorder.rows)


def test_one_rank_under_the_mp_executor_schedules_asynchronously_too(synchronous, tiny_llama_dir: Path) -> None:
    with LLM(str(tiny_llama_dir), **TINY, async_scheduling=True, distributed_executor_backend="mp") as llm:
        assert llm.engine.executor.max_concurrent_batches == 2
        recorder = Recorder(llm.engine.scheduler)
        results, stats = run_workload(llm)
    assert_same((results, stats), synchronous)
    assert any(ahead for _, ahead, _ in recorder.rows)


class Gate:
    """Holds each step's forward pass until the engine has either submitted the next step or asked for this one's
    output, and records which came first: the next submission, if the engine really plans ahead. A step run on the
    engine's own thread (a synchronous executor) is recorded too, and not held."""

    def __init__(self, llm: LLM) -> None:
        executor = llm.engine.executor
        self.engine_thread = threading.current_thread()
        self.cond = threading.Condition()
        self.index: dict[int, int] = {}  # id(scheduler output) -> submission index
        self.awaited: set[int] = set()
        self.overlapped: list[bool] = []
        self.synchronous = 0
        submit, execute = executor.submit, executor.worker.execute_model
        gate = self

        class Watched:
            def __init__(self, future: Any, index: int) -> None:
                self.future, self.index_ = future, index

            def result(self) -> Any:
                with gate.cond:
                    gate.awaited.add(self.index_)
                    gate.cond.notify_all()
                return self.future.result()

        def gated_submit(scheduler_output: SchedulerOutput) -> Watched:
            with self.cond:
                index = self.index[id(scheduler_output)] = len(self.index)
                self.cond.notify_all()
            return Watched(submit(scheduler_output), index)

        def gated_execute(scheduler_output: SchedulerOutput) -> Any:
            if threading.current_thread() is self.engine_thread:
                self.synchronous += 1
                return execute(scheduler_output)
            with self.cond:
                index = self.index[id(scheduler_output)]
                assert self.cond.wait_for(lambda: len(self.index) > index + 1 or index in self.awaited, timeout=60)
                self.overlapped.append(len(self.index) > index + 1)
            return execute(scheduler_output)

        executor.submit = gated_submit
        executor.worker.execute_model = gated_execute


def test_the_next_step_is_submitted_before_the_previous_one_has_computed(synchronous, tiny_llama_dir: Path) -> None:
    with LLM(str(tiny_llama_dir), **TINY, async_scheduling=True) as llm:
        gate = Gate(llm)
        results, stats = run_workload(llm)
    assert gate.synchronous == 0
    assert sum(gate.overlapped) > len(gate.overlapped) // 2 and sum(gate.overlapped) >= 10, gate.overlapped
    assert_same((results, stats), synchronous)


@pytest.fixture
def async_llm(tiny_llama_dir: Path) -> Iterator[LLM]:
    with LLM(str(tiny_llama_dir), **TINY, async_scheduling=True) as llm:
        yield llm


def test_the_runner_fills_in_its_own_token_whether_or_not_the_engine_appended_it(async_llm: LLM) -> None:
    """A row planned ahead shares its request's output list with the engine thread, which appends the token in
    flight whenever the previous step's update runs: the runner's inputs and its sampler's view of the output so
    far must not depend on that timing."""
    runner = async_llm.engine.executor.runner
    prompt, known = [1, 2, 3], [10, 11]
    runner.last_sampled["r"] = 12
    views = []
    for outputs in (list(known), [*known, 12]):  # before and after the engine thread appended 12
        for params in (SamplingParams(temperature=0.0), SamplingParams(frequency_penalty=1.0, min_tokens=5)):
            row = ScheduledRequest("r", [PLACEHOLDER_TOKEN_ID], len(prompt) + len(known), [0], True, params, prompt,
                                   outputs, uses_previous_token=True)
            assert runner.prepare_inputs([row]).input_ids.tolist() == [12]
            if params.min_tokens:
                views.append(runner.rejection_sampler.output_token_ids(row))
    assert views == [[10, 11, 12], [10, 11, 12]]
    runner.last_sampled.pop("r")


def test_an_abort_while_two_batches_are_in_flight(async_llm: LLM) -> None:
    """Aborted between a step's forward pass and its update (as the server's engine loop applies aborts), while the
    request is also in the next batch: nothing of it comes out after the abort, every block comes back, and a
    constrained request beside it still gives a valid choice."""
    engine, processor = async_llm.engine, async_llm.input_processor
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    choice = SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=StructuredOutputsParams(choice=CHOICES))
    for rid, prompt, params in [("victim", [3, 4, 5, 6], greedy), ("other", list(range(50, 70)), greedy),
                                ("choice", [1, 2, 3], choice)]:
        engine.add_request(processor.make_request(rid, processor.tokenize(prompt), params))
    tokens: dict[str, list[int]] = {"victim": [], "other": [], "choice": []}
    finish: dict[str, str] = {}
    aborted_at: list[int] = []

    def collect(outputs: list[EngineCoreOutput]) -> None:
        for o in outputs:
            assert o.request_id not in finish, f"{o.request_id}: output after it finished"
            tokens[o.request_id] += o.new_token_ids
            if o.finish_reason is not None:
                finish[o.request_id] = o.finish_reason

    def abort_when_in_two_batches() -> None:
        if not aborted_at and len(tokens["victim"]) >= 3 and engine.scheduler._in_flight["victim"] == 2:
            assert len(engine.batch_queue) == 1  # the batch being updated, and the next one, computing
            aborted_at.append(len(tokens["victim"]))
            collect(engine.abort_requests(["victim"]))

    while engine.has_unfinished_requests():
        collect(engine.step(after_execute=abort_when_in_two_batches))
    assert aborted_at and finish == {"victim": "abort", "other": "length", "choice": "stop"}
    assert len(tokens["victim"]) == aborted_at[0]
    assert len(tokens["other"]) == 30
    assert async_llm.tokenizer.decode(tokens["choice"], skip_special_tokens=True) in CHOICES
    kv = engine.scheduler.kv_cache_manager
    assert kv.num_used_blocks == 0 and set(kv.ref_counts()) == {0} and not engine.scheduler._in_flight
    assert engine.stats().kv_blocks_used == 0
