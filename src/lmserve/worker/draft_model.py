"""Speculative decoding with a draft model (`--speculative-config '{"model": PATH, "num_speculative_tokens": k}'`).

A small model of the same family (the same vocabulary) guesses the next k tokens, one cheap forward pass each; the
target verifies them in one pass as it verifies prompt lookup's (engine/speculation.py: the drafts kept up to the first
one the target's own sample differs from, then that sample). The guesses are the draft's greedy choices: one fixed
guess per position, for which that rule is rejection sampling exactly.

The draft runs in the target's worker with a KV cache of its own, addressed by the target's block tables (the same
block size and number of blocks, so every block id the scheduler hands out exists in both). Its cache mirrors the
target's: every step, after the target's forward pass, the draft computes the same positions of the same batch
(prompt chunks, decodes, verified drafts), so before drafting for a request it holds every position the target
holds. Positions of rejected drafts are written again when the scheduler recomputes them, in both caches.

The scheduler reserves the drafted positions (placeholders in ScheduledRequest.draft_token_ids); the runner fills
them here before it builds the batch.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from lmserve.config import CacheConfig, ModelConfig, PlacementConfig
from lmserve.worker.attention import ScheduledChunk, build_metadata
from lmserve.worker.placement import apply_placement
from lmserve.worker.prompt_rows import PromptRows, prompt_rows
from lmserve.worker.sampler import argmax_rows

logger = logging.getLogger(__name__)


def draft_configs(draft: str, model_config: ModelConfig, cache_config: CacheConfig,
                  target_num_blocks: int) -> tuple[ModelConfig, CacheConfig]:
    """The draft runner's model and cache settings: the target's device and dtype, the draft's own weights format
    (auto: its file's blocks), and the target's block size and pool (its block tables address this cache too)."""
    config = dataclasses.replace(model_config, model=draft, tokenizer=None, quantization="auto")
    cache = dataclasses.replace(cache_config, num_blocks=target_num_blocks, kv_cache_memory=None)
    return config, cache


class DraftModel:
    def __init__(self, draft: str, runner, placement: PlacementConfig | None, target) -> None:
        """runner: a ModelRunner built on draft_configs (the runner builds it: this module does not import it)."""
        self.runner = runner
        if target.device.type == "cpu" and (target.numpy_matmuls or runner.numpy_matmuls):
            # One process, one CPU placement: with NumPy's BLAS doing either model's matmuls, torch keeps one thread
            # (its OpenMP workers spinning against BLAS's made every step 3x slower).
            apply_placement(placement or PlacementConfig(), blas_does_matmuls=True)
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
        self.block_size = target.block_size
        self.backend = target.attention_backend
        self.device, self.dtype = target.device, target.dtype
        logger.info("draft model %s drafts for speculative decoding", draft)

    @torch.inference_mode()
    def fill(self, drafting: Sequence[Any]) -> None:
        """Replaces the placeholders of the requests that the scheduler gave draft positions (lmserve.step's
        ScheduledRequest: token_ids, draft_token_ids, start_position, block_ids) by the draft's greedy guesses: k
        single-position passes over those requests together, the first at each one's newest token."""
        if not drafting:
            return
        tokens = [s.token_ids[0] for s in drafting]
        for j in range(max(len(s.draft_token_ids) for s in drafting)):
            rows = [(i, s) for i, s in enumerate(drafting) if j < len(s.draft_token_ids)]
            chunks = [ScheduledChunk(s.start_position + j, 1, s.block_ids) for _, s in rows]
            attn = build_metadata(chunks, self.block_size, self.backend, self.device, self.dtype)
            input_ids = torch.as_tensor([tokens[i] for i, _ in rows], dtype=torch.long, device=self.device)
            positions = torch.as_tensor([s.start_position + j for _, s in rows], device=self.device)
            runner = self.runner
            with prompt_rows(PromptRows.from_mask(np.zeros(len(rows), dtype=bool))):  # generated rows
                hidden = runner.model(input_ids, positions, runner.kv_caches, attn)
            guesses = argmax_rows(runner.model.compute_logits(hidden)).tolist()
            for (i, s), guess in zip(rows, guesses, strict=True):
                s.draft_token_ids[j] = guess
                s.token_ids[1 + j] = guess
                tokens[i] = guess

    @torch.inference_mode()
    def mirror(self, input_ids: torch.Tensor, positions: torch.Tensor, attn, rows: PromptRows | None) -> None:
        """The draft's K/V for every position the target computed this step (the same batch)."""
        with prompt_rows(rows):
            self.runner.model(input_ids, positions, self.runner.kv_caches, attn)
