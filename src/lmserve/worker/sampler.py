"""Turns a batch of logits into sampled tokens (and logprobs), one row per sampling request.

Order, as in DESIGN.md: allowed tokens / logit bias / min_tokens masks -> repetition, frequency, presence
penalties -> temperature (<= 1e-5 means greedy) -> min_p -> top_k -> top_p -> draw -> logprobs.

Everything the batch needs is turned into tensors once by `SamplingMetadata.build` (worker/sampling_metadata.py),
which also records which stages can be skipped (all greedy, no penalties, no masks, ...), so the common cases cost one
argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmserve.outputs import Logprobs
from lmserve.worker.kernels import top_p_mask_op
from lmserve.worker.sampling_metadata import SamplingMetadata

_NEG_INF = float("-inf")


# Processing stages. Each takes float32 logits [B, V], may modify them in place, and returns the result.


def apply_masks(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """allowed_token_ids, then logit_bias, then the min_tokens ban on EOS / stop ids."""
    if md.allowed_rows is not None and md.allowed_token_ids is not None:
        V = logits.shape[1]
        banned = torch.ones((len(md.allowed_rows), V + 1), dtype=torch.bool, device=logits.device)
        banned.scatter_(1, md.allowed_token_ids, False)
        sub = logits[md.allowed_rows].masked_fill_(banned[:, :V], _NEG_INF)
        logits[md.allowed_rows] = sub
    if md.bias_index is not None and md.bias_values is not None:
        logits.index_put_(md.bias_index, md.bias_values, accumulate=True)
    if md.min_tokens_index is not None:
        logits.index_put_(md.min_tokens_index, torch.tensor(_NEG_INF, device=logits.device))
    return logits


def apply_grammar(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    if md.grammar_bitmask is not None:
        import xgrammar as xgr  # only constrained batches get here; the engine checked that it imports

        xgr.apply_token_bitmask_inplace(logits, md.grammar_bitmask.to(logits.device), indices=md.grammar_rows)
    return logits


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Repetition (HF/vLLM: prompt + output), then frequency and presence (OpenAI: output only).

    Only the tokens a row has seen are touched: gathered, penalized and scattered back, so the cost follows the
    prompt and output lengths, not the vocabulary (a dense [B, V] count and three full-width passes cost ~1 ms a row).
    Column V, appended, takes the padding of the token lists; the result is the first V columns."""
    if md.output_token_ids is None:
        return logits
    B, V = logits.shape
    x = torch.cat([logits, logits.new_zeros(B, 1)], dim=1)
    output = md.output_token_ids
    if md.repetition_penalty is not None and md.prompt_token_ids is not None:
        seen = torch.cat([md.prompt_token_ids, output], dim=1)
        values = x.gather(1, seen)
        p = md.repetition_penalty.unsqueeze(1)
        # Dividing a positive logit and multiplying a negative one both make the token less likely. A token seen
        # several times gets the same value from each of its copies, so the scatter writes it once in effect.
        x.scatter_(1, seen, torch.where(values > 0, values / p, values * p))
    if md.presence_penalty is not None:
        x.scatter_(1, output, x.gather(1, output) - md.presence_penalty.unsqueeze(1))
    if md.frequency_penalty is not None:
        x.scatter_add_(1, output, (-md.frequency_penalty).unsqueeze(1).expand(output.shape).to(x.dtype))
    return x[:, :V].contiguous()  # the later stages run faster on whole rows


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor | None) -> torch.Tensor:
    if temperature is None:
        return logits
    return logits.div_(temperature.unsqueeze(1))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor | None) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the most likely token's.

    p_i < min_p * p_max is l_i - l_max < log(min_p) in logit space, so no softmax is needed: one max and one compare.
    A row with min_p 0 gets the threshold -inf and keeps everything.
    """
    if min_p is None:
        return logits
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)
    return logits.masked_fill_(logits < threshold, _NEG_INF)


# Candidate-set sizes tried, in order, for rows with top_p: a topk of this many (or of top_k + 1, if larger) usually
# holds the nucleus; rows where it does not try the next size, and then the full sort. topk(128) and topk(1024) of
# 49,152 logits cost about 0.16 and 0.5 ms on one core, a full sort about 5 ms.
_CANDIDATE_SIZES = (128, 1024)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, max_top_k: int = 0
) -> torch.Tensor:
    """Keep the k largest logits (ties at the k-th value are kept), then the smallest nucleus of mass >= p.

    The nucleus is ranked by logit, equal logits by descending token id (what a stable ascending sort, read from the
    top, gives), and a token is kept when the tokens ranked above it hold less than p. Rows with top_p look for the
    nucleus among a bounded topk of candidates (`_candidate_nucleus`) and sort the whole row only when it is not there.
    Both top-k paths cut at the k-th value, so a row's result does not depend on whether another row set top_p.
    """
    if top_k is None and top_p is None:
        return logits
    V = logits.shape[1]
    if top_p is None:
        assert top_k is not None
        # topk(max_k) is much cheaper than sorting the whole vocabulary.
        max_k = max_top_k or int(top_k.max())
        values = logits.topk(min(max_k, V), dim=-1).values
        kth = values.gather(1, (top_k.clamp(max=max_k) - 1).unsqueeze(1))
        kth = kth.masked_fill_(top_k.unsqueeze(1) >= V, _NEG_INF)
        return logits.masked_fill_(logits < kth, _NEG_INF)

    active = top_p < 1.0
    if top_k is not None:
        active |= top_k < V
    kernel = top_p_mask_op() if logits.device.type == "cpu" and logits.dtype == torch.float32 else None
    if kernel is not None:
        # Top-p alone: the C++ threshold search (kernels/top_p.cpp) keeps the same set without sorting anything.
        if top_k is None:
            kernel(logits, top_p.float().contiguous())  # rows with top_p 1 are left as they are
            return logits
        nucleus_only = active & (top_k >= V)
        if bool(nucleus_only.any()):
            rows = nucleus_only.nonzero().flatten()
            sub = logits[rows]
            kernel(sub, top_p[rows].float().contiguous())
            logits[rows] = sub
            active &= ~nucleus_only
    pending = active.nonzero().flatten()  # rows with neither setting keep every token
    for size in _CANDIDATE_SIZES:
        if pending.numel() == 0:
            return logits
        sub_k = top_k[pending] if top_k is not None else None
        largest_k = int(sub_k.masked_fill(sub_k >= V, 0).max()) if sub_k is not None else 0
        # One more than top_k, to see whether the k-th value's ties reach past the candidates.
        K = max(size, largest_k + 1)
        if K >= V:
            break
        every_row = pending.numel() == logits.shape[0]
        # The common case, every row pending (and batch 1), copies no rows in or out.
        kept, found = _candidate_nucleus(logits if every_row else logits[pending], sub_k, top_p[pending], K)
        if every_row and bool(found.all()):
            return kept
        logits[pending[found]] = kept[found]
        pending = pending[~found]
    if pending.numel() > 0:
        sub_k = top_k[pending] if top_k is not None else None
        logits[pending] = _sorted_top_k_top_p(logits[pending], sub_k, top_p[pending])
    return logits


def _candidate_nucleus(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor, K: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """apply_top_k_top_p's kept set from the K largest logits of each row, for the rows where they suffice.

    Returns the rows' logits with everything outside the kept set at -inf, and which rows were decided here; the
    others' returned values are meaningless. A row is decided when everything it keeps is among the candidates and
    ranked there as in the full sort: its top-k set ends above the K-th value, or its nucleus ends above the K-th value
    (only tokens above it are then needed, and all of those are candidates), or it has fewer than K finite logits.
    """
    V = logits.shape[1]
    vals, idx = logits.topk(K, dim=-1)
    # topk orders equal values arbitrarily; rank them by descending token id, as the full sort does, so the kept
    # set never depends on topk's internals: order by id, then a stable sort by value.
    idx, perm = idx.sort(dim=-1, descending=True)
    vals = vals.gather(1, perm)
    vals, perm = vals.sort(dim=-1, descending=True, stable=True)
    idx = idx.gather(1, perm)
    last = vals[:, -1:]
    complete = last == _NEG_INF  # every finite logit is a candidate
    p = top_p.unsqueeze(1)
    has_k = torch.zeros_like(complete)
    closed = complete.clone()  # the row's whole support after top_k is among the candidates
    if top_k is not None:
        k = top_k.unsqueeze(1)
        has_k = k < V
        kth = vals.gather(1, k.clamp(max=K) - 1).masked_fill_(~has_k, _NEG_INF)
        vals.masked_fill_(vals < kth, _NEG_INF)
        closed |= has_k & (kth > last)

    # Top-p needs each candidate's share of the row's mass: of the candidates alone when they hold its whole
    # support, else of the whole row (one pass, no sort).
    lse = vals.logsumexp(dim=-1, keepdim=True)
    open_rows = ~closed.squeeze(1)
    if bool(open_rows.all()):
        lse = logits.logsumexp(dim=-1, keepdim=True)
    elif bool(open_rows.any()):
        lse[open_rows] = logits[open_rows].logsumexp(dim=-1, keepdim=True)
    probs = (vals - lse).exp().double()
    above = probs.cumsum(dim=-1) - probs  # the mass ranked above each candidate
    # The full sort drops a token when the mass at or below it is <= 1 - p, i.e. the mass above it is >= p.
    drop = (p < 1.0) & (above >= p.double())
    drop[:, 0] = False  # the most likely token always stays
    num_kept = (~drop).sum(dim=-1, keepdim=True)  # `above` grows along the row, so the kept ones are a prefix
    nucleus_ends_inside = vals.gather(1, num_kept - 1) > last
    found = closed | (~has_k & (p < 1.0) & nucleus_ends_inside)
    vals.masked_fill_(drop, _NEG_INF)
    kept = torch.full_like(logits, _NEG_INF).scatter_(1, idx, vals)
    return kept, found.squeeze(1)


def _sorted_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor) -> torch.Tensor:
    """The reference: sort the whole row. Only for rows whose kept set is not among their topk candidates."""
    V = logits.shape[1]
    # Stable, so that equal logits rank by token id (the candidate path ranks them the same way).
    sorted_logits, order = logits.sort(dim=-1, descending=False, stable=True)
    if top_k is not None:
        kth = sorted_logits.gather(1, (V - top_k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, _NEG_INF)
    # Ascending order: a token goes when the mass at or below it is <= 1 - p, i.e. the tokens above it
    # already reach p. The most likely token always stays.
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cum <= (1.0 - top_p).unsqueeze(1)
    drop[:, -1] = False
    sorted_logits.masked_fill_(drop, _NEG_INF)
    return logits.scatter_(1, order, sorted_logits)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1), the first index of each row's maximum (NaN counts as the maximum, as in torch). On the CPU
    through NumPy: torch's CPU argmax over a 49,152-token row took ~100 us (1 ms for 16 rows), NumPy's ~6 us."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(x.detach().numpy().argmax(axis=-1))
    return x.argmax(dim=-1)


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Inverse CDF: one uniform u per row picks the first token whose cumulative probability exceeds u * total.

    One random number per row instead of one per token (an exponential race over 49,152 tokens spends ~1.3 ms on
    its noise alone); the CDF is summed in float64 so a token's chance is its probability to ~1e-16, not to a
    float32 rounding of the running sum. Seeded rows draw their uniform from their own generator, one number a step,
    so their tokens do not depend on the batch. `probs` need not be normalized.
    """
    B = probs.shape[0]
    u = torch.empty((B, 1), dtype=torch.float64, device=probs.device)
    if len(generators) < B:
        u.uniform_()
    for i, gen in generators.items():
        u[i].uniform_(generator=gen)
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    total = cdf[:, -1:]
    # u < 1, but u * total can round up to total, which no token's interval contains; stay strictly below it.
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    # right=True: the first token whose CDF exceeds the target, so tokens of probability 0 (empty intervals) never win.
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: list[Logprobs | None]  # per row; None where the request asked for none


