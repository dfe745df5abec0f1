"""Bad input gets a clear exception that names the problem, and the LLM keeps working afterwards.

A tiny random Llama (with the default model's tokenizer) stands in for a real model: errors do not depend on weights.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmserve import LLM, SamplingParams

MAX_MODEL_LEN = 64


def assert_idle(llm: LLM) -> None:
    assert not llm.engine.has_unfinished_requests()
    assert set(llm.engine.scheduler.kv_cache_manager.ref_counts()) == {0}
    assert not llm.output_processor.parents


def assert_still_works(llm: LLM) -> None:
    (out,) = llm.generate("Hello there", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 3
    assert out.outputs[0].finish_reason == "length"
    assert_idle(llm)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> Iterator[LLM]:
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", max_model_len=MAX_MODEL_LEN, num_blocks=32)
    yield llm
    assert_idle(llm)


# -------------------------------------------------------------------------------------------- construction


def test_missing_model_path_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError) as err:
        LLM(model=str(missing))
    assert str(missing) in str(err.value)


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        LLM(model=str(tmp_path))


def test_unknown_dtype_is_named(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="float8"):
        LLM(model=str(tiny_llama_dir), dtype="float8", num_blocks=4)


# ----------------------------------------------------------------------------------------------- prompts


def test_prompt_longer_than_max_model_len_gives_both_lengths(llm: LLM) -> None:
    assert llm.engine.max_model_len == MAX_MODEL_LEN
    with pytest.raises(ValueError) as err:
        llm.generate([[1] * 100], SamplingParams(max_tokens=4))
    assert "100" in str(err.value) and str(MAX_MODEL_LEN) in str(err.value)
    assert "max_model_len" in str(err.value)
    assert_still_works(llm)

    text = "one two three four five six seven eight nine ten " * 10  # well over 64 tokens
    num_tokens = len(llm.tokenizer.encode(text))
    with pytest.raises(ValueError) as err:
        llm.generate(text)
    assert str(num_tokens) in str(err.value) and str(MAX_MODEL_LEN) in str(err.value)
    assert_still_works(llm)


def test_prompt_plus_max_tokens_over_max_model_len(llm: LLM) -> None:
    with pytest.raises(ValueError) as err:
        llm.generate([[1] * 60], SamplingParams(max_tokens=10))
    message = str(err.value)
    assert "60" in message and "max_tokens=10" in message and str(MAX_MODEL_LEN) in message
    assert_still_works(llm)


@pytest.mark.parametrize("prompt", ["", []], ids=["text", "token-ids"])
def test_empty_prompt(llm: LLM, prompt) -> None:
    with pytest.raises(ValueError, match="empty"):
        llm.generate([prompt])
    assert_still_works(llm)


@pytest.mark.parametrize("bad_id", [49152, 10**9, -1])
def test_token_id_outside_vocabulary(llm: LLM, bad_id: int) -> None:
    with pytest.raises(ValueError) as err:
        llm.generate([[1, 2, bad_id]])
    assert str(bad_id) in str(err.value) and "vocabulary" in str(err.value) and "49152" in str(err.value)
    assert_still_works(llm)


def test_vllms_prompt_dicts_are_prompts(llm: LLM) -> None:
    """vLLM's TextPrompt and TokensPrompt dicts ({"prompt": ...}, {"prompt_token_ids": [...]}), in a list or alone,
    give what the plain string and the plain ids give (a dict was iterated as token ids: "prompt token id
    'prompt_token_ids' is outside the vocabulary")."""
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    (by_ids, by_text) = llm.generate([[1, 2, 3], "Hello there"], greedy)
    outs = llm.generate([{"prompt_token_ids": [1, 2, 3]}, {"prompt": "Hello there"}], greedy)
    assert [o.outputs[0].token_ids for o in outs] == [by_ids.outputs[0].token_ids, by_text.outputs[0].token_ids]
    assert outs[0].prompt_token_ids == [1, 2, 3]
    (alone,) = llm.generate({"prompt": "Hello there"}, greedy)
    assert alone.outputs[0].token_ids == by_text.outputs[0].token_ids
    assert_idle(llm)


@pytest.mark.parametrize(("prompt", "words"), [
    ({"prompt": "hi", "multi_modal_data": {}}, "'multi_modal_data' is not supported"),
    ({"prompt": "hi", "prompt_token_ids": [1]}, "exactly one of"),
    ({}, "exactly one of"),
    ({"prompt": [1, 2]}, "'prompt' must be a string"),
    ({"prompt_token_ids": "hello"}, "list of integer token ids"),
    ({"prompt_token_ids": [1, "2"]}, "list of integer token ids"),
    (5.5, "a prompt is a string"),
], ids=["unknown-key", "both", "empty", "text-not-str", "ids-str", "ids-mixed", "number"])
def test_other_prompt_shapes_are_refused_in_words(llm: LLM, prompt: object, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        llm.generate([prompt])
    assert_still_works(llm)


def test_empty_chat_messages(llm: LLM) -> None:
    with pytest.raises(ValueError, match="messages"):
        llm.chat([[]])
    assert_still_works(llm)


def test_bad_prompt_in_a_batch_leaves_nothing_behind(llm: LLM) -> None:
    """The good prompts before a bad one must not stay queued (and be computed later by someone else's call)."""
    with pytest.raises(ValueError, match="empty"):
        llm.generate(["A good prompt", "Another good one", ""], SamplingParams(max_tokens=2))
    assert_idle(llm)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[5, 6, 7], [5, 6, 10**9]], SamplingParams(n=2, temperature=1.0, max_tokens=2))
    assert_idle(llm)
    assert_still_works(llm)


# ------------------------------------------------------------------------------------------ sampling params


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"logprobs": 100}, "logprobs"),
        ({"min_tokens": 8, "max_tokens": 4}, "min_tokens"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"stop": [""]}, "stop"),
    ],
    ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()) if isinstance(v, dict) else None,
)
def test_invalid_sampling_params_name_the_parameter(llm: LLM, kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=rf"\b{name}=") as err:
        SamplingParams(**kwargs)
    value = kwargs[name]
    assert repr(value) in str(err.value)
    assert_still_works(llm)
