"""Turns user input (text, token ids or chat messages) into validated engine requests."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import jinja2

from lmserve.engine.request import Request
from lmserve.harmony import render_harmony
from lmserve.sampling_params import SEED_RANGE, SamplingParams

Prompt = str | list[int]


# A prompt text longer than this many characters per token of context cannot fit (tokens of real text are a few
# characters long), so it is refused before the tokenizer spends time and memory on it.
MAX_PROMPT_CHARS_PER_TOKEN = 32


class PromptTooLongError(ValueError):
    """The prompt, or the prompt plus max_tokens, does not fit the model's context."""


@dataclass
class ProcessedPrompt:
    text: str | None
    token_ids: list[int]


class InputProcessor:
    def __init__(
        self, tokenizer: Any, max_model_len: int, vocab_size: int, max_num_seqs: int | None = None,
        scheduling_policy: str = "fcfs", model_eos_token_ids: list[int] | None = None,
        default_max_tokens: int | None = None, chat_format: str | None = None,
    ) -> None:
        """`default_max_tokens`: the model's max_new_tokens (--generation-config), which caps what max_tokens=None
        fills in. `chat_format` "harmony": chat prompts are gpt-oss's (lmserve.harmony), not the template's text."""
        self.tokenizer = tokenizer
        self.chat_format = chat_format
        self.default_max_tokens = default_max_tokens
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_n = max_num_seqs  # n above what the engine runs at once would only queue behind itself
        self.scheduling_policy = scheduling_policy
        # The model config's EOS ids and the tokenizer's (a GGUF config may name none; the caller adds a GGUF
        # vocabulary's end-of-turn tokens, model_tokenizer.end_of_generation_ids).
        eos = set(model_eos_token_ids or [])
        if tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = sorted(eos)

    def check_params(self, params: SamplingParams, priority: int = 0) -> None:
        """What SamplingParams cannot know alone: the vocabulary, the server's n cap, the scheduling policy."""
        if self.max_n is not None and params.n > self.max_n:
            raise ValueError(f"invalid sampling parameter n={params.n}: at most {self.max_n} (max_num_seqs)")
        for name, token_ids in params.token_ids_used().items():
            bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise ValueError(
                    f"invalid sampling parameter {name}={bad}: token id outside the vocabulary [0, {self.vocab_size})"
                )
        if priority != 0 and self.scheduling_policy != "priority":
            raise ValueError(
                f"invalid request parameter priority={priority}: priority scheduling is not enabled on this server "
                "(--scheduling-policy priority)"
            )

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool, template_kwargs: dict[str, Any],
        add_special_tokens: bool = False,
    ) -> list[int]:
        """The chat template over the messages, tokenized; ValueError says what went wrong."""
        try:
            text = self.apply_chat_template(messages, add_generation_prompt, **template_kwargs)
            # The template already holds the special tokens (BOS and turn markers): more only when asked.
            return self.tokenize(text, add_special_tokens=add_special_tokens).token_ids
        except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError,
                jinja2.TemplateError) as exc:
            # A template indexes what the client sent without checking it: any of these is the messages' fault.
            raise ValueError(f"cannot apply the chat template to these messages: {exc}") from exc

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        if not messages:
            raise ValueError("messages must be a non-empty list")
        if self.chat_format == "harmony":
            return render_harmony(messages, add_generation_prompt, **kwargs)
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("this model's tokenizer has no chat template")
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
        )

    def tokenize(
        self, prompt: Prompt, add_special_tokens: bool = True, truncate_to: int | None = None,
        split_special_tokens: bool = False, pooling: bool = False,
    ) -> ProcessedPrompt:
        """truncate_to: SamplingParams.truncate_prompt_tokens, the last k tokens kept (-1: max_model_len); a cut
        prompt's text is dropped, since the ids no longer spell it. split_special_tokens: a special token's text
        (`<|endoftext|>`) stays text, as llama.cpp tokenizes an infill prompt's code (parse_special=false). pooling: the prompt needs no room to generate (up to max_model_len tokens)."""
        keep = self.max_model_len if truncate_to == -1 else truncate_to
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            max_chars = self.max_model_len * MAX_PROMPT_CHARS_PER_TOKEN
            if len(prompt) > max_chars:
                raise PromptTooLongError(
                    f"{self._context_length()} However, your prompt has {len(prompt)} characters, more than the "
                    f"{max_chars} that can fit in max_model_len={self.max_model_len} tokens. Please reduce the "
                    "length of the messages."
                )
            try:
                options = {"split_special_tokens": True} if split_special_tokens else {}
                token_ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens, **options)
            except UnicodeError as exc:
                raise ValueError(f"prompt is not valid Unicode text: {exc}") from None
            if keep is not None and len(token_ids) > keep:
                return ProcessedPrompt(None, token_ids[-keep:])
            return ProcessedPrompt(prompt, token_ids)
        token_ids = list(prompt)
        if not token_ids:
            raise ValueError("prompt is empty")
        if keep is not None:
            token_ids = token_ids[-keep:]
        # Before the per-token check below.
        self.check_pooling_length(len(token_ids)) if pooling else self._check_prompt_fits(len(token_ids))
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {self.vocab_size})")
        return ProcessedPrompt(None, token_ids)

    def check_length(self, num_prompt_tokens: int, params: SamplingParams) -> SamplingParams:
        """Rejects prompts that cannot fit; fills in max_tokens=None as 'up to the context length' (and the model's
        default max_tokens, as vLLM: a default never makes a prompt too long)."""
        self._check_prompt_fits(num_prompt_tokens)
        room = self.max_model_len - num_prompt_tokens
        if params.max_tokens is None:
            params = copy.copy(params)
            params.max_tokens = min(room, self.default_max_tokens or room)
            if params.min_tokens > room:
                raise PromptTooLongError(
                    f"{self._context_length()} However, you requested at least {num_prompt_tokens + params.min_tokens}"
                    f" tokens ({num_prompt_tokens} in the messages, min_tokens={params.min_tokens} in the "
                    "completion). Please reduce the length of the messages or min_tokens."
                )
        elif params.max_tokens > room:
            raise PromptTooLongError(
                f"{self._context_length()} However, you requested {num_prompt_tokens + params.max_tokens} tokens "
                f"({num_prompt_tokens} in the messages, {params.max_tokens} in the completion). Please reduce the "
                f"length of the messages or completion (max_tokens={params.max_tokens})."
            )
        return params

    def check_pooling_length(self, num_prompt_tokens: int) -> None:
        """A pooling prompt needs no room to generate: up to max_model_len tokens."""
        if num_prompt_tokens > self.max_model_len:
            raise PromptTooLongError(
                f"{self._context_length()} However, your input has {num_prompt_tokens} tokens. Please reduce the "
                "length of the input (or set truncate_prompt_tokens)."
            )

    def _check_prompt_fits(self, num_prompt_tokens: int) -> None:
        if num_prompt_tokens >= self.max_model_len:
            raise PromptTooLongError(
                f"{self._context_length()} However, your request has {num_prompt_tokens} input tokens, which leaves "
                "no room to generate. Please reduce the length of the input messages (or serve with a larger "
                "max_model_len)."
            )

    def _context_length(self) -> str:
        # OpenAI's and vLLM's opening words: LiteLLM and other clients match them to tell a context-window error
        # (and trim or fall back) from any other 400.
        return f"This model's maximum context length is {self.max_model_len} tokens."

    def make_request(
        self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams, priority: int = 0,
        arrival_time: float | None = None, cache_salt: str | None = None,
    ) -> Request:
        self.check_params(params, priority)
        params = self.check_length(len(prompt.token_ids), params)
        request = Request(
            request_id=request_id,
            prompt_token_ids=prompt.token_ids,
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            priority=priority,
            cache_salt=cache_salt,
        )
        if arrival_time is not None:
            request.arrival_time = arrival_time
        return request


def child_params(params: SamplingParams) -> list[SamplingParams]:
    """One SamplingParams per sample; seeded samples get distinct seeds so n>1 gives n different answers."""
    if params.n == 1:
        return [params]
    children = []
    for i in range(params.n):
        child = copy.copy(params)
        child.n = 1
        if params.seed is not None:
            child.seed = params.seed + i
            if child.seed > SEED_RANGE[1]:  # stay a 64-bit seed: wrap around instead of overflowing
                child.seed -= 2**64
        children.append(child)
    return children
