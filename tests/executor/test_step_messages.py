"""A step's plan sent to other processes as per-step changes (issue 37, item 5): what a rank rebuilds equals what the
engine planned, field for field, whatever the requests' lists do between steps; and a decode step's message does not
grow with the requests' contexts."""

from __future__ import annotations

import pickle
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from lmserve.executor.step_messages import ListTail, StepDecoder, StepEncoder
from lmserve.sampling_params import SamplingParams
from lmserve.step import ScheduledRequest, SchedulerOutput


class Live:
    """A request as the engine holds it: an output that grows, block tables that grow, shrink and blank."""

    def __init__(self, rid: str, rng: random.Random, groups: int) -> None:
        self.rid = rid
        self.prompt = [rng.randrange(50_000) for _ in range(rng.randrange(1, 300))]
        self.params = SamplingParams(temperature=rng.choice([0.0, 0.7]), seed=rng.randrange(100))
        self.output: list[int] = []
        self.blocks = [rng.randrange(1000) for _ in range(rng.randrange(1, 20))]
        self.groups = [list(self.blocks) for _ in range(groups)] if groups > 1 else []

    def scheduled(self, rng: random.Random) -> ScheduledRequest:
        return ScheduledRequest(
            request_id=self.rid, token_ids=[rng.randrange(50_000) for _ in range(rng.randrange(1, 4))],
            start_position=len(self.prompt) + len(self.output), block_ids=list(self.blocks),
            group_block_ids=[list(t) for t in self.groups], samples=rng.random() < 0.8,
            sampling_params=self.params, prompt_token_ids=self.prompt, output_token_ids=self.output,
            eos_token_ids=[2], draft_token_ids=[rng.randrange(50_000)] if rng.random() < 0.2 else [],
            prompt_logprob_targets=[1, 2] if rng.random() < 0.1 else [],
        )

    def change(self, rng: random.Random) -> None:
        self.output.extend(rng.randrange(50_000) for _ in range(rng.choice([0, 1, 1, 3])))
        what = rng.random()
        if what < 0.5:
            self.blocks.append(rng.randrange(1000))
        elif what < 0.6 and len(self.blocks) > 1:
            del self.blocks[rng.randrange(1, len(self.blocks)) :]  # drafts rolled back
        for table in self.groups:
            table[: len(self.blocks)] = self.blocks[: len(table)]
            if rng.random() < 0.3 and table:
                first = rng.randrange(len(table))
                table[:first] = [-1] * first  # out of a sliding window
            if rng.random() < 0.3:
                table.append(rng.randrange(1000))


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), groups=st.sampled_from([1, 2]))
def test_what_a_rank_rebuilds_is_what_the_engine_planned(seed: int, groups: int) -> None:
    rng = random.Random(seed)
    encoder, decoder = StepEncoder(), StepDecoder()
    live: dict[str, Live] = {}
    next_id = 0
    for _ in range(40):
        finished: set[str] = set()
        preempted: set[str] = set()
        for rid in list(live):
            roll = rng.random()
            if roll < 0.08:
                finished.add(rid)
                del live[rid]
            elif roll < 0.14:  # preempted: freed, later scheduled again with new blocks and its output kept
                finished.add(rid)
                preempted.add(rid)
                live[rid].blocks = [rng.randrange(1000) for _ in range(len(live[rid].blocks))]
            else:
                live[rid].change(rng)
        for _ in range(rng.randrange(3)):
            live[f"r{next_id}"] = Live(f"r{next_id}", rng, groups)
            next_id += 1
        chosen = [r for r in live.values() if r.rid not in preempted or rng.random() < 0.5]
        planned = SchedulerOutput(
            scheduled=[r.scheduled(rng) for r in chosen], finished_request_ids=finished,
            preempted_request_ids=preempted, num_batched_tokens=rng.randrange(100), kv_saves=[(1, "ab")],
        )
        rebuilt = decoder.decode(pickle.loads(pickle.dumps(encoder.encode(planned))))
        assert rebuilt == planned
        assert decoder.num_requests == encoder.num_requests
        # The rank's lists are its own: the engine's later appends reach it only through the next message.
        for s in rebuilt.scheduled:
            assert s.output_token_ids is not live[s.request_id].output


def test_a_decode_step_does_not_grow_with_the_context() -> None:
    rng = random.Random(0)
    encoder = StepEncoder()
    requests = []
    for i in range(64):
        r = Live(f"r{i}", rng, 1)
        r.prompt = [rng.randrange(50_000) for _ in range(2000)]
        r.output.extend(rng.randrange(50_000) for _ in range(500))
        r.blocks = list(range(i * 160, i * 160 + 157))
        requests.append(r)

    def step() -> SchedulerOutput:
        return SchedulerOutput(scheduled=[r.scheduled(rng) for r in requests])

    first = len(pickle.dumps(encoder.encode(step())))
    for r in requests:
        r.output.append(7)
    whole = len(pickle.dumps(step()))
    later = len(pickle.dumps(encoder.encode(step())))
    assert first > 64 * 2500 * 2  # the first time every request goes whole (token ids pickle to 2-5 bytes)
    assert whole > 64 * 2500 * 2  # as every step did before
    assert later < whole / 20, (later, whole)
    assert later < 64 * 250  # a few hundred bytes a request, whatever its context


def test_a_list_tail_keeps_the_longest_unchanged_prefix() -> None:
    assert ListTail.between([1, 2, 3], [1, 2, 3, 4]) == ListTail(3, [4])
    assert ListTail.between([1, 2, 3], [1, 2]) == ListTail(2, [])
    assert ListTail.between([1, 2, 3], [-1, 2, 3, 5]) == ListTail(0, [-1, 2, 3, 5])
    assert ListTail.between([1, 2, 3], [1, 9, 3]) == ListTail(1, [9, 3])
    held = [1, 2, 3]
    ListTail(1, [9, 3, 4]).apply(held)
    assert held == [1, 9, 3, 4]
