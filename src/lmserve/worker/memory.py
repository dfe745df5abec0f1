"""How many KV-cache blocks the model runner allocates, and on CUDA the measurement that decides it.

Precedence: `num_blocks` (tests' tiny pools) > an explicit `--kv-cache-memory` (every device) > on CUDA,
`--gpu-memory-utilization` of the device as vLLM sizes it > on CPU, DEFAULT_KV_CACHE_MEMORY or what
`--max-num-seqs` requests of `--max-model-len` positions can use, whichever is less. The arithmetic is
lmserve.kv_sizing's (torch-free, shared with the planner); only measure_cuda_memory touches torch.cuda.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lmserve.config import CacheConfig
from lmserve.config_values import parse_memory
from lmserve.kv_sizing import blocks_needed, kv_blocks_for_memory_utilization
from lmserve.worker.attention import ScheduledChunk, build_metadata, kv_cache_shapes
from lmserve.worker.models.llama import LlamaForCausalLM

# On CPU the KV cache takes this unless --kv-cache-memory says otherwise: RAM is shared with everything else on the
# machine, so the engine does not claim a fraction of it.
DEFAULT_KV_CACHE_MEMORY = "2GiB"


@dataclass(frozen=True)
class DeviceMemory:
    total_bytes: int  # the device's memory
    used_bytes: int  # the weights and the peak activations of the profiling step (torch's peak allocation)
    free_bytes: int  # free on the device once the profiling step's memory is released


def num_kv_blocks(
    cache_config: CacheConfig, per_block_bytes: int, device: torch.device, measure: Callable[[], DeviceMemory],
    most_blocks_usable: int | None = None, reserved_bytes: int = 0,
) -> int:
    """KV blocks to allocate; `measure` is called only on CUDA when no explicit size is set. `most_blocks_usable`:
    the blocks max_num_seqs full-length requests hold at once; the CPU default never allocates more.
    `reserved_bytes`: taken from the same budget first (a hybrid model's per-request state slots)."""
    if cache_config.num_blocks:
        return cache_config.num_blocks
    if cache_config.kv_cache_memory is None and device.type == "cuda":
        m = measure()
        return kv_blocks_for_memory_utilization(
            m.total_bytes, cache_config.gpu_memory_utilization, m.used_bytes + reserved_bytes, per_block_bytes,
            m.free_bytes - reserved_bytes,
        )
    budget = parse_memory(cache_config.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY)
    if reserved_bytes >= budget:
        raise ValueError(f"kv_cache_memory too small: the state slots of --max-num-seqs requests need "
                         f"{reserved_bytes} bytes of its {budget} (lower --max-num-seqs or raise --kv-cache-memory)")
    blocks = (budget - reserved_bytes) // per_block_bytes
    if cache_config.kv_cache_memory is None and most_blocks_usable:
        blocks = min(blocks, most_blocks_usable)
    if blocks < 1:
        raise ValueError(f"kv_cache_memory too small: one block needs {per_block_bytes} bytes")
    return blocks


def num_state_slots(cache_config: CacheConfig, bytes_per_slot: int, max_num_seqs: int, device: torch.device) -> int:
    """A hybrid model's per-request state slots: one per request that may run at once (--max-num-seqs), unless that
    would take more than half of a CPU's KV memory budget (Qwen3.5 at transformers' default shape: 50 MiB a slot, 64
    of them more than the default 2 GiB): then as many as half of it holds, at least one, and requests past them
    wait for a slot as for blocks. 0 for a model without such state."""
    if not bytes_per_slot:
        return 0
    if cache_config.num_blocks or (cache_config.kv_cache_memory is None and device.type == "cuda"):
        return max_num_seqs
    budget = parse_memory(cache_config.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY)
    return max(1, min(max_num_seqs, budget // 2 // bytes_per_slot))


def profiling_batch_lengths(num_tokens: int, max_model_len: int) -> list[int]:
    """The largest step the scheduler can hand out: num_tokens positions as first prefill chunks of at most
    max_model_len positions each (one request cannot be longer)."""
    full, rest = divmod(num_tokens, max_model_len)
    return [max_model_len] * full + ([rest] if rest else [])


@torch.inference_mode()
def profiling_step(
    model: LlamaForCausalLM,
    num_tokens: int,
    max_model_len: int,
    num_sampled: int,
    block_size: int,
    attention_backend: str,
    kv_cache_dtype: torch.dtype,
) -> torch.Tensor:
    """One forward pass over a dummy batch of num_tokens positions, with its own small KV cache (just the batch's
    blocks: the real cache is sized from this step's peak, so it cannot exist yet), then the logits and softmax of
    num_sampled rows (the sampler's vocabulary-wide work). Returns the probabilities, or on a pipeline stage before the
    last the hidden states it would send on (a later stage starts from zeros as its received input)."""
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    lengths = profiling_batch_lengths(num_tokens, max_model_len)
    chunks, next_block = [], 0
    for n in lengths:
        count = blocks_needed(n, block_size)
        chunks.append(ScheduledChunk(0, n, list(range(next_block, next_block + count))))
        next_block += count
    num_kv_heads, head_dim = model.kv_shape
    k_shape, v_shape = kv_cache_shapes(attention_backend, next_block, num_kv_heads, block_size, head_dim, kv_cache_dtype)
    kv_caches = [
        (torch.zeros(k_shape, dtype=kv_cache_dtype, device=device), torch.zeros(v_shape, dtype=kv_cache_dtype, device=device))
        for _ in range(model.num_layers)
    ]
    input_ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])
    metadata = build_metadata(chunks, block_size, attention_backend, device, dtype)
    layout = model.parallel.layout
    # A later pipeline stage starts from the previous stage's hidden states and residual, which it receives.
    intermediate = None
    if not layout.is_first_stage:
        zeros = torch.zeros(num_tokens, model.config.hidden_size, dtype=dtype, device=device)
        intermediate = (zeros, zeros.clone())
    hidden = model(input_ids, positions, kv_caches, metadata, intermediate)
    if not layout.is_last_stage:
        return hidden[0]  # no logits on this stage: what it sends on is its peak
    rows = torch.arange(num_tokens - min(num_sampled, num_tokens), num_tokens, device=device)
    return model.compute_logits(hidden[rows]).softmax(dim=-1)


def measure_cuda_memory(device: torch.device, run_profiling_step: Callable[[], object]) -> DeviceMemory:
    """The device's memory, and this engine's peak use (weights + one profiling step) by torch's own count."""
    torch.cuda.synchronize(device)
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    run_profiling_step()
    torch.cuda.synchronize(device)
    used = torch.cuda.max_memory_allocated(device)
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(total_bytes=total, used_bytes=used, free_bytes=free)
