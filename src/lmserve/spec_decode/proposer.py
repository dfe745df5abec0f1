"""The one interface of a draft proposer, and what a proposer may read of a request.

A proposer guesses the tokens that follow each request's tokens, up to a number given per request; the target model
verifies the guesses in one forward pass (worker/rejection_sampler.py), so a proposer decides only how much a step
gains, never what the output is. Prompt lookup (ngram.py) reads the engine's requests; the draft model
(draft_model.py) reads the scheduler's plan of a step (ScheduledRequest), in the worker.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

from lmserve.speculative_config import SpeculativeConfig
from lmserve.step import PLACEHOLDER_TOKEN_ID

RequestT_contra = TypeVar("RequestT_contra", contravariant=True)


class Proposer(Protocol[RequestT_contra]):
    def propose(self, requests: Sequence[RequestT_contra], max_drafts: Sequence[int]) -> list[list[int]]:
        """Draft tokens to follow each request's tokens, at most max_drafts[i] for requests[i] (fewer, or none, where
        the proposer has no good guess), in the order of `requests`."""
        ...

    def drop(self, request_id: str) -> None:
        """Forgets what the proposer kept of a request that ended."""
        ...


class TokenHistory(Protocol):
    """A request's tokens so far, as prompt lookup reads them (engine.request.Request)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...


class ReservedPositions:
    """The engine's stand-in for a proposer that runs in the worker (the draft model): it proposes placeholders, so
    that the scheduler reserves the positions and their blocks; the worker's proposer fills in the tokens."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens

    def propose(self, requests: Sequence[object], max_drafts: Sequence[int]) -> list[list[int]]:
        return [[PLACEHOLDER_TOKEN_ID] * min(k, self.num_speculative_tokens) for k in max_drafts]

    def drop(self, request_id: str) -> None:
        pass
