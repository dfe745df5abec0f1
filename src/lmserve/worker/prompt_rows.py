"""Which rows of a step's batch hold prompt tokens, for the layers that compute those rows another way.

The model runner knows each row's token (worker/model_runner.py); a linear layer deep in the model sees only a
[tokens, features] tensor. As vLLM's forward context does, the runner sets the batch's rows for the duration of its
forward pass and the layers that care read them (worker/weights/block_linear.py: prompt rows on AMX tiles).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import numpy as np
import torch

RowIndex = slice | torch.Tensor


@dataclass(frozen=True)
class PromptRows:
    """The rows of a batch of num_rows tokens that are prompt tokens and those that are generated ones, each a slice
    where they are contiguous (the usual case: decodes first, then prompt chunks), else an index tensor; None for
    no rows."""

    num_rows: int
    prompt: RowIndex | None
    generated: RowIndex | None

    @classmethod
    def from_mask(cls, is_prompt: np.ndarray) -> PromptRows:
        return cls(len(is_prompt), _rows(np.flatnonzero(is_prompt)), _rows(np.flatnonzero(~is_prompt)))


def _rows(index: np.ndarray) -> RowIndex | None:
    if len(index) == 0:
        return None
    if index[-1] - index[0] + 1 == len(index):
        return slice(int(index[0]), int(index[-1]) + 1)
    return torch.from_numpy(index)


_PROMPT_ROWS: ContextVar[PromptRows | None] = ContextVar("lmserve_prompt_rows", default=None)


@contextlib.contextmanager
def prompt_rows(rows: PromptRows | None) -> Iterator[None]:
    """The batch's prompt rows while the forward pass runs."""
    token = _PROMPT_ROWS.set(rows)
    try:
        yield
    finally:
        _PROMPT_ROWS.reset(token)


def current_prompt_rows() -> PromptRows | None:
    return _PROMPT_ROWS.get()
