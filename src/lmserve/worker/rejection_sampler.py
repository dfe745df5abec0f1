"""The sampler's rules over one step's rows: a grammar's and speculative decoding's rejection sampling.

The Sampler (sampler.py) draws one token a row. This module decides which rows draw under which mask and what a
step keeps of them:
- a constrained row draws without its grammar's mask first and again under it only where the grammar refuses the
  token (the masked distribution exactly, for greedy and plain-temperature rows); rows whose draw the mask must cut
  first (top-k, top-p, min-p, seeded) are masked before their draw;
- a request with drafts (lmserve.spec_decode) has a row per draft and one after them, each conditioned on the drafts
  before it (sampling_metadata.draft_rows); `verify` keeps the drafts up to the first one that the row's own sample
  differs from, then that sample: for a draft that is one fixed guess (prompt lookup's, a draft model's greedy
  one) this is rejection sampling exactly, so greedy output equals decoding without drafts and sampled output keeps
  the target distribution. A constrained request's drafted rows are drawn in order under the grammar advanced by the
  drafts before them (the matcher rolled back after).
"""

from __future__ import annotations

import hashlib

import torch

from lmserve.outputs import Logprobs
from lmserve.step import ModelRunnerOutput, ScheduledRequest, StepGrammar
from lmserve.worker.sampler import Sampler
from lmserve.worker.sampling_metadata import SamplingMetadata, reads_output_token_ids


def row_offsets(rows: list[ScheduledRequest]) -> list[int]:
    """Each sampling row's place among its request's rows (0 for a request without drafts; a drafted request's
    rows follow each other)."""
    offsets: list[int] = []
    for i, r in enumerate(rows):
        offsets.append(offsets[-1] + 1 if i and rows[i - 1].request_id == r.request_id else 0)
    return offsets


