"""Engine defects of issue 17, each test written to fail on the code before its fix: admission that over-committed
the KV cache, seeded sampling that changed after a preemption, stop strings inside min_tokens, priority ignored under
FCFS, and `lmserve schedule --calibrate`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from test_scheduler import FakeRunner, make_request, make_scheduler, step

from lmserve import LLM, SamplingParams
from lmserve.plan.cost_model import calibrate

# ------------------------------------------------------------------------------------------ admission


def test_admission_counts_blocks_promised_to_admitted_prefills() -> None:
    """6 blocks of 4 tokens, 4-token chunks: two 20-token prompts cannot both be admitted against the same free
    blocks. Before the fix the second was admitted at once, preempted after 12 positions and recomputed from 0."""
    sched = make_scheduler(budget=100, threshold=4, num_blocks=6, block_size=4, caching=False)
    sched.add_request(make_request("a", range(1, 21), max_tokens=2))
    sched.add_request(make_request("b", range(101, 121), max_tokens=2))
    runner = FakeRunner()
    positions = {"a": 0, "b": 0}
    finished: set[str] = set()
    for _ in range(40):
        if not sched.has_unfinished_requests():
            break
        out, outputs = step(sched, runner)
        assert not out.preempted_request_ids, f"preempted {out.preempted_request_ids}"
        for s in out.scheduled:
            positions[s.request_id] += s.num_tokens
        finished |= {o.request_id for o in outputs if o.finish_reason}
        if "a" not in finished:
            assert "b" not in sched.requests or sched.requests["b"].num_computed_tokens == 0
    assert finished == {"a", "b"}
    # Each prompt computed once (20 positions) plus one decode: nothing was recomputed.
    assert positions == {"a": 21, "b": 21}


def test_a_request_that_fits_beside_a_prefill_is_admitted() -> None:
    """The promise counts only blocks still to be allocated: a waiting request that fits in the rest goes in."""
    sched = make_scheduler(budget=100, threshold=4, num_blocks=8, block_size=4, caching=False)
    sched.add_request(make_request("a", range(1, 21), max_tokens=2))  # 5 blocks in all
    sched.add_request(make_request("b", range(101, 109), max_tokens=2))  # 2 blocks: 5 + 2 <= 8
    out, _ = step(sched)
    assert {s.request_id for s in out.scheduled} == {"a", "b"}


# --------------------------------------------------------------------------------- seeds and preemption

SEEDED_PROMPTS = [
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "The quick brown fox",
    "Here is a short poem about autumn leaves falling gently to the ground:\n",
    "Photosynthesis is the process by which plants",
]


@pytest.fixture(scope="module")
def big_pool() -> Iterator[LLM]:
    yield LLM(dtype="float32", num_blocks=64)


@pytest.fixture(scope="module")
def tiny_pool() -> Iterator[LLM]:
    yield LLM(dtype="float32", num_blocks=4)  # 4 blocks of 16: the four requests below need 8 at once


def test_seeded_request_gives_the_same_tokens_after_preemption(big_pool: LLM, tiny_pool: LLM) -> None:
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=7 + i, max_tokens=20, ignore_eos=True)
              for i in range(len(SEEDED_PROMPTS))]
    alone = [big_pool.generate(p, sp)[0].outputs[0].token_ids for p, sp in zip(SEEDED_PROMPTS, params, strict=True)]
    preempted_before = tiny_pool.engine.num_preemptions
    outputs = tiny_pool.generate(SEEDED_PROMPTS, params)
    assert tiny_pool.engine.num_preemptions > preempted_before, "the tiny pool was expected to preempt"
    assert [o.outputs[0].token_ids for o in outputs] == alone


# -------------------------------------------------------------------------------------------- policies


def test_priority_without_priority_scheduling_is_refused(big_pool: LLM) -> None:
    with pytest.raises(ValueError, match="priority scheduling is not enabled"):
        big_pool.generate(["Hello"], SamplingParams(max_tokens=2), priority=[3])
    (out,) = big_pool.generate(["Hello"], SamplingParams(max_tokens=2), priority=[0])
    assert len(out.outputs[0].token_ids) <= 2


def test_stop_strings_wait_for_min_tokens(big_pool: LLM) -> None:
    """As vLLM: a stop string in the first min_tokens tokens does not end the request."""
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    (free,) = big_pool.generate("1, 2, 3, 4, 5,", greedy)
    text = free.outputs[0].text
    assert "," in text, text
    stop = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[","])
    (early,) = big_pool.generate("1, 2, 3, 4, 5,", stop)
    assert early.outputs[0].finish_reason == "stop" and len(early.outputs[0].token_ids) < 6
    held = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[","], min_tokens=6)
    (late,) = big_pool.generate("1, 2, 3, 4, 5,", held)
    assert len(late.outputs[0].token_ids) > 6
    assert late.outputs[0].token_ids == free.outputs[0].token_ids[: len(late.outputs[0].token_ids)]


# ----------------------------------------------------------------------------------------- calibrate


def test_schedule_calibrate_runs_on_the_tiny_model(tiny_llama_dir: Path) -> None:
    cost = calibrate(str(tiny_llama_dir), sizes=(1, 8, 32), repeats=1)
    assert cost.ms_per_position >= 0 and cost.ms_per_step >= 0
    assert cost.ms_per_position + cost.ms_per_step > 0
    assert "calibrate" in cost.source
