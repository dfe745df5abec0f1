"""Prompt lookup (vLLM's `ngram` speculative method): drafts copied from earlier in the sequence.

Code edits, retrieval answers and summaries repeat long stretches of their prompt. When the sequence's last n tokens
occurred before, the tokens that followed that occurrence are a good guess for the next ones; the model verifies
the guess in one forward pass (the scheduler's and the runner's part), so the output is what decoding without it
gives.

Each request's tokens are mirrored in a growing NumPy array (appended as tokens arrive, never rebuilt), and a lookup
compares the last token with the whole array once, then extends the matches backwards: O(length) in C per step, not
O(length x n) in Python.

The engine's proposer (spec_decode/proposer.py's Proposer over the engine's requests): the scheduler asks it for
one request's drafts at a time, as its step budget allows (speculator.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lmserve.spec_decode.proposer import TokenHistory
from lmserve.speculative_config import SpeculativeConfig


@dataclass
class _Tokens:
    array: np.ndarray
    length: int


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.num_speculative_tokens = config.num_speculative_tokens
        self._tokens: dict[str, _Tokens] = {}

    def propose(self, requests: Sequence[TokenHistory], max_drafts: Sequence[int]) -> list[list[int]]:
        return [self._lookup(request, k) for request, k in zip(requests, max_drafts, strict=True)]

    def _lookup(self, request: TokenHistory, max_tokens: int) -> list[int]:
        """Up to min(max_tokens, num_speculative_tokens) drafts to follow the request's tokens: those after the
        latest earlier occurrence of its longest suffix of prompt_lookup_min..max tokens that occurred before (where
        they run out at the sequence's end, the repetition they are part of is continued)."""
        k = min(max_tokens, self.num_speculative_tokens)
        if k <= 0:
            return []
        tokens = self._sync(request)
        length = len(tokens)
        if length < self.min_n + 1:
            return []
        last = tokens[-1]
        # Ends of earlier occurrences of the last token, each with at least one token after it.
        ends = np.flatnonzero(tokens[: length - 1] == last)
        if ends.size == 0:
            return []
        matched = np.ones(ends.size, dtype=np.int64)
        alive = np.ones(ends.size, dtype=bool)
        for back in range(1, self.max_n):
            alive &= ends >= back
            if not alive.any():
                break
            same = np.zeros(ends.size, dtype=bool)
            same[alive] = tokens[ends[alive] - back] == tokens[length - 1 - back]
            alive &= same
            matched += alive
        best = matched.max()
        if best < self.min_n:
            return []
        end = int(ends[np.flatnonzero(matched == best)[-1]])  # the latest of the longest matches
        drafts = tokens[end + 1 : end + 1 + k].tolist()
        # A match that runs into the sequence's end (a loop of `period` tokens) goes on as the loop would.
        period = length - 1 - end
        while len(drafts) < k:
            drafts.append(drafts[len(drafts) - period])
        return drafts

    def drop(self, request_id: str) -> None:
        self._tokens.pop(request_id, None)

    def _sync(self, request: TokenHistory) -> np.ndarray:
        """The request's tokens as an array, appending what arrived since the last call."""
        held = self._tokens.get(request.request_id)
        total = request.num_tokens
        if held is None:
            array = np.empty(max(64, 2 * total), dtype=np.int64)
            array[: request.num_prompt_tokens] = request.prompt_token_ids
            held = self._tokens[request.request_id] = _Tokens(array, request.num_prompt_tokens)
        if held.length < total:
            if total > held.array.size:
                grown = np.empty(2 * total, dtype=np.int64)
                grown[: held.length] = held.array[: held.length]
                held.array = grown
            new = request.output_token_ids[held.length - request.num_prompt_tokens :]
            held.array[held.length : total] = new
            held.length = total
        return held.array[:total]
