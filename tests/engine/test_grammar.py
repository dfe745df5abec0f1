"""Constrained decoding in the engine: outputs follow the grammar at any sampling setting; a grammar still compiling
holds back only its own request; a grammar that fails ends its request instead of running it unconstrained."""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future

import jsonschema
import pytest
import torch
from test_scheduler import FakeRunner, make_scheduler, step

from lmserve import LLM, SamplingParams
from lmserve.engine.grammar import GrammarManager
from lmserve.engine.request import Request
from lmserve.executor.multiproc import MultiprocExecutor
from lmserve.sampling_params import StructuredOutputsParams
from lmserve.step import SchedulerOutput

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "legs": {"type": "integer", "minimum": 0, "maximum": 8},
    "tags": {"type": "array", "items": {"enum": ["pet", "wild", "farm"]}, "maxItems": 2}},
    "required": ["name", "legs", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_model_len=512, kv_cache_memory="64MiB")


@pytest.mark.parametrize("sampling", [
    {"temperature": 0.0}, {"temperature": 1.0, "seed": 1}, {"temperature": 1.5, "top_p": 0.9, "seed": 2},
    {"temperature": 1.0, "top_k": 5, "min_p": 0.05, "repetition_penalty": 1.3, "seed": 3},
])
def test_offline_outputs_follow_the_schema_at_any_sampling(llm: LLM, sampling: dict) -> None:
    params = SamplingParams(max_tokens=120, structured_outputs=StructuredOutputsParams(json=SCHEMA), **sampling)
    for out in llm.generate(["An animal as JSON:", "Describe a dog."], params):
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)


def test_greedy_drawn_unmasked_first_equals_greedy_masked_first(llm: LLM) -> None:
    # Greedy rows draw without the mask and redraw only when refused; top_k=1 at temperature 1 is the same argmax
    # but is masked before drawing: both must give the same tokens.
    spec = StructuredOutputsParams(json=SCHEMA)
    prompts = ["An animal as JSON:", "Describe a dog.", "A farm animal:"]
    greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=spec))
    top1 = llm.generate(prompts, SamplingParams(temperature=1.0, top_k=1, max_tokens=120, structured_outputs=spec))
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in top1]


def test_offline_choice_and_bad_regex(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, seed=4, max_tokens=8,
                            structured_outputs=StructuredOutputsParams(choice=["left", "right"]))
    assert llm.generate("Which way?", params)[0].outputs[0].text in ("left", "right")
    with pytest.raises(ValueError, match="regex"):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(regex="([")))


class AnyToken:
    """A matcher that allows every token and never ends."""

    def fill_next_token_bitmask(self, mask: torch.Tensor, row: int) -> None:
        pass

    def accept_token(self, token_id: int) -> bool:
        return True

    def is_terminated(self) -> bool:
        return False

    def rollback(self, num_tokens: int) -> None:
        pass


class FakeBatchMatcher:
    def __init__(self, threads: int) -> None:
        pass

    def batch_fill_next_token_bitmask(self, matchers: list, mask: torch.Tensor) -> None:
        for row, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(mask, row)


