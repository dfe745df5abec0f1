"""Front-end fixtures."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="session")
def tokenizer(default_tokenizer: Any) -> Any:
    """The default model's tokenizer (loaded once per session by tests/conftest.py)."""
    return default_tokenizer
