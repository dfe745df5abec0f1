"""Speculative decoding (prompt lookup) end to end on the default model: greedy tokens equal plain decoding's, the
target distribution is kept at temperature > 0, seeded requests do not depend on their batch, logprobs come with the
kept drafts, and the counters reach the engine's stats and /metrics' collector."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator

import pytest
from test_engine_e2e import assert_idle

from lmserve import LLM, SamplingParams
from lmserve.config import KV_BLOCK_SIZE
from lmserve.metrics.prometheus import EngineStatsCollector
from lmserve.worker.weights.kernel_choice import int16_kernel_loads

ONE = SamplingParams(temperature=0.0, max_tokens=1)
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
CODE = '''def fibonacci(n):
    """Return the n-th Fibonacci number."""
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a
'''
# Prompts whose answers copy from them (what lookup is for), and one that does not.
PROMPTS = [
    "Here is a function:\n\n" + CODE + "\nThe same function again, unchanged:\n\n",
    "one two three four five six seven eight nine ten, one two three four five six seven eight nine ten, one two",
    "The capital of France is",
]


@pytest.fixture(scope="module")
def plain() -> Iterator[LLM]:
    llm = LLM(dtype="float32", num_blocks=200, max_num_seqs=64)
    yield llm
    assert_idle(llm)


@pytest.fixture(scope="module")
def spec() -> Iterator[LLM]:
    llm = LLM(dtype="float32", num_blocks=200, max_num_seqs=64, speculative_config=SPEC)
    yield llm
    assert_idle(llm)


def test_greedy_tokens_equal_plain_decoding_alone_and_batched(plain: LLM, spec: LLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=48)
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, greedy)]
    before = spec.engine.stats()
    batched = [o.outputs[0].token_ids for o in spec.generate(PROMPTS, greedy)]
    alone = [spec.generate(p, greedy)[0].outputs[0].token_ids for p in PROMPTS]
    assert batched == expected and alone == expected
    stats = spec.engine.stats()
    accepted = stats.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    drafted = stats.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    assert 0 < accepted <= drafted
    assert sum(stats.spec_decode_num_accepted_tokens_per_pos) == stats.spec_decode_num_accepted_tokens
    assert len(stats.spec_decode_num_accepted_tokens_per_pos) == SPEC["num_speculative_tokens"]
    assert spec.engine.last_step is not None
    # The copying prompt took fewer steps than tokens: several tokens came out of one forward pass.
    steps_before = spec.engine.num_steps
    spec.generate(PROMPTS[0], greedy)
    assert spec.engine.num_steps - steps_before < 48 * 0.7


@pytest.mark.skipif(not int16_kernel_loads(), reason="int8 activations need the int16 block kernels")
def test_greedy_tokens_equal_plain_decoding_under_8_bit_activations() -> None:
    """--block-activations int8, where a verify step's extra rows cost least: the kept drafts are still plain
    decoding's tokens, batched and alone (each row's 8-bit rounding is its own, whatever shares its step)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=48)
    with LLM(dtype="float32", num_blocks=200, max_num_seqs=64, block_activations="int8") as plain_int8:
        assert plain_int8.engine.executor.runner.block_activations == "int8"
        expected = [o.outputs[0].token_ids for o in plain_int8.generate(PROMPTS, greedy)]
    with LLM(dtype="float32", num_blocks=200, max_num_seqs=64, block_activations="int8",
             speculative_config=SPEC) as spec_int8:
        batched = [o.outputs[0].token_ids for o in spec_int8.generate(PROMPTS, greedy)]
        alone = [spec_int8.generate(p, greedy)[0].outputs[0].token_ids for p in PROMPTS]
        assert spec_int8.engine.stats().spec_decode_num_accepted_tokens > 0
    assert batched == expected and alone == expected


def test_stop_strings_max_tokens_and_logprobs_keep_their_meaning(plain: LLM, spec: LLM) -> None:
    for params in (
        SamplingParams(temperature=0.0, max_tokens=30, stop=["range"]),
        SamplingParams(temperature=0.0, max_tokens=7),
        SamplingParams(temperature=0.0, max_tokens=20, logprobs=3),
        SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.3, min_tokens=5),
    ):
        expected = plain.generate(PROMPTS[0], params)[0].outputs[0]
        got = spec.generate(PROMPTS[0], params)[0].outputs[0]
        assert got.token_ids == expected.token_ids and got.text == expected.text, params
        assert got.finish_reason == expected.finish_reason
        if params.logprobs:
            assert len(got.logprobs) == len(got.token_ids)
            for a, b in zip(got.logprobs, expected.logprobs, strict=True):
                assert (a.token_id, a.rank) == (b.token_id, b.rank)
                assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
                assert [t for t, _ in a.top] == [t for t, _ in b.top] and len(a.top) == 3


def test_a_seeded_request_draws_the_same_alone_or_in_a_batch(spec: LLM) -> None:
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=32)
    alone = spec.generate(PROMPTS[0], seeded)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=24)
    outputs = spec.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]], [others, seeded, others])
    assert outputs[1].outputs[0].token_ids == alone


