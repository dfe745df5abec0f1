"""What every dataset builder shares (datasets.py, file_datasets.py): the request and dataset types, the settings
from the command line, and the source of prompt tokens (exact with a tokenizer, estimated from the shipped passages'
words without one)."""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Protocol

import numpy as np

WORDS_PER_TOKEN = 0.75
NO_TOKENIZER_ID_RANGE = (100, 10000)


class Tokenizer(Protocol):
    """The slice of a Hugging Face tokenizer the datasets use."""

    all_special_ids: list[int]
    chat_template: str | None

    def __len__(self) -> int: ...
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def apply_chat_template(self, conversation: list[dict[str, str]], **kwargs: Any) -> Any: ...


Messages = list[dict[str, str]]


@dataclass
class BenchRequest:
    prompt_len: int
    output_len: int
    prompt: str | list[int] | None = None  # for /v1/completions
    messages: Messages | None = None  # for /v1/chat/completions
    group: int | None = None  # prefix group, for the prefix dataset


@dataclass
class DatasetSpec:
    """What the builders need from the command line, without argparse."""

    name: str = "random"
    num_prompts: int | None = 1000  # None: as many as the JSONL file has lines
    num_warmups: int = 0
    chat: bool = False  # the endpoint is /v1/chat/completions
    token_ids: bool = True  # send completions prompts as token ids (when there is no tokenizer too)
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0
    random_prefix_len: int = 0  # random: one fixed prefix before every prompt (vLLM's --random-prefix-len)
    prefix_len: int = 256
    prefix_groups: int = 1
    path: str | None = None
    seed: int = 0
    sharegpt_output_len: int | None = None
    custom_output_len: int = 256
    skip_chat_template: bool = False
    disable_shuffle: bool = False
    no_oversample: bool = False


@dataclass
class Dataset:
    requests: list[BenchRequest]
    warmups: list[BenchRequest]
    input_lens_approximate: bool = False
    prefix_cache_warm: bool = False  # warm-ups covered every shared prefix
    notes: list[str] = field(default_factory=list)


class PromptTokens:
    """Random prompts of a given length, exact with a tokenizer and approximate (or raw ids) without one."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.words = passage_words()
        if tokenizer is not None:
            special = set(tokenizer.all_special_ids)
            self.allowed = np.array([i for i in range(len(tokenizer)) if i not in special], dtype=np.int64)

    def ids(self, rng: np.random.Generator, n: int) -> list[int]:
        """n token ids that survive a decode/encode round trip with the same length where possible."""
        if self.tokenizer is None:
            return rng.integers(*NO_TOKENIZER_ID_RANGE, size=n).tolist()
        tok = self.tokenizer
        ids = self._draw(rng, n)
        # Random ids rarely re-encode to themselves (merges across boundaries); trim or pad the re-encoding
        # until it is stable, so that the text of the prompt has the length too. A few rounds suffice.
        for _ in range(8):
            again = tok.encode(tok.decode(ids), add_special_tokens=False)[:n]
            if len(again) < n:
                again += self._draw(rng, n - len(again))
            if again == ids:
                break
            ids = again
        return ids

    def _draw(self, rng: np.random.Generator, n: int) -> list[int]:
        return self.allowed[rng.integers(0, len(self.allowed), size=n)].tolist()

    def text(self, rng: np.random.Generator, n: int) -> str:
        """Text of about n tokens (exactly n when it is the decoding of a stable id list)."""
        if self.tokenizer is not None:
            return self.tokenizer.decode(self.ids(rng, n))
        return self.word_text(rng, n)

    def word_text(self, rng: np.random.Generator, n: int) -> str:
        count = max(1, round(n * WORDS_PER_TOKEN))
        start = int(rng.integers(0, len(self.words)))
        return " ".join(self.words[(start + i) % len(self.words)] for i in range(count))

    def count(self, text: str, add_special_tokens: bool = False) -> int:
        if self.tokenizer is None:
            return max(1, round(len(text.split()) / WORDS_PER_TOKEN))
        return len(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def count_messages(self, messages: Messages) -> int:
        tok = self.tokenizer
        if tok is not None and tok.chat_template:
            rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return len(tok.encode(rendered, add_special_tokens=False))
        return self.count(flatten_messages(messages))


def passages() -> list[str]:
    """The shipped passages: blank-line separated paragraphs, '#' lines are comments."""
    text = resources.files("lmserve.bench").joinpath("data/passages.txt").read_text(encoding="utf-8")
    lines = [line for line in text.splitlines() if not line.startswith("#")]
    return [" ".join(p.split()) for p in "\n".join(lines).split("\n\n") if p.strip()]


def passage_words() -> list[str]:
    return [w for p in passages() for w in p.split()]


def flatten_messages(messages: Messages) -> str:
    """A conversation as plain text for /v1/completions, ending where the assistant would speak."""
    lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n\n".join(lines) + "\n\nAssistant:"