class RejectionSampler:
    def __init__(self, sampler: Sampler, device: torch.device, last_sampled: dict[str, int]) -> None:
        """last_sampled: the runner's own last token of each request (a row planned before it was known reads it)."""
        self.sampler = sampler
        self.device = device
        self.last_sampled = last_sampled

    def _metadata(self, rows: list[ScheduledRequest], vocab_size: int, offsets: list[int] | None = None,
                  attempt: int = 0) -> SamplingMetadata:
        """`offsets`: each row's place among its request's rows (row_offsets of the step's rows); `attempt`: 1 for
        a row drawn again under its grammar's mask."""
        offsets = row_offsets(rows) if offsets is None else offsets
        return SamplingMetadata.build(
            params=[r.sampling_params for r in rows],
            prompt_token_ids=[r.prompt_token_ids for r in rows],
            output_token_ids=[self.output_token_ids(r) for r in rows],
            generators=[self._generator(r, offset, attempt) for r, offset in zip(rows, offsets, strict=True)],
            eos_token_ids=[r.eos_token_ids for r in rows],
            vocab_size=vocab_size,
            device=self.device,
        )

    def sample(
        self, logits: torch.Tensor, rows: list[ScheduledRequest], grammar: StepGrammar | None
    ) -> tuple[list[int], list[Logprobs | None]]:
        """One token per row. Constrained rows (lmserve.step.StepGrammar) draw without their mask first and again
        with it only when the grammar refuses the token, which gives the masked distribution exactly for the rows
        the grammar lets do so; the others are masked before the first draw."""
        offsets = row_offsets(rows)
        metadata = self._metadata(rows, logits.shape[-1], offsets)
        row_of = {r.request_id: i for i, r in enumerate(rows)}
        # Constrained requests with drafts: their first row, handled row by row below.
        drafted = {} if grammar is None else {
            r.request_id: i for i, r in enumerate(rows)
            if r.draft_token_ids and r.request_id in grammar.request_ids and row_of[r.request_id] != i
            and (i == 0 or rows[i - 1].request_id != r.request_id)
        }
        if grammar is not None and grammar.masked_first:
            masked = [rid for rid in grammar.masked_first if rid not in drafted]
            self._mask(metadata, grammar, [row_of[rid] for rid in masked], masked, len(rows))
        sampled = self.sampler(logits, metadata)
        token_ids, logprobs = sampled.token_ids.tolist(), list(sampled.logprobs)
        if grammar is None:
            return token_ids, logprobs
        for rid, first_row in drafted.items():
            self._sample_drafted_under_grammar(logits, rows, grammar, rid, first_row, token_ids, logprobs)
        first = set(grammar.masked_first)
        refused = [rid for rid in grammar.request_ids
                   if rid not in first and rid not in drafted and not grammar.allows(rid, token_ids[row_of[rid]])]
        if refused:
            redo = [row_of[rid] for rid in refused]
            metadata = self._metadata([rows[i] for i in redo], logits.shape[-1], [offsets[i] for i in redo], 1)
            self._mask(metadata, grammar, list(range(len(redo))), refused, len(redo))
            again = self.sampler(logits[redo], metadata)
            for k, (i, token) in enumerate(zip(redo, again.token_ids.tolist(), strict=True)):
                token_ids[i], logprobs[i] = token, again.logprobs[k]
        return token_ids, logprobs

    def _sample_drafted_under_grammar(self, logits: torch.Tensor, rows: list[ScheduledRequest], grammar: StepGrammar,
                                      rid: str, first_row: int, token_ids: list[int], logprobs: list) -> None:
        """A constrained request's drafted rows, in order: row i's token must be one the grammar allows after the
        drafts before it (the matcher advanced by them, then rolled back), drawn again under the mask where the
        unmasked draw broke it; rows after the first that differs from its draft are not kept anyway."""
        drafts = rows[first_row].draft_token_ids
        advanced = 0
        for i in range(len(drafts) + 1):
            row = first_row + i
            if not grammar.allows(rid, token_ids[row]):
                metadata = self._metadata([rows[row]], logits.shape[-1], [i], 1)
                self._mask(metadata, grammar, [0], [rid], 1)
                again = self.sampler(logits[[row]], metadata)
                token_ids[row], logprobs[row] = again.token_ids.tolist()[0], again.logprobs[0]
            if i == len(drafts) or token_ids[row] != drafts[i] or not grammar.accept(rid, drafts[i]):
                break
            advanced += 1
        if advanced:
            grammar.rollback(rid, advanced)

    @staticmethod
    def _mask(metadata: SamplingMetadata, grammar: StepGrammar, rows: list[int], request_ids: list[str], num_rows: int) -> None:
        mask = grammar.fill(request_ids)
        full = torch.full((num_rows, mask.shape[1]), -1, dtype=mask.dtype)
        full[rows] = mask
        metadata.grammar_bitmask, metadata.grammar_rows = full, rows

    def output_token_ids(self, r: ScheduledRequest) -> list[int]:
        """The output tokens before the one the row samples. A row planned before its previous token was known
        shares the request's list with the engine thread, which may be appending that token right now: when the
        sampler reads the list, such a row gets the part known when it was planned plus this runner's own token."""
        if not r.uses_previous_token or not reads_output_token_ids(r.sampling_params):
            return r.output_token_ids
        known = r.start_position - len(r.prompt_token_ids)
        return [*r.output_token_ids[:known], self.last_sampled[r.request_id]]

    def _generator(self, r: ScheduledRequest, offset: int = 0, attempt: int = 0) -> torch.Generator | None:
        """A seeded row's generator, seeded from (seed, the index of the token the row samples, attempt): a token's
        draw depends on where it is in the sequence, never on how many draws came before it. One generator a
        request consumed one number a row, so the drafts a step verified (which depend on the step's budget and free
        blocks, so on the batch), rejected ones included, moved every later draw; now a seeded request gives the
        same tokens alone or beside a prefill, with any number of drafts, and after a preemption."""
        seed = r.sampling_params.seed
        if seed is None or r.sampling_params.greedy:
            return None
        token_index = r.start_position + r.num_tokens - len(r.draft_token_ids) + offset
        derived = hashlib.blake2b(f"{seed}:{token_index}:{attempt}".encode(), digest_size=8).digest()
        gen = torch.Generator(device=self.device)
        gen.manual_seed(int.from_bytes(derived, "little") & (2**63 - 1))
        return gen


def verify(rows: list[ScheduledRequest], token_ids: list[int], logprobs: list[Logprobs | None],
           output: ModelRunnerOutput) -> None:
    """What the step keeps of each request's rows (`rows`: the batch's sampling rows, a drafted request's in a run),
    into `output`: its sampled token, and for a drafted request the drafts kept before it."""
    row = 0
    while row < len(rows):
        r = rows[row]
        rid, drafts = r.request_id, r.draft_token_ids
        if drafts:
            # The drafts up to the first that this row's own sample differs from, then that sample (or the
            # sample after the last draft): rejection sampling for a draft that is one fixed guess.
            kept = 0
            while kept < len(drafts) and token_ids[row + kept] == drafts[kept]:
                kept += 1
            output.accepted_draft_token_ids[rid] = drafts[:kept]
            if logprobs[row] is not None:
                output.accepted_draft_logprobs[rid] = logprobs[row : row + kept]
            row += kept
        output.sampled_token_ids[rid] = token_ids[row]
        if logprobs[row] is not None:
            output.logprobs[rid] = logprobs[row]
        row += 1 + (len(drafts) - kept if drafts else 0)
