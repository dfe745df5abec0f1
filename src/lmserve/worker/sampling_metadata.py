"""A batch's sampling parameters as tensors, built once per step (`SamplingMetadata.build`) for the sampler
(worker/sampler.py): each stage's fields are None where no row of the batch uses it, so that stage is skipped."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from lmserve.sampling_params import SamplingParams
from lmserve.step import ScheduledRequest


def _padded(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    """Ragged token lists -> [B, max_len] int64, padded with `pad` (an extra, discarded vocab column)."""
    width = max((len(r) for r in rows), default=0)
    out = np.full((len(rows), max(width, 1)), pad, dtype=np.int64)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = r
    return torch.from_numpy(out).to(device)


def reads_output_token_ids(params: SamplingParams) -> bool:
    """Whether SamplingMetadata.build reads a row's output tokens (penalties, min_tokens); otherwise it ignores them."""
    return (
        params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0
        or params.min_tokens > 0
    )


def draft_rows(r: ScheduledRequest) -> list[ScheduledRequest]:
    """A drafted request's sampling rows: row i follows the drafts before it, so the penalties and min_tokens that
    read the output so far see them as tokens already generated."""
    if not reads_output_token_ids(r.sampling_params):
        return [r] * (len(r.draft_token_ids) + 1)
    return [r] + [replace(r, output_token_ids=[*r.output_token_ids, *r.draft_token_ids[:i]])
                  for i in range(1, len(r.draft_token_ids) + 1)]


@dataclass
class SamplingMetadata:
    """Per-batch sampling state as tensors; a field is None when its stage is a no-op for every row."""

    num_reqs: int
    vocab_size: int
    all_greedy: bool
    all_random: bool
    greedy_mask: torch.Tensor | None  # [B] bool; only for a batch that mixes greedy and random rows
    # Random-sampling parameters; greedy rows hold neutral values (temperature 1, no truncation).
    temperature: torch.Tensor | None  # [B] float32
    min_p: torch.Tensor | None  # [B] float32
    top_k: torch.Tensor | None  # [B] int64 in [1, V]; V means disabled
    max_top_k: int  # the largest enabled top_k (bounds the cheap topk path)
    top_p: torch.Tensor | None  # [B] float32
    # Row index -> generator, for random rows whose request has a seed.
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    # Penalties. Token tensors are padded with vocab_size; rows without the penalty hold only padding.
    prompt_token_ids: torch.Tensor | None = None  # [B, Lp]; only when a repetition penalty is set
    output_token_ids: torch.Tensor | None = None  # [B, Lo]
    repetition_penalty: torch.Tensor | None = None  # [B] float32
    frequency_penalty: torch.Tensor | None = None  # [B] float32
    presence_penalty: torch.Tensor | None = None  # [B] float32
    # Masks and biases, as sparse (row, token) index tensors.
    allowed_rows: torch.Tensor | None = None  # [R] int64
    allowed_token_ids: torch.Tensor | None = None  # [R, L] int64, padded with vocab_size
    bias_index: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, tokens)
    bias_values: torch.Tensor | None = None  # float32
    min_tokens_index: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, tokens) banned for now
    # Logprobs: which rows want them, and how many top entries each.
    logprob_rows: list[int] = field(default_factory=list)
    num_logprobs: list[int] = field(default_factory=list)
    # Constrained decoding: xgrammar's packed allowed-token bits, one row per batch row; applied to grammar_rows.
    grammar_bitmask: torch.Tensor | None = None  # [B, ceil(V / 32)] int32
    grammar_rows: list[int] = field(default_factory=list)

    @property
    def any_penalties(self) -> bool:
        return self.output_token_ids is not None

    @property
    def any_masks(self) -> bool:
        return (
            self.allowed_rows is not None or self.bias_index is not None or self.min_tokens_index is not None
            or self.grammar_bitmask is not None
        )

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        generators: list[torch.Generator | None],
        eos_token_ids: list[list[int]],
        vocab_size: int,
        device: torch.device,
    ) -> SamplingMetadata:
        n = len(params)
        assert len(prompt_token_ids) == len(output_token_ids) == len(generators) == n
        greedy = [p.greedy for p in params]
        all_greedy, all_random = all(greedy), not any(greedy)
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        return cls(
            num_reqs=n,
            vocab_size=vocab_size,
            all_greedy=all_greedy,
            all_random=all_random,
            greedy_mask=None if all_greedy or all_random else torch.tensor(greedy, dtype=torch.bool, device=device),
            # A greedy row never draws, so it never advances its generator.
            generators={i: g for i, g in enumerate(generators) if g is not None and not greedy[i]},
            **_random_fields(params, greedy, vocab_size, device),
            **_penalty_fields(params, prompt_token_ids, output_token_ids, vocab_size, device),
            **_mask_fields(params, output_token_ids, eos_token_ids, vocab_size, device),
            logprob_rows=lp_rows,
            num_logprobs=[params[i].logprobs or 0 for i in lp_rows],
        )


