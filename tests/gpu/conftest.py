"""tests/gpu runs only where CUDA is (each module skips itself otherwise); benchmarks/gpu_checks.sh runs it on a GPU
machine. The server helpers are tests/api's.

A GPU machine may lack the default model's package (its GGUF is too large to carry there): LMSERVE_TEST_TOKENIZER
names a directory holding its tokenizer (benchmarks/gpu_prepare.sh writes one), which the tiny models then use."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import transformers

sys.path.insert(0, str(Path(__file__).parents[1] / "api"))


@pytest.fixture(scope="session")
def default_tokenizer() -> transformers.PreTrainedTokenizerBase:
    path = os.environ.get("LMSERVE_TEST_TOKENIZER")
    if path:
        return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    from lmserve.model_tokenizer import load_tokenizer
    from lmserve.models import DEFAULT_MODEL, resolve_model

    return load_tokenizer(resolve_model(DEFAULT_MODEL))
