"""Per-request parameters of a pooling request (an embedding): vLLM's PoolingParams, the part lmserve serves.

A pooling request is a prompt with no decode: the engine schedules its whole prompt in one step and the worker returns
one pooled vector instead of a sampled token (docs/embeddings.md).
"""

from __future__ import annotations

from dataclasses import dataclass

# Inputs of one /v1/embeddings request and the tokens of all of them together: bounded before anything is
# tokenized or sent to the engine (docs/limits.md). OpenAI's own limits: 2048 inputs, 300,000 tokens a request.
MAX_EMBEDDING_INPUTS = 2048
MAX_EMBEDDING_TOTAL_TOKENS = 300_000


@dataclass
class PoolingParams:
    # Matryoshka: keep the first `dimensions` values of the pooled vector (before normalisation, as vLLM does); only
    # for a model that declares such dimensions (the API checks it). None: the whole vector.
    dimensions: int | None = None
    # Keep the last k prompt tokens (-1: the model's length); None: a longer prompt is refused.
    truncate_prompt_tokens: int | None = None
    # A cross-encoder's pair (rerank, score): the prompt's positions from here on are the second text (BERT's token
    # type 1, the document); None: one text.
    second_segment_start: int | None = None