def _floats(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def _random_fields(params: list[SamplingParams], greedy: list[bool], vocab_size: int,
                   device: torch.device) -> dict[str, Any]:
    """Temperature, min_p, top_k and top_p, each None where no random row uses it (every field None, and max_top_k
    0, when every row is greedy). Greedy rows hold neutral values."""
    fields: dict[str, Any] = {"temperature": None, "min_p": None, "top_k": None, "max_top_k": 0, "top_p": None}
    if all(greedy):
        return fields
    random_params = [(not g, p) for g, p in zip(greedy, params, strict=True)]
    temps = [p.temperature if r else 1.0 for r, p in random_params]
    if any(t != 1.0 for t in temps):
        fields["temperature"] = _floats(temps, device)
    min_ps = [p.min_p if r else 0.0 for r, p in random_params]
    if any(m > 0.0 for m in min_ps):
        fields["min_p"] = _floats(min_ps, device)
    ks = [min(p.top_k, vocab_size) if r and p.top_k > 0 else vocab_size for r, p in random_params]
    if any(k < vocab_size for k in ks):
        fields["top_k"] = torch.tensor(ks, dtype=torch.int64, device=device)
        fields["max_top_k"] = max(k for k in ks if k < vocab_size)
    ps = [p.top_p if r else 1.0 for r, p in random_params]
    if any(q < 1.0 for q in ps):
        fields["top_p"] = _floats(ps, device)
    return fields


def _penalty_fields(params: list[SamplingParams], prompt_token_ids: list[list[int]],
                    output_token_ids: list[list[int]], vocab_size: int, device: torch.device) -> dict[str, Any]:
    """The repetition, frequency and presence penalties and the tokens they count (padded with vocab_size; a row
    without the penalty holds only padding), each None where no row has it."""
    rep = [p.repetition_penalty for p in params]
    freq = [p.frequency_penalty for p in params]
    pres = [p.presence_penalty for p in params]
    has_rep = [r != 1.0 for r in rep]
    has_out_pen = [f != 0.0 or q != 0.0 for f, q in zip(freq, pres, strict=True)]
    fields: dict[str, Any] = dict.fromkeys(("prompt_token_ids", "output_token_ids", "repetition_penalty",
                                            "frequency_penalty", "presence_penalty"))
    if any(has_rep):
        fields["prompt_token_ids"] = _padded([t if h else [] for t, h in zip(prompt_token_ids, has_rep, strict=True)],
                                             vocab_size, device)
        fields["repetition_penalty"] = _floats(rep, device)
    if any(has_rep) or any(has_out_pen):
        needs_out = [a or b for a, b in zip(has_rep, has_out_pen, strict=True)]
        fields["output_token_ids"] = _padded(
            [t if h else [] for t, h in zip(output_token_ids, needs_out, strict=True)], vocab_size, device)
        if any(f != 0.0 for f in freq):
            fields["frequency_penalty"] = _floats(freq, device)
        if any(q != 0.0 for q in pres):
            fields["presence_penalty"] = _floats(pres, device)
    return fields


def _mask_fields(params: list[SamplingParams], output_token_ids: list[list[int]], eos_token_ids: list[list[int]],
                 vocab_size: int, device: torch.device) -> dict[str, Any]:
    """allowed_token_ids, logit_bias and min_tokens as sparse (row, token) tensors, each None where no row has it.
    Out-of-range ids are ignored rather than crashing the whole batch."""
    allowed_rows: list[int] = []
    allowed_ids: list[list[int]] = []
    bias_rows: list[int] = []
    bias_tokens: list[int] = []
    bias_values: list[float] = []
    ban_rows: list[int] = []
    ban_tokens: list[int] = []
    for i, p in enumerate(params):
        if p.allowed_token_ids:
            ids = [t for t in p.allowed_token_ids if 0 <= t < vocab_size]
            if ids:  # an empty set would leave nothing to sample: treat it as no restriction
                allowed_rows.append(i)
                allowed_ids.append(ids)
        for t, b in (p.logit_bias or {}).items():
            if 0 <= int(t) < vocab_size:
                bias_rows.append(i)
                bias_tokens.append(int(t))
                bias_values.append(float(b))
        if len(output_token_ids[i]) < p.min_tokens:
            # With ignore_eos, EOS is an ordinary token, so only the stop ids are held back (as vLLM).
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids[i]))
            for t in sorted(stops):
                if 0 <= t < vocab_size:
                    ban_rows.append(i)
                    ban_tokens.append(t)

    def index(rows: list[int], tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not rows:
            return None
        return (torch.tensor(rows, dtype=torch.int64, device=device),
                torch.tensor(tokens, dtype=torch.int64, device=device))

    return {
        "allowed_rows": torch.tensor(allowed_rows, dtype=torch.int64, device=device) if allowed_rows else None,
        "allowed_token_ids": _padded(allowed_ids, vocab_size, device) if allowed_ids else None,
        "bias_index": index(bias_rows, bias_tokens),
        "bias_values": _floats(bias_values, device) if bias_values else None,
        "min_tokens_index": index(ban_rows, ban_tokens),
    }
