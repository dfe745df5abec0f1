"""Prompt logprobs (vLLM's SamplingParams.prompt_logprobs): every prompt token scored once, as transformers scores
it, across prefill chunks, prefix-cache hits and preemptions."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from test_scheduler import FakeRunner, make_scheduler, step

from lmserve import LLM, SamplingParams
from lmserve.engine.request import Request
from lmserve.outputs import Logprobs
from lmserve.step import ModelRunnerOutput, SchedulerOutput

PROMPT = [(7 * i + 3) % 500 + 1 for i in range(45)]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> torch.Tensor:
    """transformers' log-probabilities after each prompt position, one full forward."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0]
    return logits.float().log_softmax(-1)


def assert_matches_reference(prompt_logprobs: list[Logprobs | None] | None, reference: torch.Tensor, k: int) -> None:
    assert prompt_logprobs is not None and len(prompt_logprobs) == len(PROMPT)
    assert prompt_logprobs[0] is None
    for position, entry in enumerate(prompt_logprobs[1:]):
        assert entry is not None
        expected = reference[position]
        assert entry.token_id == PROMPT[position + 1]
        assert entry.logprob == pytest.approx(expected[entry.token_id].item(), abs=2e-4)
        # A random model's distribution is nearly flat: ranks may swap among ties within rounding.
        target = expected[entry.token_id]
        ties = int(((expected - target).abs() < 1e-4).sum())
        assert abs(entry.rank - (int((expected > target).sum()) + 1)) < ties
        assert [lp for _, lp in entry.top] == pytest.approx(expected.topk(k).values.tolist(), abs=2e-4)
        assert all(lp == pytest.approx(expected[t].item(), abs=2e-4) for t, lp in entry.top)


def test_prompt_logprobs_match_transformers_across_chunks_and_cache_hits(
    tiny_llama_dir: Path, reference: torch.Tensor
) -> None:
    # A 16-token budget prefills the 45-token prompt in three chunks; the second request's prompt is all cached.
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", num_blocks=64, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
    first, second = (llm.generate(PROMPT, params)[0] for _ in range(2))
    assert_matches_reference(first.prompt_logprobs, reference, 3)
    assert_matches_reference(second.prompt_logprobs, reference, 3)
    # Without prompt_logprobs the same prompt does hit the cache: it was the request that bypassed it.
    plain = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=2))[0]
    assert plain.prompt_logprobs is None and plain.num_cached_tokens > 0


def test_n_children_share_one_scoring_of_the_prompt(tiny_llama_dir: Path, reference: torch.Tensor) -> None:
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", num_blocks=64)
    (out,) = llm.generate(PROMPT, SamplingParams(n=3, max_tokens=2, seed=1, prompt_logprobs=0))
    assert len(out.outputs) == 3
    assert_matches_reference(out.prompt_logprobs, reference, 0)


class ScoringRunner(FakeRunner):
    """Scores each prompt target with a Logprobs naming the position it was scored at, counting every scoring."""

    def __init__(self) -> None:
        super().__init__()
        self.scored: list[int] = []

    def __call__(self, out: SchedulerOutput) -> ModelRunnerOutput:
        result = super().__call__(out)
        for s in out.scheduled:
            first = s.start_position + s.prompt_logprobs_row
            positions = range(first, first + len(s.prompt_logprob_targets))
            self.scored.extend(positions)
            result.prompt_logprobs[s.request_id] = [
                Logprobs(token_id=t, logprob=-float(p), rank=1, top=[])
                for p, t in zip(positions, s.prompt_logprob_targets, strict=True)
            ]
        return result


def test_a_preempted_request_scores_each_prompt_token_once_and_sends_them_once() -> None:
    # 8 blocks of 4 tokens, 4 tokens a step: "other" decodes into the block the victim holds mid-prefill.
    sched = make_scheduler(budget=4, num_blocks=8, block_size=4)
    sched.add_request(Request("other", list(range(30, 40)), SamplingParams(max_tokens=12, ignore_eos=True)))
    victim = Request("victim", list(range(1, 21)), SamplingParams(max_tokens=4, prompt_logprobs=1))
    sched.add_request(victim)  # the later arrival: FCFS preempts it first
    runner = ScoringRunner()
    sent: list[list[Logprobs]] = []
    preempted = False
    for _ in range(100):
        if not sched.has_unfinished_requests():
            break
        out, outputs = step(sched, runner)
        preempted |= "victim" in out.preempted_request_ids
        sent.extend(o.prompt_logprobs for o in outputs if o.request_id == "victim" and o.prompt_logprobs is not None)
    assert preempted, "the test meant to preempt the prompt-logprobs request"
    assert sorted(runner.scored) == list(range(19)), "every position that predicts a prompt token, once"
    (entries,) = sent
    assert [e.token_id for e in entries] == victim.prompt_token_ids[1:]
    assert [e.logprob for e in entries] == [-float(p) for p in range(19)]


def test_prompt_logprobs_are_bounded() -> None:
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
