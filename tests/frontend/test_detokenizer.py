"""IncrementalDetokenizer: streamed text equals the full decode, stop strings, minimal hold-back."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest
import tokenizers
from tokenizers import decoders, normalizers

from lmserve.frontend.detokenizer import IncrementalDetokenizer

FFFD = "\ufffd"

TEXTS = [
    "Hello world, how are you?",
    "The quick brown fox jumps over the lazy dog.\nSecond line\twith a tab.",
    "👍🏽🇫🇷 ok",
    "日本語のテキスト",
    "Café au lait, très bien. Ça va? é è ê ë",
    "mixed: naïve 日本 👍🏽 and 🇫🇷 plus Ω≈ç√∫ — “quotes” … 中文字符",
    "emoji run 😀😃😄😁😆🥹🤌🏾👨‍👩‍👧‍👦",
    "  leading and trailing spaces  ",
    "code: def f(x):\n    return x ** 2  # square\n",
    "x",
]


def _encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _stream(
    detok: IncrementalDetokenizer, ids: Sequence[int], chunk_sizes: Sequence[int] | None = None
) -> tuple[list[str], str | None]:
    """Feeds ids (one at a time, or in the given chunk sizes) and collects every delta."""
    deltas: list[str] = []
    stopped = False
    pos = 0
    sizes = iter(chunk_sizes or [])
    while pos < len(ids) and not stopped:
        n = next(sizes, 1)
        stopped = detok.update(ids[pos : pos + n])
        pos += n
        deltas.append(detok.get_delta(finished=stopped))
    if not stopped:
        deltas.append(detok.get_delta(finished=True))
    assert detok.output_text == "".join(deltas)
    return deltas, detok.stop_string


def _make(
    tokenizer: Any,
    stop: Sequence[str] = (),
    include: bool = False,
    prompt: Sequence[int] = (),
    skip_special_tokens: bool = True,
) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tokenizer, list(prompt), list(stop), include, skip_special_tokens)


def _first_stop(text: str, stops: Sequence[str], include: bool) -> tuple[str, str | None]:
    """Reference: the text truncated at the stop string that appears first (ends first; ties: longest)."""
    for end in range(1, len(text) + 1):
        found = [s for s in stops if s and text.endswith(s, 0, end)]
        if found:
            stop = max(found, key=len)
            return (text[:end] if include else text[: end - len(stop)]), stop
    return text, None


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_full_decode(tokenizer: Any, text: str) -> None:
    ids = _encode(tokenizer, text)
    detok = _make(tokenizer)
    deltas, stop = _stream(detok, ids)
    assert stop is None
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert not any(FFFD in d for d in deltas)
    assert detok.num_output_tokens_used == len(ids)


def test_multibyte_character_is_held_until_complete(tokenizer: Any) -> None:
    ids = _encode(tokenizer, "👍🏽")
    assert len(ids) > 2  # the emoji's bytes are split over several tokens
    detok = _make(tokenizer)
    sent = ""
    for token_id in ids:
        detok.update([token_id])
        delta = detok.get_delta(finished=False)
        assert FFFD not in delta
        sent += delta
    assert sent == detok.output_text == "👍🏽"  # complete before finish: nothing left to flush


def test_partial_character_at_finish_is_flushed(tokenizer: Any) -> None:
    ids = _encode(tokenizer, "ok 日本")
    ids = ids[: next(k for k in range(len(ids)) if tokenizer.decode(ids[:k]).endswith(FFFD))]
    detok = _make(tokenizer)
    deltas, _ = _stream(detok, ids)
    assert "".join(deltas) == tokenizer.decode(ids)
    assert deltas[-1].endswith(FFFD)  # only the final flush may carry the replacement character
    assert not any(FFFD in d for d in deltas[:-1])


def test_prompt_context_does_not_leak_into_output(tokenizer: Any) -> None:
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi 日本"}], add_generation_prompt=True, tokenize=True
    )
    if isinstance(prompt, dict) or hasattr(prompt, "keys"):
        prompt = prompt["input_ids"]
    ids = _encode(tokenizer, "Hello there 👍🏽")
    deltas, _ = _stream(_make(tokenizer, prompt=prompt), ids)
    assert "".join(deltas) == "Hello there 👍🏽"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tokenizer: Any, skip: bool) -> None:
    eos = tokenizer.eos_token_id
    ids = _encode(tokenizer, "Hi there") + [eos]
    deltas, _ = _stream(_make(tokenizer, skip_special_tokens=skip), ids)
    assert "".join(deltas) == ("Hi there" if skip else "Hi there" + tokenizer.decode([eos]))


def test_stop_spanning_tokens(tokenizer: Any) -> None:
    text = "Hello world, how are you?"
    ids = _encode(tokenizer, text)
    stop = "ld, ho"
    assert not any(stop in tokenizer.decode([i]) for i in ids)
    detok = _make(tokenizer, stop=[stop])
    deltas, found = _stream(detok, ids)
    assert found == stop
    assert "".join(deltas) == "Hello wor"
    # Tokens: 'Hello', ' world', ',', ' how' -- the stop completes in ' how'; later tokens are dropped.
    assert detok.num_output_tokens_used == 4


def test_stop_found_mid_batch_trims_later_tokens(tokenizer: Any) -> None:
    ids = _encode(tokenizer, "one two three four five")
    detok = _make(tokenizer, stop=["three"])
    assert detok.update(ids) and detok.stop_string == "three"
    assert detok.get_delta(finished=True) == "one two "
    assert detok.num_output_tokens_used == 3
    assert not detok.update(_encode(tokenizer, " six"))  # ignored after the stop
    assert detok.output_text == "one two "


@pytest.mark.parametrize(
    ("text", "stop", "expected"),
    [
        ("日本語のテキスト", "本語", "日"),
        ("日本語のテキスト", "語", "日本"),
        ("a 👍🏽🇫🇷 b", "🏽🇫", "a 👍"),
        ("Café au lait", "é", "Caf"),
    ],
)
def test_stop_inside_multibyte_text(tokenizer: Any, text: str, stop: str, expected: str) -> None:
    deltas, found = _stream(_make(tokenizer, stop=[stop]), _encode(tokenizer, text))
    assert found == stop
    assert "".join(deltas) == expected
    assert not any(FFFD in d for d in deltas)


def test_multiple_stops_first_to_appear_wins(tokenizer: Any) -> None:
    ids = _encode(tokenizer, "one two three four")
    deltas, found = _stream(_make(tokenizer, stop=["four", "two", "three"]), ids)
    assert (found, "".join(deltas)) == ("two", "one ")
    # Same text in one batch: still the earliest occurrence, not the first in the list.
    detok = _make(tokenizer, stop=["four", "two"])
    assert detok.update(ids) and detok.stop_string == "two"
    assert detok.get_delta(finished=True) == "one "
    # A shorter stop that completes first beats a longer one starting at the same place.
    deltas, found = _stream(_make(tokenizer, stop=["three f", "thr"]), ids)
    assert (found, "".join(deltas)) == ("thr", "one two ")


def test_include_stop_str_in_output(tokenizer: Any) -> None:
    ids = _encode(tokenizer, "one two three four")
    detok = _make(tokenizer, stop=["wo th"], include=True)
    deltas, found = _stream(detok, ids)
    assert found == "wo th"
    assert "".join(deltas) == "one two th"
    assert detok.num_output_tokens_used == 3


@pytest.mark.parametrize("include", [False, True])
def test_stop_at_first_token(tokenizer: Any, include: bool) -> None:
    ids = _encode(tokenizer, "Hello world")
    detok = _make(tokenizer, stop=["Hello"], include=include)
    assert detok.update(ids[:1]) and detok.stop_string == "Hello"
    assert detok.get_delta(finished=True) == ("Hello" if include else "")
    assert detok.num_output_tokens_used == 1


def test_stop_never_found_releases_everything_at_finish(tokenizer: Any) -> None:
    text = "the end is ab"
    detok = _make(tokenizer, stop=["abc", "end of"])
    deltas, found = _stream(detok, _encode(tokenizer, text))
    assert found is None
    assert "".join(deltas) == text
    assert deltas[-1] == "ab"  # held back to the end: it could still have become "abc"


def test_hold_back_is_minimal(tokenizer: Any) -> None:
    detok = _make(tokenizer, stop=["###"])
    detok.update(_encode(tokenizer, "hello #"))
    assert detok.get_delta(finished=False) == "hello "  # only "#" could begin the stop
    detok.update(_encode(tokenizer, "#"))
    assert detok.get_delta(finished=False) == ""  # "##" could still become "###"
    detok.update(_encode(tokenizer, " x"))
    assert detok.get_delta(finished=False) == "## x"
    assert detok.get_delta(finished=True) == ""
    assert detok.output_text == "hello ## x"


def test_hold_back_uses_suffix_not_fixed_length(tokenizer: Any) -> None:
    # "ab" is not a prefix of "xyzab", so nothing is held although the stop is 5 characters long.
    detok = _make(tokenizer, stop=["xyzab", "foo"])
    detok.update(_encode(tokenizer, "gab"))
    assert detok.get_delta(finished=False) == "gab"
    detok.update(_encode(tokenizer, " xy"))
    assert detok.get_delta(finished=False) == " "
    assert detok.get_delta(finished=True) == "xy"


class _CountingTokenizer:
    """Wraps a tokenizer and records the longest id list ever decoded."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.longest = 0

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        self.longest = max(self.longest, len(ids))
        return self._tokenizer.decode(ids, **kwargs)