class Sampler(torch.nn.Module):
    def forward(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        assert logits.dim() == 2 and logits.shape[0] == md.num_reqs
        # vLLM V1 reports logprobs of the raw model distribution, so take them before anything changes it.
        raw_logprobs = None
        if md.logprob_rows:
            rows = torch.tensor(md.logprob_rows, dtype=torch.int64, device=logits.device)
            raw_logprobs = logits[rows].to(torch.float32).log_softmax(dim=-1)

        if md.all_greedy and not md.any_masks and not md.any_penalties:
            token_ids = argmax_rows(logits)
        else:
            # A private float32 copy: the stages work in place.
            x = logits.to(torch.float32, copy=True)
            x = apply_masks(x, md)
            x = apply_grammar(x, md)  # before temperature: greedy, seeded and top-p draws all stay inside it
            x = apply_penalties(x, md)
            greedy_ids = None if md.all_random else argmax_rows(x)
            if md.all_greedy:
                assert greedy_ids is not None
                token_ids = greedy_ids
            else:
                x = apply_temperature(x, md.temperature)
                x = apply_min_p(x, md.min_p)
                x = apply_top_k_top_p(x, md.top_k, md.top_p, md.max_top_k)
                token_ids = random_sample(x.softmax(dim=-1), md.generators)
                if md.greedy_mask is not None and greedy_ids is not None:
                    token_ids = torch.where(md.greedy_mask, greedy_ids, token_ids)
                # A row whose masks leave no token (allowed_token_ids disjoint from a grammar, say) has no
                # distribution to draw from: give it the model's own choice rather than an id past the vocabulary,
                # which the next step's embedding lookup could not take. Its grammar then ends the request.
                no_token = token_ids >= logits.shape[-1]
                if bool(no_token.any()):
                    token_ids = torch.where(no_token, argmax_rows(logits), token_ids)

        logprobs: list[Logprobs | None] = [None] * md.num_reqs
        if raw_logprobs is not None:
            self._fill_logprobs(logprobs, raw_logprobs, token_ids, md)
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)

    @staticmethod
    def _fill_logprobs(
        out: list[Logprobs | None], lp: torch.Tensor, token_ids: torch.Tensor, md: SamplingMetadata
    ) -> None:
        rows = torch.tensor(md.logprob_rows, dtype=torch.int64, device=lp.device)
        entries = token_logprobs(lp, token_ids[rows], md.num_logprobs)
        for row, entry in zip(md.logprob_rows, entries, strict=True):
            out[row] = entry


def token_logprobs(lp: torch.Tensor, tokens: torch.Tensor, num_top: list[int]) -> list[Logprobs]:
    """Per row of log-probabilities `lp`: the chosen token's logprob and rank, and the row's top num_top[i]."""
    token_lp = lp.gather(1, tokens.unsqueeze(1))
    ranks = (lp > token_lp).sum(dim=-1) + 1
    max_k = max(num_top, default=0)
    top_lp, top_ids = lp.topk(max_k, dim=-1) if max_k > 0 else (None, None)
    # One transfer per tensor, then plain Python packaging.
    tokens_l = tokens.tolist()
    token_lp_l = token_lp.squeeze(1).tolist()
    ranks_l = ranks.tolist()
    top_lp_l = top_lp.tolist() if top_lp is not None else None
    top_ids_l = top_ids.tolist() if top_ids is not None else None
    entries = []
    for j, k in enumerate(num_top):
        top: list[tuple[int, float]] = []
        if k > 0 and top_lp_l is not None and top_ids_l is not None:
            top = list(zip(top_ids_l[j][:k], top_lp_l[j][:k]))
        entries.append(Logprobs(token_id=tokens_l[j], logprob=token_lp_l[j], rank=ranks_l[j], top=top))
    return entries