def test_a_seeded_requests_tokens_do_not_depend_on_its_draft_count(plain: LLM,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """How many drafts a step verifies depends on the step's budget (so on the batch): alone, the seeded request
    verifies 4 a step; beside a long prefill that takes 12 of the 16 positions, 3; without speculation, none. One
    random draw per row, rejected drafts included, made its tokens differ between these; each token's draw now
    depends on where the token is, so all three give the same tokens."""
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=32, ignore_eos=True)
    expected = plain.generate(PROMPTS[0], seeded)[0].outputs[0].token_ids  # no drafts at all
    long_prompt = "A long account of the rivers, mountains and cities of Europe, one after another, " * 40
    with LLM(dtype="float32", num_blocks=400, max_num_seqs=64, speculative_config=SPEC, max_num_batched_tokens=16,
             long_prefill_token_threshold=12) as narrow:
        steps = []
        schedule = narrow.engine.scheduler.schedule

        def recording():
            steps.append(schedule())
            return steps[-1]

        monkeypatch.setattr(narrow.engine.scheduler, "schedule", recording)

        def drafts_of(request_id: str, since: int) -> list[int]:
            return [len(s.draft_token_ids) for step in steps[since:] for s in step.scheduled
                    if s.request_id == request_id and s.draft_token_ids]

        alone = narrow.generate(PROMPTS[0], seeded)[0]
        alone_drafts = drafts_of(alone.request_id, 0)
        first = len(steps)
        beside = narrow.generate([long_prompt, PROMPTS[0]], [SamplingParams(temperature=1.0, max_tokens=4), seeded])
        beside_drafts = drafts_of(beside[1].request_id, first)
        assert len(narrow.generate(long_prompt, ONE)[0].prompt_token_ids) > 400
    assert max(alone_drafts) == 4 and max(beside_drafts) == 3, (alone_drafts, beside_drafts)
    assert alone.outputs[0].token_ids == expected
    assert beside[1].outputs[0].token_ids == expected


def top5_distribution(llm: LLM, prompt_ids: list[int], temperature: float) -> dict[int, float]:
    """The sampler's distribution with top_k=5 at `temperature`, from the model's raw top-5 logprobs."""
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    top = llm.generate([prompt_ids], params)[0].outputs[0].logprobs[0].top
    weights = {token: math.exp(logprob / temperature) for token, logprob in top}
    assert len(weights) == 5
    return {token: w / sum(weights.values()) for token, w in weights.items()}


def chi_square_ok(counts: Counter, expected: dict[int, float]) -> bool:
    """Counts against a distribution at p = 0.001, rare tokens pooled so every cell expects >= 5 draws."""
    draws = sum(counts.values())
    assert set(counts) <= set(expected)
    cells: dict[str, tuple[float, int]] = {}
    for token, p in expected.items():
        key = str(token) if p * draws >= 5 else "rare"
        e, c = cells.get(key, (0.0, 0))
        cells[key] = (e + p * draws, c + counts.get(token, 0))
    chi2 = sum((c - e) ** 2 / e for e, c in cells.values())
    critical = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47}[max(1, len(cells) - 1)]
    return chi2 < critical


def test_the_target_distribution_is_kept_at_temperature_above_zero(plain: LLM, spec: LLM) -> None:
    """The second generated token is the first one a draft can stand for (the first comes from the prompt's own
    step). 800 seeded requests (temperature 2, top_k 5: drafts are refused often): their first tokens follow the
    model's distribution, and the second tokens of those whose first was the most frequent follow the model's
    distribution after it, each by a chi-square test at p = 0.001 (the seeds make the test deterministic).

    The counting prompt is cut to one KV block and one token, so that every request but the first finds the block in
    the prefix cache and computes only its last position: the 800 prompts cost ~800 positions, not ~6,400."""
    temperature = 2.0
    prompt_ids = spec.tokenizer.encode(PROMPTS[1])[:KV_BLOCK_SIZE + 1]
    before = spec.engine.stats()
    draws = 800
    params = [SamplingParams(temperature=temperature, top_k=5, seed=seed, max_tokens=3) for seed in range(draws)]
    outputs = [o.outputs[0].token_ids for o in spec.generate([prompt_ids] * draws, params)]
    first = Counter(ids[0] for ids in outputs)
    assert chi_square_ok(first, top5_distribution(plain, prompt_ids, temperature)), first
    likely = first.most_common(1)[0][0]
    second = Counter(ids[1] for ids in outputs if ids[0] == likely)
    assert chi_square_ok(second, top5_distribution(plain, [*prompt_ids, likely], temperature)), second
    stats = spec.engine.stats()
    drafted = stats.spec_decode_num_drafts - before.spec_decode_num_drafts
    accepted = stats.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    assert drafted >= first[likely]  # the second token was drafted for (the first ends a phrase seen before)
    assert 0 < accepted < stats.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens


