"""From a model's hidden states to one vector per sequence, as the model's files say (lmserve.pooling_config):
mean, CLS (first token), last token or max over the sequence's rows; then sentence-transformers' Dense modules
(EmbeddingGemma's projections), Matryoshka truncation and normalisation, in vLLM's order (truncate, then normalise, so
a shortened vector is a unit vector again)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from lmserve.pooling_config import PoolingConfig


def pool(hidden: torch.Tensor, seq_lens: list[int], config: PoolingConfig, dimensions: list[int | None],
         project: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[torch.Tensor]:
    """One float32 vector per sequence: hidden [rows, hidden] holds the sequences' rows one after another. project:
    the Dense modules, over the pooled vectors [sequences, hidden] (each row on its own)."""
    pooled = []
    start = 0
    for n in seq_lens:
        rows = hidden[start : start + n].float()  # sums in float32 whatever the model's dtype
        start += n
        if config.pooling == "mean":
            pooled.append(rows.mean(dim=0))
        elif config.pooling == "cls":
            pooled.append(rows[0])
        elif config.pooling == "last":
            pooled.append(rows[-1])
        else:
            pooled.append(rows.max(dim=0).values)
    if project is not None:
        pooled = list(project(torch.stack(pooled)).float().unbind())
    vectors = []
    for vector, dims in zip(pooled, dimensions, strict=True):
        if dims is not None:
            vector = vector[:dims]
        if config.normalize:
            vector = F.normalize(vector, dim=0)
        vectors.append(vector)
    return vectors
