"""The benchmark's prompts: exact lengths, range bounds, shared prefixes, JSONL errors, conversations."""

from __future__ import annotations

import json

import pytest

from lmserve.bench.dataset_types import NO_TOKENIZER_ID_RANGE, DatasetSpec, flatten_messages, passages
from lmserve.bench.datasets import build_dataset, read_jsonl


def spec(**kwargs) -> DatasetSpec:
    return DatasetSpec(**{"num_prompts": 20, "input_len": 64, "output_len": 16, **kwargs})


def test_random_lengths_exact_with_tokenizer(default_tokenizer):
    special = set(default_tokenizer.all_special_ids)
    dataset = build_dataset(spec(input_len=100, num_warmups=3), default_tokenizer)
    assert len(dataset.requests) == 20 and len(dataset.warmups) == 3
    for request in dataset.requests:
        assert isinstance(request.prompt, list) and len(request.prompt) == request.prompt_len == 100
        assert not special & set(request.prompt)
        assert request.output_len == 16
    assert not dataset.input_lens_approximate and dataset.requests[0].prompt != dataset.warmups[0].prompt

    # As text the prompt re-encodes to the same number of tokens (the ids are a stable decode/encode round trip).
    text = build_dataset(spec(input_len=100, token_ids=False), default_tokenizer)
    for request in text.requests:
        assert len(default_tokenizer.encode(request.prompt, add_special_tokens=False)) == request.prompt_len == 100
    chat = build_dataset(spec(input_len=50, chat=True), default_tokenizer)
    assert all(r.messages[0]["role"] == "user" and r.prompt_len == 50 for r in chat.requests)


def test_same_seed_same_prompts(default_tokenizer):
    first = build_dataset(spec(seed=3), default_tokenizer).requests
    assert first == build_dataset(spec(seed=3), default_tokenizer).requests
    assert first != build_dataset(spec(seed=4), default_tokenizer).requests


def test_range_ratio_bounds(default_tokenizer):
    dataset = build_dataset(spec(num_prompts=200, input_len=40, output_len=10, range_ratio=0.5), default_tokenizer)
    inputs = [r.prompt_len for r in dataset.requests]
    outputs = [r.output_len for r in dataset.requests]
    # Uniform over [40*0.5, 40*1.5] = [20, 60] and [10*0.5, 10*1.5] = [5, 15]; 200 draws reach near both ends.
    assert 20 <= min(inputs) <= 23 and 57 <= max(inputs) <= 60
    assert min(outputs) == 5 and max(outputs) == 15


def test_without_tokenizer():
    dataset = build_dataset(spec(), None)
    low, high = NO_TOKENIZER_ID_RANGE
    assert all(len(r.prompt) == 64 and low <= min(r.prompt) and max(r.prompt) < high for r in dataset.requests)
    assert not dataset.input_lens_approximate  # token ids: exact whatever the vocabulary (>= 10000 assumed)
    chat = build_dataset(spec(chat=True), None)
    assert chat.input_lens_approximate
    assert all(len(r.messages[0]["content"].split()) == 48 for r in chat.requests)  # 64 tokens * 0.75 words


def test_prefix_groups_share_exactly_p_tokens(default_tokenizer):
    dataset = build_dataset(spec(name="prefix", num_prompts=12, prefix_groups=3, prefix_len=32, input_len=16,
                                 num_warmups=3), default_tokenizer)
    assert [r.group for r in dataset.requests] == [0, 1, 2] * 4
    assert dataset.prefix_cache_warm and [w.group for w in dataset.warmups] == [0, 1, 2]

    def common(a: list[int], b: list[int]) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    for group in range(3):
        members = [r.prompt for r in dataset.requests + dataset.warmups if r.group == group]
        assert all(len(p) == 48 for p in members)
        assert min(common(members[0], p) for p in members[1:]) == 32
    assert common(dataset.requests[0].prompt, dataset.requests[1].prompt) < 32  # different groups
    cold = build_dataset(spec(name="prefix", prefix_groups=3, num_warmups=2), default_tokenizer)
    assert not cold.prefix_cache_warm


def test_jsonl(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "hello there", "output_len": 5}) + "\n\n"
                    + json.dumps({"prompt": "a b c d", "max_tokens": 7}) + "\n" + json.dumps({"prompt": "x"}) + "\n")
    dataset = build_dataset(spec(name="jsonl", path=str(path), num_prompts=None, num_warmups=1), None)
    assert [(r.prompt, r.output_len) for r in dataset.requests] == [("hello there", 5), ("a b c d", 7), ("x", 16)]
    assert dataset.warmups[0].prompt == "hello there"  # warm-ups take the lines after the measured ones, cycling
    assert dataset.input_lens_approximate
    assert len(build_dataset(spec(name="jsonl", path=str(path), num_prompts=7), None).requests) == 7


@pytest.mark.parametrize(("line", "message"), [
    ("{not json", "not valid JSON"),
    ('["prompt"]', "expected a JSON object"),
    ('{"text": "hi"}', '"prompt" must be a non-empty string'),
    ('{"prompt": "hi", "output_len": 0}', "positive integer"),
    ('{"prompt": "hi", "max_tokens": "5"}', "positive integer"),
])
def test_jsonl_errors_name_the_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(ValueError, match=f"bad.jsonl:2: .*{message}"):
        read_jsonl(path)
    with pytest.raises(FileNotFoundError):
        read_jsonl(tmp_path / "missing.jsonl")


def test_chat_conversations(default_tokenizer):
    assert len(passages()) >= 8
    dataset = build_dataset(spec(name="chat", num_prompts=40, chat=True), default_tokenizer)
    roles = set()
    for request in dataset.requests:
        messages = request.messages
        assert messages[-1]["role"] == "user" and all(m["content"] for m in messages)
        turns = [m["role"] for m in messages[1:]] if messages[0]["role"] == "system" else [m["role"] for m in messages]
        assert turns == ["user", "assistant"] * (len(turns) // 2) + ["user"]  # alternating, a user turn last
        roles.update(m["role"] for m in messages)
        assert request.output_len == 16 and request.prompt_len > 10
    assert roles == {"system", "user", "assistant"}  # the set mixes single- and multi-turn, with and without system

    flat = build_dataset(spec(name="chat", num_prompts=5, chat=False), default_tokenizer)
    assert all(isinstance(r.prompt, str) and r.prompt.endswith("Assistant:") for r in flat.requests)
    assert flatten_messages([{"role": "user", "content": "hi"}]) == "User: hi\n\nAssistant:"
