"""From an encoder's hidden states to one vector per sequence, as the model's files say (lmserve.pooling_config):
mean, CLS (first token), last token or max over the sequence's rows; then Matryoshka truncation and normalisation,
in vLLM's order (truncate, then normalise, so a shortened vector is a unit vector again)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lmserve.pooling_config import PoolingConfig


def pool(hidden: torch.Tensor, seq_lens: list[int], config: PoolingConfig,
         dimensions: list[int | None]) -> list[torch.Tensor]:
    """One float32 vector per sequence: hidden [rows, hidden] holds the sequences' rows one after another."""
    vectors = []
    start = 0
    for n, dims in zip(seq_lens, dimensions, strict=True):
        rows = hidden[start : start + n].float()  # sums in float32 whatever the model's dtype
        start += n
        if config.pooling == "mean":
            vector = rows.mean(dim=0)
        elif config.pooling == "cls":
            vector = rows[0]
        elif config.pooling == "last":
            vector = rows[-1]
        else:
            vector = rows.max(dim=0).values
        if dims is not None:
            vector = vector[:dims]
        if config.normalize:
            vector = F.normalize(vector, dim=0)
        vectors.append(vector)
    return vectors