def test_decode_window_stays_small(tokenizer: Any) -> None:
    text = " ".join(TEXTS) * 20
    ids = _encode(tokenizer, text)
    counting = _CountingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(counting, ids[:50], ["never-appears"], False)
    deltas, _ = _stream(detok, ids)
    assert "".join(deltas) == text
    assert len(ids) > 1000
    assert counting.longest <= 16  # O(1) per token, independent of the output length


def test_random_token_ids_match_full_decode(tokenizer: Any) -> None:
    # Arbitrary ids produce invalid UTF-8 too; the stream must still equal the full decode.
    rng = random.Random(1234)
    vocab = len(tokenizer)
    for _ in range(50):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        deltas, _ = _stream(_make(tokenizer), ids, [rng.randint(1, 4) for _ in ids])
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)


# fmt: off
_PIECES = [
    "hello", "world", " ", " ", ", ", ". ", "\n", "#", "##", "ab", "abc", "é", "ça", "naïve", "日本", "語",
    "のテキスト", "中文", "👍🏽", "🇫🇷", "😀", "👨\u200d👩\u200d👧", "Ω", "—", "…", "123", "x", "stop",
]
# fmt: on


def test_random_texts_with_random_stops(tokenizer: Any) -> None:
    rng = random.Random(20240611)
    prompt = _encode(tokenizer, "Some prompt: 日本")
    for case in range(300):
        text = "".join(rng.choice(_PIECES) for _ in range(rng.randint(1, 25)))
        ids = _encode(tokenizer, text)
        full = tokenizer.decode(ids, skip_special_tokens=True)
        assert full == text
        stops = []
        for _ in range(rng.randint(1, 3)):
            if rng.random() < 0.8:
                start = rng.randrange(len(full))
                stops.append(full[start : start + rng.randint(1, 6)])
            else:
                stops.append(rng.choice(["zzz", "#x#", "👍🏽?", "abcd"]))
        include = rng.random() < 0.5
        chunks = [rng.choice([1, 1, 1, 2, 3, 5]) for _ in ids]
        detok = _make(tokenizer, stop=stops, include=include, prompt=prompt if case % 2 else ())
        deltas, found = _stream(detok, ids, chunks)

        expected, expected_stop = _first_stop(full, stops, include)
        info = f"text={text!r} stops={stops!r} include={include}"
        assert "".join(deltas) == expected, info
        assert found == expected_stop, info
        assert not any(FFFD in d for d in deltas), info
        if expected_stop is None:
            assert detok.num_output_tokens_used == len(ids)
        else:
            # Tokens are kept up to the one whose text completes the stop string.
            stop_end = len(_first_stop(full, stops, True)[0])
            used = next(
                k for k in range(1, len(ids) + 1) if len(tokenizer.decode(ids[:k]).rstrip(FFFD)) >= stop_end
            )
            assert detok.num_output_tokens_used == used, info