class FakeXgrammar:
    GrammarMatcher = staticmethod(lambda compiled: compiled)
    BatchGrammarMatcher = FakeBatchMatcher
    allocate_token_bitmask = staticmethod(lambda n, v: torch.full((n, (v + 31) // 32), -1, dtype=torch.int32))


class SlowGrammars(GrammarManager):
    """Compiles only once `release` is set, or fails for the grammar "fail"."""

    def __init__(self) -> None:
        super().__init__("unused", vocab_size=64, eos_token_ids=[0])
        self.release = threading.Event()

    def _compile(self, kind: str, text: str, json_whitespace: bool) -> object:
        self.release.wait(10)
        if text == "fail":
            raise RuntimeError("cannot compile")
        return AnyToken()


def test_a_compiling_grammar_waits_alone_and_a_failed_one_ends_its_request(monkeypatch) -> None:
    grammars = SlowGrammars()
    monkeypatch.setattr("lmserve.engine.grammar.xgrammar", FakeXgrammar)
    sched = make_scheduler(grammar=grammars)
    constrained = Request("constrained", [1, 2, 3], SamplingParams(
        max_tokens=2, structured_outputs=StructuredOutputsParams(regex="[a-z]")))
    failing = Request("failing", [1, 2, 3], SamplingParams(
        max_tokens=2, structured_outputs=StructuredOutputsParams(regex="fail")))
    plain = Request("plain", [4, 5, 6], SamplingParams(max_tokens=2))
    for request in (constrained, failing, plain):
        sched.add_request(request)
    out, _ = step(sched)
    assert [s.request_id for s in out.scheduled] == ["plain"]  # behind two compiling grammars, it still runs
    grammars.release.set()
    grammars._executor.shutdown(wait=True)
    out, outputs = step(sched, FakeRunner(lambda _: 7))
    assert "constrained" in [s.request_id for s in out.scheduled]
    assert list(out.grammar.matchers) == ["constrained"] and out.grammar.fill(["constrained"]).shape == (1, 2)
    failed = [o for o in outputs if o.request_id == "failing"]
    assert failed and failed[0].finish_reason == "abort"


def test_a_grammar_that_starts_after_a_token_leaves_the_thinking_before_it_free(llm: LLM) -> None:
    """A reasoning model's grammar starts after its `</think>` (StructuredOutputsParams.after_token_id, set by the
    server under --reasoning-parser): a token the grammar would refuse is sampled freely until that token, and the
    grammar holds from the next one on. Here a logit bias forces a stand-in token, which the choice refuses."""
    stand_in = llm.tokenizer.encode(" Hmm", add_special_tokens=False)[0]
    bias = {stand_in: 100.0}
    deferred = StructuredOutputsParams(choice=["yes", "no"], after_token_id=stand_in)
    out = llm.generate("Is water wet?", SamplingParams(temperature=0.0, max_tokens=8, logit_bias=bias,
                                                      structured_outputs=deferred))[0].outputs[0]
    assert out.token_ids[0] == stand_in and out.finish_reason == "stop"
    assert llm.tokenizer.decode(out.token_ids[1:], skip_special_tokens=True) in ("yes", "no")  # the grammar
    at_once = StructuredOutputsParams(choice=["yes", "no"])
    out = llm.generate("Is water wet?", SamplingParams(temperature=0.0, max_tokens=8, logit_bias=bias,
                                                      structured_outputs=at_once))[0].outputs[0]
    assert stand_in not in out.token_ids and out.text in ("yes", "no")


def test_a_seeded_constrained_request_draws_the_same_under_every_executor(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks in their own processes get every row's mask before the draw; in process the draw used to come first,
    redrawn under the mask when refused: the same distribution, other tokens for the same seed.

    The ranks' masks are filled after their step was sent, while they run its forward pass (vLLM's
    execute_model / sample_tokens split): each constrained step goes out without its masks, and they follow."""
    events: list[tuple[str, object]] = []
    submit, send_masks = MultiprocExecutor.submit, MultiprocExecutor.send_grammar_masks

    def recording_submit(self: MultiprocExecutor, scheduler_output: SchedulerOutput) -> Future:
        if scheduler_output.grammar is not None:
            events.append(("step without masks", scheduler_output.grammar.mask is None))
        return submit(self, scheduler_output)

    def recording_send(self: MultiprocExecutor, mask: torch.Tensor) -> None:
        events.append(("masks", mask.shape[0]))
        send_masks(self, mask)

    monkeypatch.setattr(MultiprocExecutor, "submit", recording_submit)
    monkeypatch.setattr(MultiprocExecutor, "send_grammar_masks", recording_send)
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=60,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    prompts = ["An animal as JSON:", "A dog:", "A cat:"]
    outputs = {}
    for backend in ("uni", "mp"):
        with LLM(max_model_len=512, kv_cache_memory="64MiB", distributed_executor_backend=backend) as llm:
            outputs[backend] = [(o.outputs[0].token_ids, o.outputs[0].text) for o in llm.generate(prompts, params)]
    assert outputs["uni"] == outputs["mp"]
    for _, text in outputs["uni"]:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(events) >= 2 * 20, events  # one step per token of the three JSON objects, at least
    assert events[0::2] == [("step without masks", True)] * (len(events) // 2)
    assert [kind for kind, _ in events[1::2]] == ["masks"] * (len(events) // 2)
    assert max(rows for _, rows in events[1::2]) == len(prompts)  # all three rows of a step in one send
