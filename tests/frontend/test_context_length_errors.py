"""Context-length errors open with OpenAI's and vLLM's words: LiteLLM (and other clients) match "This model's maximum
context length is" to tell a context-window error from any other 400, and then trim the prompt or fall back."""

from __future__ import annotations

import re

import pytest

from lmserve.frontend.input_processor import InputProcessor, PromptTooLongError
from lmserve.sampling_params import SamplingParams

OPENAI_WORDS = re.compile(r"^This model's maximum context length is 32 tokens\. However, ")


@pytest.fixture
def inputs(default_tokenizer) -> InputProcessor:
    return InputProcessor(default_tokenizer, max_model_len=32, vocab_size=50_000)


def test_prompt_and_max_tokens_beyond_the_context(inputs: InputProcessor) -> None:
    with pytest.raises(PromptTooLongError) as info:
        inputs.check_length(10, SamplingParams(max_tokens=30))
    assert OPENAI_WORDS.match(str(info.value))
    # OpenAI's own sentence, numbers in place: what clients that read the requested size parse.
    assert "However, you requested 40 tokens (10 in the messages, 30 in the completion)." in str(info.value)
    assert inputs.check_length(10, SamplingParams(max_tokens=22)).max_tokens == 22  # exactly full is fine


def test_a_prompt_with_no_room_left(inputs: InputProcessor) -> None:
    with pytest.raises(PromptTooLongError) as info:
        inputs.tokenize(list(range(1, 33)))
    assert OPENAI_WORDS.match(str(info.value)) and "32 input tokens" in str(info.value)
    with pytest.raises(PromptTooLongError) as info:
        inputs.check_length(40, SamplingParams(max_tokens=None))
    assert OPENAI_WORDS.match(str(info.value)) and "40 input tokens" in str(info.value)


def test_min_tokens_and_text_too_long_for_the_context(inputs: InputProcessor) -> None:
    with pytest.raises(PromptTooLongError) as info:
        inputs.check_length(20, SamplingParams(max_tokens=None, min_tokens=15))
    assert OPENAI_WORDS.match(str(info.value)) and "min_tokens=15" in str(info.value)
    with pytest.raises(PromptTooLongError) as info:
        inputs.tokenize("word " * 10_000)  # refused by its length in characters, before any tokenization
    assert OPENAI_WORDS.match(str(info.value)) and "50000 characters" in str(info.value)


def test_truncate_prompt_tokens_keeps_the_last_tokens(inputs: InputProcessor) -> None:
    text = " ".join(f"w{i}" for i in range(40))
    whole = inputs.tokenize(text)
    cut = inputs.tokenize(text, truncate_to=10)
    assert cut.token_ids == whole.token_ids[-10:] and cut.text is None  # the ids no longer spell the text
    assert inputs.tokenize(text, truncate_to=len(whole.token_ids) + 5) == whole  # nothing to cut: the text stays
    assert inputs.tokenize(list(range(1, 100)), truncate_to=5).token_ids == [95, 96, 97, 98, 99]
    with pytest.raises(PromptTooLongError):  # -1: the last max_model_len tokens, which leave no room to generate
        inputs.check_length(len(inputs.tokenize(list(range(1, 100)), truncate_to=-1).token_ids), SamplingParams())
