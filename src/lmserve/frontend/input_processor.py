"""Turns user input (text, token ids or chat messages) into validated engine requests."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from lmserve.engine.request import Request
from lmserve.sampling_params import SamplingParams

Prompt = str | list[int]


class PromptTooLongError(ValueError):
    """The prompt, or the prompt plus max_tokens, does not fit the model's context."""


@dataclass
class ProcessedPrompt:
    text: str | None
    token_ids: list[int]


class InputProcessor:
    def __init__(self, tokenizer: Any, max_model_len: int, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_id: int | None = tokenizer.eos_token_id

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        if not messages:
            raise ValueError("messages must be a non-empty list")
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("this model's tokenizer has no chat template")
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
        )

    def tokenize(self, prompt: Prompt, add_special_tokens: bool = True) -> ProcessedPrompt:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return ProcessedPrompt(prompt, self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
        token_ids = list(prompt)
        if not token_ids:
            raise ValueError("prompt is empty")
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {self.vocab_size})")
        return ProcessedPrompt(None, token_ids)

    def check_length(self, num_prompt_tokens: int, params: SamplingParams) -> SamplingParams:
        """Rejects prompts that cannot fit; fills in max_tokens=None as 'up to the context length'."""
        if num_prompt_tokens >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {num_prompt_tokens} tokens but the model's maximum context length is "
                f"{self.max_model_len} (max_model_len), leaving no room to generate"
            )
        room = self.max_model_len - num_prompt_tokens
        if params.max_tokens is None:
            params = copy.copy(params)
            params.max_tokens = room
        elif params.max_tokens > room:
            raise PromptTooLongError(
                f"this model's maximum context length is {self.max_model_len} tokens, but {num_prompt_tokens} "
                f"prompt tokens plus max_tokens={params.max_tokens} would need "
                f"{num_prompt_tokens + params.max_tokens}; reduce the prompt or max_tokens"
            )
        return params

    def make_request(
        self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams, priority: int = 0,
        arrival_time: float | None = None,
    ) -> Request:
        params = self.check_length(len(prompt.token_ids), params)
        request = Request(
            request_id=request_id,
            prompt_token_ids=prompt.token_ids,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            priority=priority,
        )
        if arrival_time is not None:
            request.arrival_time = arrival_time
        return request
