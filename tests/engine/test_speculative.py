"""Speculative decoding's engine side without a model: prompt lookup's drafts, --speculative-config, and the
scheduler's verify-and-roll-back cycle against a fake model whose next token is a fixed function of the sequence."""

from __future__ import annotations

import itertools
import random

import pytest

from lmserve.config import CacheConfig, SchedulerConfig, make_engine_config
from lmserve.engine.request import Request, RequestStatus
from lmserve.engine.scheduler import Scheduler
from lmserve.sampling_params import SamplingParams
from lmserve.spec_decode.ngram import NgramProposer
from lmserve.speculative_config import SpeculativeConfig
from lmserve.step import ModelRunnerOutput, SchedulerOutput

_ids = itertools.count()


def ngram(k: int = 4, low: int = 1, high: int = 4) -> SpeculativeConfig:
    return SpeculativeConfig.from_json(
        {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": low, "prompt_lookup_max": high}
    )


def request(prompt: list[int], max_tokens: int = 50, **params: object) -> Request:
    return Request(f"r{next(_ids)}", list(prompt), SamplingParams(max_tokens=max_tokens, **params))


class Lookup(NgramProposer):
    def propose_one(self, r: Request, max_drafts: int) -> list[int]:
        """One request's drafts through the batched interface (spec_decode.proposer.Proposer)."""
        [drafts] = self.propose([r], [max_drafts])
        return drafts


# ---- prompt lookup -----------------------------------------------------------------------------------------


def test_lookup_proposes_what_followed_the_latest_longest_match() -> None:
    proposer = Lookup(ngram(k=3, low=1, high=3))
    # The suffix [7, 8, 9] occurs at 0 (followed by 1, 2, 3) and, later, at 6 (followed by 4, 5, 6): the latest wins.
    # A longer match beats a later shorter one: [8, 9] alone also occurs at 13, but only as a 2-gram.
    tokens = [7, 8, 9, 1, 2, 3, 7, 8, 9, 4, 5, 6, 0, 8, 9, 3, 3, 7, 8, 9]
    assert proposer.propose_one(request(tokens), 3) == [4, 5, 6]
    assert proposer.propose_one(request(tokens), 2) == [4, 5]  # the room given caps it
    # Nothing repeats: no drafts. Only a shorter match than prompt_lookup_min: none either.
    assert proposer.propose_one(request([1, 2, 3, 4, 5]), 3) == []
    strict = Lookup(ngram(k=3, low=3, high=3))
    assert strict.propose_one(request([5, 8, 9, 1, 0, 8, 9]), 3) == []  # [8, 9] matches, [0, 8, 9] does not
    assert strict.propose_one(request([0, 8, 9, 1, 0, 8, 9]), 3) == [1, 0, 8]
    # A match that runs into the end continues the loop it found: [3, 4] repeats every 2 tokens, [7, 7] every 1.
    assert Lookup(ngram(k=5, low=2, high=2)).propose_one(request([3, 4, 3, 4]), 5) == [3, 4, 3, 4, 3]
    assert Lookup(ngram(k=3, low=2, high=2)).propose_one(request([1, 7, 7, 7]), 3) == [7, 7, 7]


def test_one_proposer_interface_proposes_for_a_batch_of_requests() -> None:
    """Prompt lookup and the draft model's reservation both answer spec_decode.proposer.Proposer: drafts per request,
    in order, each within its own limit."""
    from lmserve.spec_decode.proposer import ReservedPositions
    from lmserve.step import PLACEHOLDER_TOKEN_ID

    looping, plain = request([3, 4, 3, 4]), request([1, 2, 3, 4, 5])
    assert NgramProposer(ngram(k=5, low=2, high=2)).propose([looping, plain, looping], [5, 3, 2]) == \
        [[3, 4, 3, 4, 3], [], [3, 4]]
    reserve = ReservedPositions(SpeculativeConfig.from_json({"model": "/some/draft", "num_speculative_tokens": 3}))
    assert reserve.propose([looping, plain, looping], [5, 1, 0]) == [[PLACEHOLDER_TOKEN_ID] * 3, [PLACEHOLDER_TOKEN_ID], []]


def test_lookup_follows_the_output_as_it_grows() -> None:
    proposer = Lookup(ngram(k=2, low=2, high=2))
    r = request([1, 2, 3, 4, 5, 6] * 20)  # a long prompt: the mirror grows past its first allocation
    assert proposer.propose_one(r, 2) == [1, 2]
    r.output_token_ids += [1, 2]
    assert proposer.propose_one(r, 2) == [3, 4]
    r.output_token_ids += [9, 9, 9]
    assert proposer.propose_one(r, 2) == [9, 9]  # [9, 9] occurred before, followed by the loop of 9s
    r.output_token_ids += [8]
    proposer.drop(r.request_id)
    assert proposer.propose_one(r, 2) == []  # rebuilt from the request after a drop: [9, 8] never occurred


def test_lookup_matches_a_brute_force_search_on_random_sequences() -> None:
    rng = random.Random(0)
    for trial in range(300):
        low = rng.randint(1, 3)
        high = rng.randint(low, 5)
        k = rng.randint(1, 5)
        tokens = [rng.randint(0, 3) for _ in range(rng.randint(1, 40))]
        expected: list[int] = []
        for n in range(min(high, len(tokens) - 1), low - 1, -1):
            suffix = tokens[-n:]
            starts = [i for i in range(len(tokens) - n) if tokens[i : i + n] == suffix]
            if starts:
                extended = list(tokens)
                at = starts[-1] + n
                while len(expected) < k:
                    extended.append(extended[at + len(expected)])
                    expected.append(extended[at + len(expected)])
                break
        got = Lookup(ngram(k, low, high)).propose_one(request(tokens), k)
        assert got == expected, (trial, tokens, low, high, k)


# ---- --speculative-config ----------------------------------------------------------------------------------


def test_speculative_config_takes_vllms_json_and_bounds_it() -> None:
    config = make_engine_config(speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')
    assert config.scheduler.speculative_config == SpeculativeConfig("ngram", 3, 5, 5)  # vLLM's default lookup
    only_max = SpeculativeConfig.from_json({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4})
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (4, 4)
    assert make_engine_config().scheduler.speculative_config is None
    draft = SpeculativeConfig.from_json({"model": "/some/draft", "num_speculative_tokens": 3})
    assert (draft.method, draft.model, draft.num_speculative_tokens) == ("draft_model", "/some/draft", 3)
    with pytest.raises(ValueError, match="draft model runs on one rank"):
        make_engine_config(speculative_config={"model": "/d", "num_speculative_tokens": 2}, tensor_parallel_size=2)
    bad = [
        ({"method": "ngram"}, "num_speculative_tokens must be an integer in"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
        ({"method": "ngram", "num_speculative_tokens": 10**9}, "num_speculative_tokens must be"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "min"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 10**6}, "prompt_lookup_m.. must"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens must"),
        ({"method": "medusa2", "num_speculative_tokens": 2}, "unknown method"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs \"model\""),
        ({"model": "/some/draft", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
        ({"method": "ngram", "model": "/some/draft", "num_speculative_tokens": 2}, "ngram takes no model"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "eagle is not supported"),
        ({"method": "ngram", "num_speculative_tokens": 2, "speed": "fast"}, "unknown key"),
    ]
    for value, message in bad:
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.from_json(value)
    with pytest.raises(ValueError, match="not valid JSON"):
        make_engine_config(speculative_config="{method: ngram")


# ---- the scheduler's cycle against a fake model --------------------------------------------------------------


class LookupModel:
    """The "model": the next token after a sequence is truth(sequence); every sampling row of a drafted request
    samples what truth gives after the drafts before it, and the kept drafts are those up to the first that
    differs (what the runner does with its samples)."""

    def __init__(self, truth) -> None:
        self.truth = truth
        self.requests: dict[str, Request] = {}

    def __call__(self, out: SchedulerOutput) -> ModelRunnerOutput:
        result = ModelRunnerOutput(sampled_token_ids={})
        for s in out.scheduled:
            if not s.samples:
                continue
            sequence = [*s.prompt_token_ids, *s.output_token_ids]
            kept = []
            for draft in s.draft_token_ids:
                if self.truth(sequence + kept) != draft:
                    break
                kept.append(draft)
            if s.draft_token_ids:
                result.accepted_draft_token_ids[s.request_id] = kept
            result.sampled_token_ids[s.request_id] = self.truth(sequence + kept)
        return result


def run(scheduler: Scheduler, model: LookupModel, requests: list[Request], max_steps: int = 10_000) -> int:
    for r in requests:
        scheduler.add_request(r)
    steps = 0
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        assert out.num_batched_tokens <= scheduler.config.max_num_batched_tokens
        for s in out.scheduled:
            # A drafted request's positions: its newest token, then the drafts; within max_model_len.
            assert s.start_position + s.num_tokens <= scheduler.max_model_len
        scheduler.update_from_output(out, model(out))
        steps += 1
        assert steps < max_steps
    return steps


def make(spec: SpeculativeConfig | None, budget: int = 64, num_blocks: int = 64, max_model_len: int = 512,
         caching: bool = True) -> Scheduler:
    return Scheduler(SchedulerConfig(budget, 16, speculative_config=spec),
                     CacheConfig(block_size=4, enable_prefix_caching=caching), num_blocks, max_model_len)


def cycle(period: int):
    """A model that repeats the prompt's last `period` tokens forever: what prompt lookup is for."""
    return lambda seq: seq[-period]


def test_drafted_decoding_gives_the_same_tokens_in_fewer_steps_and_frees_every_block() -> None:
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7, 9, 8, 7, 5], list(range(20, 33))]
    results = {}
    for spec in (None, ngram(k=4, low=2, high=3)):
        scheduler = make(spec)
        requests = [request(p, max_tokens=37) for p in prompts]
        steps = run(scheduler, LookupModel(cycle(5)), requests)
        results[spec is not None] = ([r.output_token_ids for r in requests], steps)
        assert all(r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 37 for r in requests)
        kv = scheduler.kv_cache_manager
        assert kv.num_used_blocks == 0 and kv.num_free_blocks == kv.num_blocks
    (plain_tokens, plain_steps), (spec_tokens, spec_steps) = results[False], results[True]
    assert spec_tokens == plain_tokens
    assert spec_steps < plain_steps / 2.5  # up to 5 tokens a step once the cycle shows in the sequence
    stats = scheduler.speculator.stats
    assert 0 < stats.num_accepted_tokens <= stats.num_draft_tokens <= 4 * stats.num_drafts
    assert stats.accepted_per_position[0] >= stats.accepted_per_position[3] > 0
    assert sum(stats.accepted_per_position) == stats.num_accepted_tokens


def test_a_stop_inside_the_accepted_drafts_drops_what_follows_it() -> None:
    for stop in ({"stop_token_ids": [3]}, {"max_tokens": 6}):
        scheduler = make(ngram(k=4, low=2, high=2))
        r = request([1, 2, 3, 4, 1, 2], **({"max_tokens": 50} | stop))
        run(scheduler, LookupModel(cycle(4)), [r])
        if "stop_token_ids" in stop:
            assert r.output_token_ids == [3] and r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason == 3
        else:
            assert r.output_token_ids == [3, 4, 1, 2, 3, 4] and r.status == RequestStatus.FINISHED_LENGTH
        assert scheduler.kv_cache_manager.num_used_blocks == 0


def test_rejected_drafts_are_given_back_and_never_cached() -> None:
    """A model that takes some drafts and refuses others: each step's rejected positions are rolled back and
    recomputed, no block past the request's known tokens is held between steps, and the prefix cache afterwards holds
    the blocks of the real sequence."""
    truth = lambda seq: 1 if len(seq) % 3 == 0 else 2
    scheduler = make(ngram(k=4, low=1, high=1))
    r = request([1, 2, 1, 2, 1, 2, 1, 2], max_tokens=24)
    scheduler.add_request(r)
    model = LookupModel(truth)
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        scheduler.update_from_output(out, model(out))
        if scheduler.has_unfinished_requests():
            held = len(scheduler.kv_cache_manager.block_ids(r.request_id))
            assert -(-r.num_computed_tokens // 4) <= held <= -(-r.num_tokens // 4)  # nothing past the known tokens
            assert r.num_computed_tokens == r.num_tokens - 1
    expected = [1, 2, 1, 2, 1, 2, 1, 2]
    for _ in range(24):
        expected.append(truth(expected))
    assert r.all_token_ids == expected
    stats = scheduler.speculator.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # some kept, some refused
    again = request([*r.all_token_ids, 7])
    _, num_hit = scheduler.kv_cache_manager.get_computed_blocks(again)
    assert num_hit == 28  # the full blocks before the last one (which filled only with the final token)


class RefusingModel(LookupModel):
    """Refuses every draft (samples another token in the first drafted row)."""

    def __call__(self, out: SchedulerOutput) -> ModelRunnerOutput:
        result = super().__call__(out)
        for s in out.scheduled:
            if s.draft_token_ids:
                result.accepted_draft_token_ids[s.request_id] = []
                result.sampled_token_ids[s.request_id] = s.draft_token_ids[0] + 1
        return result


def test_a_request_whose_drafts_fail_stops_proposing() -> None:
    """Acceptance falls, the request pauses for 4, 8, ... 64 of its own tokens: over 400 tokens of a model that
    refuses every draft, 3 steps before the first pause and one after each (12 in all) carry drafts, k times the
    running acceptance of them (4, 2, 1, then one a trial); a model that keeps them drafts k on every step."""
    scheduler = make(ngram(k=4, low=1, high=1), max_model_len=1024, num_blocks=300)
    r = request([5, 6, 5, 6], max_tokens=400)
    run(scheduler, RefusingModel(cycle(2)), [r])
    stats = scheduler.speculator.stats
    assert stats.num_accepted_tokens == 0 and stats.num_drafts == 3 + 9, stats  # pauses: 4 8 16 32 64 64 64 64 64
    assert stats.num_draft_tokens == 4 + 2 + 1 + 9, stats
    scheduler = make(ngram(k=4, low=1, high=1), max_model_len=1024, num_blocks=300)
    r = request([5, 6, 5, 6], max_tokens=400)
    steps = run(scheduler, LookupModel(cycle(2)), [r])
    # A prefill step, then 80 steps of 4 kept drafts and the model's own token (the last one drafts the 3 left).
    assert steps == 1 + 80 and scheduler.speculator.stats.num_accepted_tokens == 400 - 1 - 80


def test_drafts_respect_the_budget_max_model_len_and_blocks_and_never_preempt() -> None:
    # A budget of 3 positions: one request gets 1 + 2 drafts at most.
    scheduler = make(ngram(k=4, low=1, high=2), budget=3)
    r = request([1, 2, 1, 2, 1, 2], max_tokens=20)
    run(scheduler, LookupModel(cycle(2)), [r])
    assert r.num_output_tokens == 20 and scheduler.speculator.stats.num_draft_tokens <= 2 * scheduler.speculator.stats.num_drafts
    # max_model_len 16: the last tokens draft only what fits, and the request ends with "length" at 16.
    scheduler = make(ngram(k=4, low=1, high=2), max_model_len=16)
    r = request([1, 2, 1, 2, 1, 2], max_tokens=100)
    run(scheduler, LookupModel(cycle(2)), [r])
    assert r.num_tokens == 16 and r.status == RequestStatus.FINISHED_LENGTH
    # A pool with no room for drafts: requests decode plainly rather than preempt one another.
    scheduler = make(ngram(k=4, low=1, high=2), num_blocks=8)
    requests = [request([1, 2, 1, 2, 1, 2, 1], max_tokens=8), request([3, 4, 3, 4, 3, 4, 3], max_tokens=8)]
    run(scheduler, LookupModel(cycle(2)), requests)
    assert [r.output_token_ids for r in requests] == [[2, 1] * 4, [4, 3] * 4]
    assert all(r.num_preemptions == 0 for r in requests)


def test_randomized_workloads_give_the_plain_tokens_and_keep_the_pool_whole() -> None:
    rng = random.Random(1)
    for trial in range(40):
        period = rng.randint(1, 6)
        cyclic = trial % 2 == 0

        def truth(seq: list[int], period: int = period, cyclic: bool = cyclic) -> int:
            return seq[-period] if cyclic and len(seq) >= period else sum(seq[-3:]) % 7

        prompts = [[rng.randint(0, 5) for _ in range(rng.randint(1, 30))] for _ in range(rng.randint(1, 6))]
        max_tokens = [rng.randint(1, 40) for _ in prompts]
        budget, blocks = rng.choice([8, 16, 64]), rng.choice([24, 48, 200])
        spec = ngram(k=rng.randint(1, 5), low=1, high=rng.randint(1, 4))
        results = []
        for config in (None, spec):
            scheduler = make(config, budget=budget, num_blocks=blocks, max_model_len=128)
            requests = [request(p, max_tokens=m) for p, m in zip(prompts, max_tokens, strict=True)]
            run(scheduler, LookupModel(truth), requests)
            results.append([r.output_token_ids for r in requests])
            assert scheduler.kv_cache_manager.num_used_blocks == 0
        assert results[0] == results[1], trial


class CountingMatcher:
    """Allows the tokens in `allowed` and ends after `length` tokens; records what it accepted."""

    def __init__(self, allowed: set[int], length: int = 100) -> None:
        self.allowed, self.length, self.accepted = allowed, length, []

    def accept_token(self, token: int) -> bool:
        if token not in self.allowed or self.is_terminated():
            return False
        self.accepted.append(token)
        return True

    def is_terminated(self) -> bool:
        return len(self.accepted) >= self.length

    def rollback(self, n: int) -> None:
        del self.accepted[len(self.accepted) - n :]


def test_the_grammar_vets_drafts_and_is_left_as_it_was() -> None:
    from lmserve.spec_decode.speculator import vetted

    matcher = CountingMatcher({1, 2, 3})
    matcher.accepted = [9]  # what the request's output already put through it
    assert vetted(matcher, [1, 2, 7, 3]) == [1, 2] and matcher.accepted == [9]
    assert vetted(matcher, [5]) == [] and matcher.accepted == [9]
    ending = CountingMatcher({1, 2, 3}, length=3)
    ending.accepted = [1]
    assert vetted(ending, [2, 3, 1]) == [2, 3] and ending.accepted == [1]  # nothing after the grammar's end


def test_an_abort_or_a_preemption_while_drafts_are_in_flight_loses_nothing() -> None:
    """Aborted between its drafted step's plan and the step's output: the output is dropped and every block freed.
    Preempted meanwhile (async engines update after the next plan): the kept tokens stay, and the request recomputes
    from position 0 (its blocks are gone), never from the rolled-back position."""
    scheduler = make(ngram(k=4, low=1, high=2))
    model = LookupModel(cycle(2))
    r = request([1, 2, 1, 2, 1, 2], max_tokens=30)
    scheduler.add_request(r)
    scheduler.update_from_output(out := scheduler.schedule(), model(out))  # the prompt
    out = scheduler.schedule()
    assert out.scheduled[0].draft_token_ids
    scheduler.abort_requests([r.request_id])
    assert scheduler.update_from_output(out, model(out)) == []
    assert scheduler.kv_cache_manager.num_used_blocks == 0 and not scheduler.has_unfinished_requests()

    r = request([1, 2, 1, 2, 1, 2], max_tokens=30)
    scheduler.add_request(r)
    scheduler.update_from_output(out := scheduler.schedule(), model(out))
    out = scheduler.schedule()
    drafts = out.scheduled[0].draft_token_ids
    scheduler._preempt(r, {})  # what a later plan's preemption does to it
    outputs = scheduler.update_from_output(out, model(out))
    assert outputs[0].new_token_ids == [*drafts, drafts[-1] ^ 3]  # the cycle 1, 2: all kept, then the next
    assert r.num_computed_tokens == 0 and r.status == RequestStatus.PREEMPTED
    run(scheduler, model, [])
    assert r.all_token_ids == [1, 2] * 18 and scheduler.kv_cache_manager.num_used_blocks == 0
