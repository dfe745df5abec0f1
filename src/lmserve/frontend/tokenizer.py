"""The front-end's tokenizer: the model's, or --tokenizer's, with --chat-template's template when one is given."""

from __future__ import annotations

from typing import Any

from lmserve.config import ModelConfig
from lmserve.generation_config import load_chat_template
from lmserve.models import load_tokenizer, resolve_model


def load_frontend_tokenizer(config: ModelConfig) -> Any:
    tokenizer = load_tokenizer(resolve_model(config.tokenizer or config.model))
    template = load_chat_template(config.chat_template)
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer
