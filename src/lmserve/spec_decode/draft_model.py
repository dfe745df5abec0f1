"""Speculative decoding with a draft model (`--speculative-config '{"model": PATH, "num_speculative_tokens": k}'`).

A small model of the same family (the same vocabulary) guesses the next k tokens, one cheap forward pass each; the
target verifies them in one pass as it verifies prompt lookup's (worker/rejection_sampler.py: the drafts kept up to
the first one the target's own sample differs from, then that sample). The guesses are the draft's greedy choices:
one fixed guess per position, for which that rule is rejection sampling exactly.

The draft runs in the target's worker with a KV cache of its own, addressed by the target's block tables (the same
block size and number of blocks, so every block id the scheduler hands out exists in both). Its cache mirrors the
target's: every step, after the target's forward pass, the draft computes the same positions of the same batch
(prompt chunks, decodes, verified drafts), so before drafting for a request it holds every position the target
holds. Positions of rejected drafts are written again when the scheduler recomputes them, in both caches.

The scheduler reserves the drafted positions (placeholders in ScheduledRequest.draft_token_ids, from
proposer.ReservedPositions); the runner asks this proposer for their tokens before it builds the batch and builds
its batch from them: the scheduler's plan is never written to.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any, Protocol

from lmserve.config import CacheConfig, ModelConfig
from lmserve.kv_groups import KVCacheGroups
from lmserve.step import ScheduledRequest

logger = logging.getLogger(__name__)


def draft_configs(draft: str, model_config: ModelConfig, cache_config: CacheConfig,
                  target_num_blocks: int) -> tuple[ModelConfig, CacheConfig]:
    """The draft runner's model and cache settings: the target's device and dtype, the draft's own weights format
    (auto: its file's blocks), and the target's block size and pool (its block tables address this cache too)."""
    config = dataclasses.replace(model_config, model=draft, tokenizer=None, quantization="auto")
    cache = dataclasses.replace(cache_config, num_blocks=target_num_blocks, kv_cache_memory=None)
    return config, cache


class DraftRunner(Protocol):
    """What the proposer needs of the draft's runner and of the target's (worker.model_runner.ModelRunner)."""

    vocab_size: int
    attention_backend: str
    kv_groups: KVCacheGroups
    max_model_len: int

    def greedy_tokens(self, token_ids: list[int], positions: list[int], block_tables: list[list[int]]) -> list[int]:
        """One generated position a row (token_ids[i] at positions[i], its K/V into block_tables[i]'s blocks): the
        argmax of each row's next-token logits."""
        ...

    def compute_kv(self, batch: Any) -> None:
        """The K/V of every position of a batch the target ran this step (its BatchInputs)."""
        ...


class DraftModelProposer:
    """spec_decode.proposer.Proposer over the scheduler's plan of a step: requests[i] has max_drafts[i] reserved
    draft positions after its newest token (token_ids[0] at start_position), and gets exactly that many guesses."""

    def __init__(self, draft: str, runner: DraftRunner, target: DraftRunner) -> None:
        """runner: a ModelRunner built on draft_configs (the worker builds it: this package imports no worker)."""
        self.runner = runner
        problems = []
        if runner.vocab_size != target.vocab_size:
            problems.append(f"its vocabulary has {runner.vocab_size} tokens, the model's {target.vocab_size}")
        if runner.attention_backend != target.attention_backend:
            problems.append(f"its attention backend is {runner.attention_backend}, the model's "
                            f"{target.attention_backend}")
        if runner.kv_groups.is_hybrid or target.kv_groups.is_hybrid:
            problems.append("sliding-window KV-cache groups (Gemma) are not supported with a draft model")
        if runner.max_model_len < target.max_model_len:
            problems.append(f"it holds {runner.max_model_len} positions, fewer than max_model_len "
                            f"{target.max_model_len}")
        if problems:
            raise ValueError(f"draft model {draft}: " + "; ".join(problems))
        logger.info("draft model %s drafts for speculative decoding", draft)

    def propose(self, requests: Sequence[ScheduledRequest], max_drafts: Sequence[int]) -> list[list[int]]:
        """The draft's greedy guesses: k single-position passes over the requests together, the first at each one's
        newest token, each next one at the guess before it."""
        guesses: list[list[int]] = [[] for _ in requests]
        newest = [s.token_ids[0] for s in requests]
        for j in range(max(max_drafts, default=0)):
            rows = [i for i, k in enumerate(max_drafts) if j < k]
            tokens = self.runner.greedy_tokens([newest[i] for i in rows],
                                               [requests[i].start_position + j for i in rows],
                                               [requests[i].block_ids for i in rows])
            for i, token in zip(rows, tokens, strict=True):
                guesses[i].append(token)
                newest[i] = token
        return guesses

    def drop(self, request_id: str) -> None:
        pass  # nothing kept per request: the draft's cache is addressed by the target's block tables

    def mirror(self, batch: Any) -> None:
        """The draft's K/V for every position the target computed this step (the same batch)."""
        self.runner.compute_kv(batch)
