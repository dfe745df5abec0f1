"""The front-end's tokenizer: the model's, or --tokenizer's, with --chat-template's template when one is given."""

from __future__ import annotations

from typing import Any

from lmserve.config import ModelConfig
from lmserve.generation_config import load_chat_template
from lmserve.harmony import uses_harmony
from lmserve.model_tokenizer import (
    FimTokens,
    end_of_generation_ids,
    load_tokenizer,
    model_fim_tokens,
    model_type_of,
)
from lmserve.models import resolve_model


def load_frontend_tokenizer(config: ModelConfig) -> Any:
    tokenizer = load_tokenizer(resolve_model(config.tokenizer or config.model))
    template = load_chat_template(config.chat_template)
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


def tokenizer_eos_token_ids(config: ModelConfig, tokenizer: Any) -> list[int]:
    """The ids that end generation by the tokenizer's word, besides the model config's (model_tokenizer.end_of_generation_ids)."""
    return end_of_generation_ids(resolve_model(config.tokenizer or config.model), tokenizer)


def tokenizer_fim_tokens(config: ModelConfig, tokenizer: Any) -> FimTokens | None:
    """The model's fill-in-the-middle tokens (model_tokenizer.fim_tokens), None for a model without them."""
    return model_fim_tokens(resolve_model(config.tokenizer or config.model), tokenizer)


def tokenizer_chat_format(config: ModelConfig, tokenizer: Any) -> str | None:
    """"harmony" for a model that speaks gpt-oss's format (lmserve.harmony renders its prompts, whatever its
    template); None: the chat template's text is the prompt. A --chat-template of the operator's is taken at its
    word: harmony only if it writes harmony."""
    model_type = None if config.chat_template is not None else model_type_of(resolve_model(config.model))
    return "harmony" if uses_harmony(model_type, getattr(tokenizer, "chat_template", None)) else None
