"""The prompts of a benchmark: random token ids, shared prefixes, a JSONL file, or synthetic conversations
(ShareGPT and vLLM's custom JSONL: file_datasets.py).

Every builder is deterministic for a given seed: it draws from numpy Generators keyed by (seed, stream), so the
prompts do not depend on the arrival schedule or on how many warm-ups are asked for.

Without a tokenizer lengths cannot be measured, so:
- completions prompts are lists of random token ids in [100, 10000): exact lengths for any server that accepts
  token-id prompts, assuming (as for every common vocabulary) that the model has at least 10000 tokens and that
  ids below 100 are the ones most likely to be special or byte tokens;
- text prompts (chat, or `--prompt-format text`) are built from words of the shipped passages at about 0.75 words
  per token, and the result says their input lengths are approximate.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lmserve.bench.dataset_types import (
    BenchRequest,
    Dataset,
    DatasetSpec,
    Messages,
    PromptTokens,
    Tokenizer,
    flatten_messages,
    passages,
)
from lmserve.bench.file_datasets import custom_dataset, sharegpt_dataset

DATASET_NAMES = ("random", "sharegpt", "custom", "prefix", "jsonl", "chat")

# Stream keys for np.random.default_rng([seed, key]): independent draws per purpose.
_MEASURED, _WARMUP, _SHARED = 0, 1, 2

SYSTEM_PROMPTS = (
    "You are a helpful assistant. Answer clearly and briefly.",
    "You are a patient teacher who explains things step by step.",
    "You are a careful editor. Keep answers accurate and plain.",
    "You answer questions about everyday science and history in simple words.",
)
USER_TEMPLATES = (
    "Summarise this passage in two sentences: {text}",
    "What is the main idea here? {text}",
    "Explain this to a curious child: {text}",
    "Rewrite the following more simply: {text}",
    "Which detail in this text surprised you, and why? {text}",
    "Continue the story in the same style: {text}",
)
FOLLOW_UPS = (
    "Can you give one more example?",
    "Why does that happen?",
    "Please make it shorter.",
    "How would you explain that differently?",
    "What should I read next about this?",
)


def build_dataset(spec: DatasetSpec, tokenizer: Tokenizer | None) -> Dataset:
    if spec.name not in DATASET_NAMES:
        raise ValueError(f"unknown dataset '{spec.name}' (choose from {', '.join(DATASET_NAMES)})")
    builders = {"random": _random_dataset, "prefix": _prefix_dataset, "jsonl": _jsonl_dataset, "chat": _chat_dataset,
                "sharegpt": sharegpt_dataset, "custom": custom_dataset}
    return builders[spec.name](spec, PromptTokens(tokenizer))


def sample_lengths(rng: np.random.Generator, length: int, range_ratio: float, n: int) -> np.ndarray:
    """n lengths uniform over the integers of [L(1-r), L(1+r)] (vLLM's random dataset), at least 1."""
    low = max(1, math.floor(length * (1 - range_ratio)))
    high = max(low, math.ceil(length * (1 + range_ratio)))
    return rng.integers(low, high + 1, size=n)


def _request(spec: DatasetSpec, tokens: PromptTokens, ids: list[int] | None, text: str | None, output_len: int,
             group: int | None = None) -> BenchRequest:
    """A request for the endpoint: token ids for completions when allowed, else text or one user message."""
    if not spec.chat and spec.token_ids and ids is not None:
        return BenchRequest(len(ids), output_len, prompt=ids, group=group)
    if text is None:
        # Text from ids happens only with a tokenizer: without one, builders make word text (_needs_text).
        assert tokens.tokenizer is not None and ids is not None
        text = tokens.tokenizer.decode(ids)
    prompt_len = len(ids) if ids is not None else tokens.count(text)
    if spec.chat:
        return BenchRequest(prompt_len, output_len, messages=[{"role": "user", "content": text}], group=group)
    return BenchRequest(prompt_len, output_len, prompt=text, group=group)


def _needs_text(spec: DatasetSpec, tokens: PromptTokens) -> bool:
    """Whether prompts are text with no tokenizer to make them exact."""
    return tokens.tokenizer is None and (spec.chat or not spec.token_ids)


# -------------------------------------------------------------------------------------------------- random


def _random_dataset(spec: DatasetSpec, tokens: PromptTokens) -> Dataset:
    """Random prompts of sampled lengths, after one fixed --random-prefix-len prefix shared by all (vLLM's)."""
    text_mode = _needs_text(spec, tokens)
    shared_rng = np.random.default_rng([spec.seed, _SHARED])
    prefix: Any = None
    if spec.random_prefix_len:
        prefix = (tokens.word_text(shared_rng, spec.random_prefix_len) if text_mode
                  else tokens.ids(shared_rng, spec.random_prefix_len))

    def make(key: int, n: int) -> list[BenchRequest]:
        rng = np.random.default_rng([spec.seed, key])
        inputs = sample_lengths(rng, spec.input_len, spec.range_ratio, n)
        outputs = sample_lengths(rng, spec.output_len, spec.range_ratio, n)
        return [_random_request(spec, tokens, rng, int(i), int(o), prefix) for i, o in zip(inputs, outputs)]

    return Dataset(make(_MEASURED, _count(spec)), make(_WARMUP, spec.num_warmups), input_lens_approximate=text_mode)


def _random_request(spec: DatasetSpec, tokens: PromptTokens, rng: np.random.Generator, input_len: int,
                    output_len: int, prefix: Any = None) -> BenchRequest:
    if _needs_text(spec, tokens):
        text = tokens.word_text(rng, input_len)
        return _request(spec, tokens, None, f"{prefix} {text}" if prefix else text, output_len)
    return _request(spec, tokens, (prefix or []) + tokens.ids(rng, input_len), None, output_len)


def _count(spec: DatasetSpec) -> int:
    return 1000 if spec.num_prompts is None else spec.num_prompts


# -------------------------------------------------------------------------------------------------- prefix


def _prefix_dataset(spec: DatasetSpec, tokens: PromptTokens) -> Dataset:
    """G groups sharing a P-token prefix each, then a random suffix; prompt i belongs to group i mod G.

    Prompts are the concatenation of the id lists, so with token-id prompts every member of a group shares exactly
    P tokens. Text prompts are the decoding of that concatenation (a merge at the seam may shift it by a token).
    """
    if spec.prefix_groups < 1 or spec.prefix_len < 0:
        raise ValueError("--prefix-num-groups must be >= 1 and --prefix-len >= 0")
    shared_rng = np.random.default_rng([spec.seed, _SHARED])
    text_mode = _needs_text(spec, tokens)
    if text_mode:
        prefixes: list[Any] = [tokens.word_text(shared_rng, spec.prefix_len) for _ in range(spec.prefix_groups)]
    else:
        prefixes = [tokens.ids(shared_rng, spec.prefix_len) for _ in range(spec.prefix_groups)]

    def make(key: int, n: int) -> list[BenchRequest]:
        rng = np.random.default_rng([spec.seed, key])
        inputs = sample_lengths(rng, spec.input_len, spec.range_ratio, n)
        outputs = sample_lengths(rng, spec.output_len, spec.range_ratio, n)
        out = []
        for i, (suffix_len, output_len) in enumerate(zip(inputs, outputs)):
            group = i % spec.prefix_groups
            if text_mode:
                text = f"{prefixes[group]} {tokens.word_text(rng, int(suffix_len))}"
                out.append(_request(spec, tokens, None, text, int(output_len), group))
            else:
                ids = prefixes[group] + tokens.ids(rng, int(suffix_len))
                out.append(_request(spec, tokens, ids, None, int(output_len), group))
        return out

    # Warm-up j is drawn from group j mod G, so N >= G warm-ups put every shared prefix in the cache.
    return Dataset(
        make(_MEASURED, _count(spec)), make(_WARMUP, spec.num_warmups), input_lens_approximate=text_mode,
        prefix_cache_warm=spec.num_warmups >= spec.prefix_groups,
    )


# --------------------------------------------------------------------------------------------------- jsonl


@dataclass
class JsonlRow:
    prompt: str
    output_len: int | None


def read_jsonl(path: str | Path) -> list[JsonlRow]:
    """One JSON object a line: {"prompt": str, "output_len"|"max_tokens": int?}; blank lines are skipped."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--dataset-path {path}: no such file")
    rows = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        rows.append(_parse_row(line, f"{path}:{lineno}"))
    if not rows:
        raise ValueError(f"{path}: no prompts (expected one JSON object a line)")
    return rows


def _parse_row(line: str, where: str) -> JsonlRow:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")  # noqa: TRY004 - exit 2
    prompt = obj.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f'{where}: "prompt" must be a non-empty string')
    output_len = obj.get("output_len", obj.get("max_tokens"))
    if output_len is not None and (isinstance(output_len, bool) or not isinstance(output_len, int) or output_len < 1):
        raise ValueError(f'{where}: "output_len"/"max_tokens" must be a positive integer')
    return JsonlRow(prompt, output_len)


def _jsonl_dataset(spec: DatasetSpec, tokens: PromptTokens) -> Dataset:
    """The file's prompts in order, cycled to --num-prompts (default: one pass); warm-ups take the lines after."""
    if spec.path is None:
        raise ValueError("--dataset-name jsonl needs --dataset-path")
    rows = read_jsonl(spec.path)
    n = len(rows) if spec.num_prompts is None else spec.num_prompts

    def make(first: int, count: int) -> list[BenchRequest]:
        out = []
        for i in range(first, first + count):
            row = rows[i % len(rows)]
            output_len = row.output_len if row.output_len is not None else spec.output_len
            out.append(_request(spec, tokens, None, row.prompt, output_len))
        return out

    return Dataset(make(0, n), make(n, spec.num_warmups), input_lens_approximate=tokens.tokenizer is None)


# ---------------------------------------------------------------------------------------------------- chat


def _sentences() -> list[list[str]]:
    return [[s for s in re.split(r"(?<=[.!?])\s+", p) if s] for p in passages()]


def make_conversation(rng: np.random.Generator, sentences: list[list[str]]) -> Messages:
    """System prompt (half the time), then 0-2 earlier user/assistant exchanges, then a user turn."""
    def excerpt(max_sentences: int) -> str:
        passage = sentences[int(rng.integers(0, len(sentences)))]
        start = int(rng.integers(0, len(passage)))
        count = int(rng.integers(1, max_sentences + 1))
        return " ".join(passage[start:start + count])

    messages: Messages = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": SYSTEM_PROMPTS[int(rng.integers(0, len(SYSTEM_PROMPTS)))]})
    exchanges = int(rng.integers(0, 3))
    template = USER_TEMPLATES[int(rng.integers(0, len(USER_TEMPLATES)))]
    messages.append({"role": "user", "content": template.format(text=excerpt(4))})
    for _ in range(exchanges):
        messages.append({"role": "assistant", "content": excerpt(3)})
        messages.append({"role": "user", "content": FOLLOW_UPS[int(rng.integers(0, len(FOLLOW_UPS)))]})
    return messages


def _chat_dataset(spec: DatasetSpec, tokens: PromptTokens) -> Dataset:
    sentences = _sentences()

    def make(key: int, n: int) -> list[BenchRequest]:
        rng = np.random.default_rng([spec.seed, key])
        outputs = sample_lengths(rng, spec.output_len, spec.range_ratio, n)
        out = []
        for output_len in outputs:
            messages = make_conversation(rng, sentences)
            if spec.chat:
                out.append(BenchRequest(tokens.count_messages(messages), int(output_len), messages=messages))
            else:
                text = flatten_messages(messages)
                out.append(BenchRequest(tokens.count(text), int(output_len), prompt=text))
        return out

    return Dataset(
        make(_MEASURED, _count(spec)), make(_WARMUP, spec.num_warmups), input_lens_approximate=tokens.tokenizer is None
    )
