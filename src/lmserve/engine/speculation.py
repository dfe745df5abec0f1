"""Speculative decoding's engine side: whom to draft for, how many drafts, and what came of them.

A request with drafts is scheduled for 1 + k positions: its newest token and k drafts. The runner samples every one
of those positions as it would sample a plain decode (the same sampler, each row conditioned on the drafts before
it) and keeps the drafts up to the first one that differs from its own sample, then that sample. For drafts that are
one fixed guess (prompt lookup's), this is rejection sampling exactly: a draft is kept with the target probability
of that token, and on rejection the token drawn is distributed as the target with the draft's token taken out. So
greedy output equals decoding without speculation, and a random request's output has its distribution unchanged.

Speculation must never cost: each request keeps a running acceptance rate (half the weight on its last draft step),
and when it falls below PAUSE_BELOW the request stops proposing for a number of its own tokens that doubles on each
pause in a row (4, 8, ... 64), then tries again; one step after a pause that keeps fewer than a quarter of its drafts
pauses it again, and a step that keeps half of them or more resets the pause to 4. Penalties and min_tokens see each row's drafts before it as output
(worker's ModelRunner._draft_rows). Constrained requests never draft (their grammar advances one token at a time on
the engine thread), nor does a request planned ahead by async scheduling (its newest token is not known yet).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lmserve.config import SpeculativeConfig
from lmserve.engine.ngram_proposer import NgramProposer
from lmserve.engine.outputs import PLACEHOLDER_TOKEN_ID
from lmserve.engine.request import Request

PAUSE_BELOW = 0.25
FIRST_PAUSE = 4
LONGEST_PAUSE = 64


@dataclass
class DraftGate:
    """One request's acceptance history."""

    acceptance: float = 1.0
    pause: int = FIRST_PAUSE
    paused_until: int = 0  # the request's output length at which it may propose again


@dataclass
class SpeculationStats:
    """vLLM's spec_decode counters: draft steps, draft tokens proposed and accepted, and accepted per position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


class Speculator:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.proposer = NgramProposer(config)
        self.gates: dict[str, DraftGate] = {}
        self.stats = SpeculationStats(accepted_per_position=[0] * config.num_speculative_tokens)

    def drafts(self, request: Request, room: int) -> list[int]:
        """Drafts for a decoding request, at most `room` (what the step's budget, max_tokens and max_model_len
        leave beyond its one plain position)."""
        if room <= 0 or request.grammar is not None:
            return []
        gate = self.gates.get(request.request_id)
        if gate is not None and request.num_output_tokens < gate.paused_until:
            return []
        if self.config.model is not None:  # the draft model fills these positions in, in the worker
            return [PLACEHOLDER_TOKEN_ID] * min(room, self.config.num_speculative_tokens)
        return self.proposer.propose(request, room)

    def record(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            stats.accepted_per_position[position] += 1
        gate = self.gates.setdefault(request.request_id, DraftGate())
        rate = num_accepted / num_drafts
        gate.acceptance = 0.5 * gate.acceptance + 0.5 * rate
        if rate >= 0.5:
            gate.pause = FIRST_PAUSE
        if gate.acceptance < PAUSE_BELOW:
            gate.paused_until = request.num_output_tokens + gate.pause
            gate.pause = min(2 * gate.pause, LONGEST_PAUSE)
            gate.acceptance = PAUSE_BELOW  # on trial after the pause: one step keeping < 1/4 of its drafts re-pauses

    def drop(self, request_id: str) -> None:
        self.proposer.drop(request_id)
        self.gates.pop(request_id, None)
