"""vLLM's sharegpt and custom datasets from small local files, and --random-prefix-len: vLLM's order, lengths,
filters and oversampling, reproduced step by step here with Python's random as vLLM calls it."""

from __future__ import annotations

import json
import random

import pytest

from lmserve.bench.dataset_types import DatasetSpec
from lmserve.bench.datasets import build_dataset
from lmserve.bench.file_datasets import is_valid_sequence


def turns(prompt: str, reply: str) -> dict:
    return {"conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": reply}]}


@pytest.fixture
def sharegpt_file(tmp_path):
    entries = [
        {"conversations": [{"from": "human", "value": "only one turn here"}]},  # < 2 turns: not loaded
        {"id": "no conversations"},
        turns("hi", "a reply that is long enough"),  # prompt < 4 tokens: dropped
        turns("What is the capital of France and why?", "Paris."),  # reply < 4 tokens: dropped unless fixed
        turns("word " * 1100, "fine reply with some words"),  # prompt > 1024 tokens: dropped
        turns("Tell me a story about a small brave cat.", "Once upon a time a cat lived in a big old house."),
        turns("Explain how tides work in two sentences.", "The moon pulls the oceans. Earth turns beneath it."),
        turns("List three primary colours, please.", "Red, yellow and blue are the three primary colours."),
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(entries))
    return path, entries


def spec(**kwargs) -> DatasetSpec:
    return DatasetSpec(**{"num_prompts": 3, "seed": 0, **kwargs})


def test_sharegpt_is_vllms_sample(sharegpt_file, default_tokenizer):
    path, entries = sharegpt_file
    tok = default_tokenizer
    # vLLM: keep entries with >= 2 turns, random.seed(seed); random.shuffle; turn 0 is the prompt, turn 1's token
    # count (with special tokens) is max_tokens; is_valid_sequence drops the rest.
    kept = [e for e in entries if "conversations" in e and len(e["conversations"]) >= 2]
    random.seed(0)
    random.shuffle(kept)
    expected = []
    for e in kept:
        prompt, reply = e["conversations"][0]["value"], e["conversations"][1]["value"]
        p, o = len(tok(prompt).input_ids), len(tok(reply).input_ids)
        if is_valid_sequence(p, o):
            expected.append((prompt, p, o))
    assert len(expected) == 3  # the three good conversations, the four others filtered
    dataset = build_dataset(spec(name="sharegpt", path=str(path), num_warmups=2), tok)
    assert [(r.prompt, r.prompt_len, r.output_len) for r in dataset.requests] == expected[:3]
    assert dataset.warmups == [dataset.requests[0]] * 2 and not dataset.input_lens_approximate

    # --sharegpt-output-len: every max_tokens fixed, and the short-reply entry is no longer dropped.
    fixed = build_dataset(spec(name="sharegpt", path=str(path), num_prompts=10, sharegpt_output_len=5,
                               no_oversample=True), tok)
    assert len(fixed.requests) == 4 and {r.output_len for r in fixed.requests} == {5}
    # Oversampling as vLLM: random.seed(seed) then random.choice of the kept ones.
    over = build_dataset(spec(name="sharegpt", path=str(path), num_prompts=6), tok).requests
    random.seed(0)
    assert over[:3] == dataset.requests and over[3:] == [random.choice(dataset.requests) for _ in range(3)]
    ordered = build_dataset(spec(name="sharegpt", path=str(path), disable_shuffle=True), tok).requests
    assert ordered[0].prompt.startswith("Tell me a story")


def test_vllm_filters():
    assert is_valid_sequence(4, 4) and not is_valid_sequence(3, 100) and not is_valid_sequence(100, 3)
    assert is_valid_sequence(100, 3, skip_min_output_len_check=True)
    assert is_valid_sequence(1024, 1024) and not is_valid_sequence(1025, 10) and not is_valid_sequence(1024, 1025)


def test_custom_is_vllms_sample(tmp_path, default_tokenizer):
    tok = default_tokenizer
    prompts = ["What is the capital of India?", "What is the capital of Iran?", "What is the capital of China?"]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": p, "id": i}) for i, p in enumerate(prompts)) + "\n")
    rows = [{"prompt": p} for p in prompts]
    random.seed(0)
    random.shuffle(rows)
    dataset = build_dataset(spec(name="custom", path=str(path), num_prompts=2), tok)
    for request, row in zip(dataset.requests, rows[:2], strict=True):
        templated = tok.apply_chat_template([{"role": "user", "content": row["prompt"]}], add_generation_prompt=True,
                                            tokenize=False)
        assert (request.prompt, request.prompt_len, request.output_len) == (
            templated, len(tok(templated).input_ids), 256)
    raw = build_dataset(spec(name="custom", path=str(path), skip_chat_template=True, custom_output_len=9,
                             num_prompts=None, no_oversample=True), tok)
    assert sorted(r.prompt for r in raw.requests) == sorted(prompts) and {r.output_len for r in raw.requests} == {9}
    # Without a tokenizer: only with --skip-chat-template, and the lengths are estimates.
    assert build_dataset(spec(name="custom", path=str(path), skip_chat_template=True), None).input_lens_approximate
    with pytest.raises(ValueError, match="chat template"):
        build_dataset(spec(name="custom", path=str(path)), None)
    other = tmp_path / "prompts.json"
    other.write_text(path.read_text())
    with pytest.raises(ValueError, match=".jsonl files only"):
        build_dataset(spec(name="custom", path=str(other)), tok)


@pytest.mark.parametrize(("content", "message"), [
    ('{"conversations": []}', "expected a JSON list"),
    ("[{", "not valid JSON"),
    ('[{"conversations": [{"value": 1}, {"value": "x"}]}]', 'string "value"'),
    ('[{"conversations": [{"value": "a"}]}]', "no conversation left"),
])
def test_sharegpt_bad_files(tmp_path, default_tokenizer, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        build_dataset(spec(name="sharegpt", path=str(path)), default_tokenizer)


def test_random_prefix_len(default_tokenizer):
    dataset = build_dataset(DatasetSpec(num_prompts=5, input_len=20, output_len=4, random_prefix_len=12),
                            default_tokenizer)
    prefix = dataset.requests[0].prompt[:12]
    assert all(r.prompt[:12] == prefix and r.prompt_len == len(r.prompt) == 32 for r in dataset.requests)
    assert len({tuple(r.prompt[12:]) for r in dataset.requests}) == 5
