"""A model runner's KV cache: the attention backend and KV dtype, the sliding-window layers' groups (lmserve.kv_groups),
the block count (the same on every rank, one block table serving them all, sized for the largest pipeline stage) and
the block pool itself, zeroed lazily (worker/lazy_zeros.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from lmserve.config import CacheConfig, ModelConfig, SchedulerConfig
from lmserve.distributed.layout import stage_layers
from lmserve.kv_groups import KVCacheGroups, model_kv_groups
from lmserve.kv_sizing import INT8_KV, kv_bytes_per_block
from lmserve.worker.attention import check_attention_backend, check_kv_cache_dtype, kv_cache_shapes
from lmserve.worker.lazy_zeros import zeroed_lazily
from lmserve.worker.memory import measure_cuda_memory, num_kv_blocks, num_state_slots, profiling_step
from lmserve.worker.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


@dataclass
class KVCacheSetup:
    attention_backend: str
    dtype: torch.dtype
    groups: KVCacheGroups
    num_blocks: int
    caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer of this stage: K and V
    bytes_per_block: int
    state_slots: int = 0  # a hybrid model's per-request state slots, paid from the same memory (memory.num_state_slots)


def allocate_kv_cache(model: LlamaForCausalLM, hf_config: Any, pp_size: int, device: torch.device,
                      dtype: torch.dtype, max_model_len: int, block_size: int, model_config: ModelConfig,
                      cache_config: CacheConfig, scheduler_config: SchedulerConfig) -> KVCacheSetup:
    """Chooses the attention backend and KV dtype, sizes the block pool and allocates it."""
    num_kv_heads, head_dim = model.kv_shape
    attention_backend = check_attention_backend(model_config.attention_backend, device, dtype, head_dim)
    kv_dtype = check_kv_cache_dtype(cache_config.kv_cache_dtype, dtype, attention_backend)
    logger.info("attention backend: %s, KV cache in %s", attention_backend, kv_dtype)
    # Sliding-window layers in groups of their own (lmserve.kv_groups): then a block holds `slots` layers.
    groups = model_kv_groups(hf_config, hybrid=not cache_config.disable_hybrid_kv_cache_manager)
    model.kv_layer_groups = groups.layer_groups
    # Every rank holds as many blocks (one block table serves them all): size them for the largest stage.
    # (One stage: the model's own count, which for a hybrid model is its full-attention layers only.)
    largest_stage = model.num_layers if pp_size == 1 else len(stage_layers(hf_config.num_hidden_layers, pp_size, 0))
    layers_per_block = groups.slots if groups.is_hybrid else largest_stage
    per_block = kv_bytes_per_block(layers_per_block, num_kv_heads, head_dim, block_size,
                                   INT8_KV if kv_dtype == torch.int8 else kv_dtype.itemsize)
    state_slots = num_state_slots(cache_config, getattr(model, "state_bytes_per_slot", 0),
                                  scheduler_config.max_num_seqs, device)
    if state_slots and state_slots < scheduler_config.max_num_seqs:
        logger.warning("%d state slots of the linear-attention layers fit in half of the KV memory, fewer than "
                       "--max-num-seqs %d: requests past them wait for a slot (raise --kv-cache-memory for more)",
                       state_slots, scheduler_config.max_num_seqs)
    blocks_per_request = groups.request_blocks(max_model_len, block_size, scheduler_config.max_num_batched_tokens)
    num_blocks = num_kv_blocks(cache_config, per_block, device, lambda: measure_cuda_memory(
        device, lambda: profiling_step(
            model, scheduler_config.max_num_batched_tokens, max_model_len, scheduler_config.max_num_seqs,
            block_size, attention_backend, kv_dtype,
        ),
    ), most_blocks_usable=scheduler_config.max_num_seqs * blocks_per_request,
        reserved_bytes=state_slots * getattr(model, "state_bytes_per_slot", 0))
    k_shape, v_shape = kv_cache_shapes(attention_backend, num_blocks, num_kv_heads, block_size, head_dim, kv_dtype)
    tensors = [(zeroed_lazily(k_shape, kv_dtype, device), zeroed_lazily(v_shape, kv_dtype, device))
               for _ in range(layers_per_block if groups.is_hybrid else model.num_layers)]
    # Layer i's K/V: its slot's tensors at its group's block ids (hybrid), else its own tensors.
    caches = ([tensors[groups.layer_slots[i]] for i in model.stage_layers] if groups.is_hybrid else tensors)
    tokens = num_blocks * block_size
    logger.info(
        "KV cache: %d blocks of %d tokens (%.2f GiB, %d tokens); max concurrency at %d tokens per request: %.1f",
        num_blocks, block_size, num_blocks * per_block / 2**30, tokens, max_model_len, tokens / max_model_len,
    )
    return KVCacheSetup(attention_backend, kv_dtype, groups, num_blocks, caches, per_block, state_slots)