def _sentencepiece_style_tokenizer() -> tokenizers.Tokenizer:
    """A tiny Llama-style tokenizer: "▁" for spaces, byte fallback, leading space stripped on decode."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁", *"abcdefghijklmnopqrstuvwxyzHW,.!?'", "▁h", "▁w", "he", "ll", "llo", "▁he", "▁hello"]:
        vocab.setdefault(piece, len(vocab))
    merges = [("▁", "h"), ("▁", "w"), ("h", "e"), ("l", "l"), ("ll", "o"), ("▁h", "e"), ("▁he", "llo")]
    tok = tokenizers.Tokenizer(
        tokenizers.models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens(["<s>", "</s>"])
    return tok


@pytest.mark.parametrize("text", ["hello world, how are you?", "hello 日本語 é 👍🏽 wow", "a"])
def test_sentencepiece_style_tokenizer(text: str) -> None:
    tok = _sentencepiece_style_tokenizer()
    ids = tok.encode(text, add_special_tokens=False).ids
    assert any(tok.id_to_token(i).startswith("<0x") for i in ids) or text.isascii()
    deltas, _ = _stream(_make(tok), [*ids, tok.token_to_id("</s>")])
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any(FFFD in d for d in deltas)
    # With prompt context the first token's space is a real space between prompt and output.
    prompt = tok.encode("hello", add_special_tokens=False).ids
    deltas, _ = _stream(_make(tok, prompt=prompt), ids)
    assert "".join(deltas) == " " + text
    deltas, found = _stream(_make(tok, stop=["o w"]), ids)
    expected, expected_stop = _first_stop(text, ["o w"], False)
    assert ("".join(deltas), found) == (expected, expected_stop)