def test_the_counters_reach_prometheus(spec: LLM) -> None:
    spec.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=16))
    collector = EngineStatsCollector("m")
    stats = spec.engine.stats()
    collector.stats = {name: getattr(stats, name) for name in stats.__struct_fields__}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for m in collector.collect() for s in m.samples}
    labels = (("engine", "0"), ("model_name", "m"))
    assert samples[("lmserve:spec_decode_num_drafts_total", labels)] == stats.spec_decode_num_drafts > 0
    assert samples[("lmserve:spec_decode_num_accepted_tokens_total", labels)] == stats.spec_decode_num_accepted_tokens
    first = ("lmserve:spec_decode_num_accepted_tokens_per_pos_total", (*labels, ("position", "0")))
    assert samples[first] == stats.spec_decode_num_accepted_tokens_per_pos[0] > 0


def test_a_draft_model_gives_the_plain_greedy_tokens(plain: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default model drafting for itself: every guess is the target's own greedy choice (up to the float
    differences of a one-row pass and a verifying pass), so nearly all are kept; the output equals plain decoding,
    alone and batched, and no block is held after. The draft's guesses are the worker's data: the scheduler's plans
    keep the placeholders it reserved."""
    from lmserve.models import DEFAULT_MODEL, resolve_model
    from lmserve.step import PLACEHOLDER_TOKEN_ID

    draft = {"model": str(resolve_model(DEFAULT_MODEL).path), "num_speculative_tokens": 3}
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, greedy)]
    with LLM(dtype="float32", num_blocks=200, max_num_seqs=64, speculative_config=draft) as llm:
        plans = []
        schedule = llm.engine.scheduler.schedule

        def recording():
            plans.append(schedule())
            return plans[-1]

        monkeypatch.setattr(llm.engine.scheduler, "schedule", recording)
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)] == expected
        drafted = [s for plan in plans for s in plan.scheduled if s.draft_token_ids]
        assert drafted and all(set(s.draft_token_ids) == set(s.token_ids[1:]) == {PLACEHOLDER_TOKEN_ID}
                               for s in drafted)
        assert llm.generate(PROMPTS[2], greedy)[0].outputs[0].token_ids == expected[2]
        stats = llm.engine.stats()
        assert stats.spec_decode_num_accepted_tokens >= 0.8 * stats.spec_decode_num_draft_tokens > 0
        seeded = SamplingParams(temperature=0.8, seed=3, max_tokens=16)
        alone = llm.generate(PROMPTS[0], seeded)[0].outputs[0].token_ids
        batch = llm.generate([PROMPTS[1], PROMPTS[0]], [greedy, seeded])
        assert batch[1].outputs[0].token_ids == alone
        assert_idle(llm)


def test_a_draft_model_of_another_vocabulary_is_refused(tiny_gemma3_chat_gguf) -> None:
    with pytest.raises(ValueError, match="its vocabulary has"):
        LLM(dtype="float32", num_blocks=64,
            speculative_config={"model": str(tiny_gemma3_chat_gguf), "num_speculative_tokens": 2})


LIST_SCHEMA = {"type": "object", "properties": {"animals": {"type": "array", "minItems": 4, "maxItems": 4, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 10}, "legs": {"type": "integer"}},
    "required": ["name", "legs"], "additionalProperties": False}}}, "required": ["animals"],
    "additionalProperties": False}


def test_constrained_requests_draft_under_their_grammar(plain: LLM, spec: LLM) -> None:
    """JSON whose keys repeat (what lookup finds): drafts are vetted by the grammar, each drafted row is sampled under
    the grammar advanced by the drafts before it, and the output is plain constrained decoding's, greedy and seeded."""
    import json

    import jsonschema

    from lmserve.sampling_params import StructuredOutputsParams

    constrained = StructuredOutputsParams(json=LIST_SCHEMA)
    prompt = "Four animals and their legs, as JSON:"
    before = spec.engine.stats()
    for params in (SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=constrained),
                   SamplingParams(temperature=0.7, seed=5, max_tokens=120, structured_outputs=constrained)):
        expected = plain.generate(prompt, params)[0].outputs[0]
        got = spec.generate(prompt, params)[0].outputs[0]
        jsonschema.validate(json.loads(got.text), LIST_SCHEMA)
        if params.temperature == 0.0:
            assert got.token_ids == expected.token_ids
    stats = spec.engine.stats()
    assert stats.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens > 10


def test_n_samples_with_drafts_are_each_the_plain_ones(plain: LLM, spec: LLM) -> None:
    """Children of an n>1 request draft each on their own: greedy children equal plain decoding's, sampled ones are
    well formed, and the engine ends with no block held."""
    greedy = SamplingParams(temperature=0.0, max_tokens=24, n=2)
    expected = plain.generate(PROMPTS[0], greedy)[0].outputs
    got = spec.generate(PROMPTS[0], greedy)[0].outputs
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    sampled = spec.generate(PROMPTS[1], SamplingParams(temperature=0.8, seed=9, max_tokens=24, n=3))[0].outputs
    assert len(sampled) == 3 and all(len(c.token_ids) == 24 or c.finish_reason == "stop" for c in sampled)
    assert_idle(spec)
