"""Speculative decoding's engine side: whom to draft for, how many drafts, and what came of them.

A request with drafts is scheduled for 1 + k positions: its newest token and k drafts. The runner samples every one
of those positions as it would sample a plain decode (the same sampler, each row conditioned on the drafts before
it) and keeps the drafts up to the first one that differs from its own sample, then that sample. For drafts that are
one fixed guess (prompt lookup's), this is rejection sampling exactly: a draft is kept with the target probability
of that token, and on rejection the token drawn is distributed as the target with the draft's token taken out. So
greedy output equals decoding without speculation, and a random request's output has its distribution unchanged.

Speculation must never cost: each request keeps a running acceptance rate (half the weight on its last draft step)
and proposes k times that rate, rounded up, so that a failing request's steps verify one or two drafts, not k (a
verified row is a row of compute). When the rate falls below PAUSE_BELOW the request stops proposing for a number of
its own tokens that doubles on each pause in a row (4, 8, ... 64), then tries again with one draft; one step after a
pause that keeps fewer than a quarter of its drafts pauses it again, and a step that keeps half of them or more
resets the pause to 4. Penalties and min_tokens see each
row's drafts before it as output (worker/sampling_metadata.py's draft_rows). A constrained request's grammar vets its
lookup drafts here (they are cut at the first token it refuses, and the matcher rolled back), and the runner samples
each drafted row under the grammar advanced by the drafts before it (worker/rejection_sampler.py); that
needs the matchers in the runner's process and a draw the mask can follow (greedy or plain temperature), so other
constrained requests, and requests planned ahead by async scheduling (their newest token is not known yet), decode
without drafts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

from lmserve.sampling_params import SamplingParams
from lmserve.spec_decode.ngram import NgramProposer
from lmserve.spec_decode.proposer import Proposer, ReservedPositions, TokenHistory
from lmserve.speculative_config import SpeculativeConfig
from lmserve.structured_output import TokenMatcher

PAUSE_BELOW = 0.25
FIRST_PAUSE = 4
LONGEST_PAUSE = 64


class DraftingGrammar(Protocol):
    """What drafting reads of a constrained request's grammar (engine.grammar.GrammarState)."""

    matcher: TokenMatcher | None  # None until the grammar compiled
    waiting_for: int | None  # the token the grammar starts after, until the request samples it


class DraftingRequest(TokenHistory, Protocol):
    """What the speculator reads of a request (engine.request.Request)."""

    sampling_params: SamplingParams
    grammar: DraftingGrammar | None

    @property
    def num_output_tokens(self) -> int: ...


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
    def __init__(self, config: SpeculativeConfig, draft_constrained: bool = True) -> None:
        """`draft_constrained`: the runner can sample drafted rows under a grammar (its ranks share this process)."""
        self.config = config
        self.draft_constrained = draft_constrained
        # Prompt lookup proposes here; a draft model proposes in the worker, into the positions reserved here.
        self.proposer: Proposer[DraftingRequest] = (
            ReservedPositions(config) if config.model is not None else NgramProposer(config))
        self.pause_below = PAUSE_BELOW  # one attribute, so that benchmarks/speculative_counts.py can try others
        self.gates: dict[str, DraftGate] = {}
        self.stats = SpeculationStats(accepted_per_position=[0] * config.num_speculative_tokens)

    def drafts(self, request: DraftingRequest, room: int) -> list[int]:
        """Drafts for a decoding request, at most `room` (what the step's budget, max_tokens and max_model_len
        leave beyond its one plain position)."""
        if room <= 0 or (request.grammar is not None and not self._grammar_drafts(request)):
            return []
        gate = self.gates.get(request.request_id)
        if gate is not None:
            if request.num_output_tokens < gate.paused_until:
                return []
            room = min(room, max(1, math.ceil(self.config.num_speculative_tokens * gate.acceptance)))
        [drafts] = self.proposer.propose([request], [room])
        if drafts and request.grammar is not None and self.config.model is None:  # a draft model's come later
            assert request.grammar.matcher is not None  # _grammar_drafts
            drafts = vetted(request.grammar.matcher, drafts)
        return drafts

    def _grammar_drafts(self, request: DraftingRequest) -> bool:
        state = request.grammar
        assert state is not None
        params = request.sampling_params
        plain_draw = params.greedy or (params.top_k == 0 and params.top_p >= 1.0 and params.min_p == 0.0)
        return (self.draft_constrained and plain_draw and state.matcher is not None and state.waiting_for is None
                and not state.matcher.is_terminated())

    def record(self, request: DraftingRequest, num_drafts: int, num_accepted: int) -> None:
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
        if gate.acceptance < self.pause_below:
            gate.paused_until = request.num_output_tokens + gate.pause
            gate.pause = min(2 * gate.pause, LONGEST_PAUSE)
            gate.acceptance = self.pause_below  # on trial after the pause: one step keeping < 1/4 of its drafts re-pauses

    def drop(self, request_id: str) -> None:
        self.proposer.drop(request_id)
        self.gates.pop(request_id, None)


def vetted(matcher: TokenMatcher, drafts: list[int]) -> list[int]:
    """The drafts up to the first one the grammar refuses after those before it; the matcher is left as it was."""
    kept = 0
    for token in drafts:
        if matcher.is_terminated() or not matcher.accept_token(token):
            break
        kept += 1
    if kept:
        matcher.rollback(kept)
    return drafts[:kept]
