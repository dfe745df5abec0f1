"""The sampler's grammar rule (worker/rejection_sampler.py): drawing unmasked and redrawing only refused rows gives
exactly the masked distribution (rejection sampling), the same as masking first."""

from __future__ import annotations

from collections.abc import Collection

import torch

from lmserve.sampling_params import SamplingParams
from lmserve.step import ScheduledRequest
from lmserve.worker.rejection_sampler import RejectionSampler
from lmserve.worker.sampler import Sampler

ALLOWED = (2, 5)  # the grammar's tokens; the model prefers others
LOGITS = torch.tensor([3.0, 2.5, 0.5, 2.0, 1.0, 1.5, 0.0, -1.0])


class TwoTokenGrammar:
    def __init__(self, request_ids: list[str], masked_first: bool) -> None:
        self.matchers = dict.fromkeys(request_ids)
        self.masked_first = list(request_ids) if masked_first else []
        self.filled = 0

    @property
    def request_ids(self) -> Collection[str]:
        return self.matchers.keys()

    def fill(self, request_ids: list[str]) -> torch.Tensor:
        self.filled += len(request_ids)
        return torch.full((len(request_ids), 1), sum(1 << t for t in ALLOWED), dtype=torch.int32)

    def allows(self, request_id: str, token_id: int) -> bool:
        return token_id in ALLOWED


def draw(masked_first: bool, n: int = 4000) -> tuple[torch.Tensor, int]:
    sampler = RejectionSampler(Sampler(), torch.device("cpu"), {})
    params = SamplingParams(temperature=1.0, seed=None)
    rows = [ScheduledRequest(f"r{i}", [1], 0, [0], True, params, [1], []) for i in range(n)]
    grammar = TwoTokenGrammar([r.request_id for r in rows], masked_first)
    tokens, _ = sampler.sample(LOGITS.repeat(n, 1), rows, grammar)
    return torch.bincount(torch.tensor(tokens), minlength=8), grammar.filled


def test_rejection_sampling_matches_the_masked_distribution() -> None:
    torch.manual_seed(0)
    probs = LOGITS[list(ALLOWED)].softmax(-1)  # the masked distribution over the two allowed tokens
    for masked_first in (False, True):
        counts, filled = draw(masked_first)
        assert counts.sum() == counts[list(ALLOWED)].sum(), "every draw is inside the grammar"
        share = counts[ALLOWED[0]] / counts.sum()
        assert abs(share - probs[0]) < 0.03, (masked_first, share, probs[0])  # ~4 standard errors
        if not masked_first:
            assert 0 < filled < 4000  # only refused rows paid for a mask
