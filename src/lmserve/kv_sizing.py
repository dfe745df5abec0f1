"""How many KV-cache blocks and bytes a number of positions takes: one formula for the engine and the planner."""

from __future__ import annotations


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold num_tokens positions."""
    return -(-num_tokens // block_size)


# An int8 KV cache (`--kv-cache-dtype int8`) stores each position's K (and V) row of a kv head as head_dim int8 values
# followed by one float16 scale per INT8_GROUP values: llama.cpp's q8_0 block, 34 bytes for 32 values.
INT8_KV = "int8"
INT8_GROUP = 32


def int8_kv_group(head_dim: int) -> int:
    """Values per scale in an int8 cache row: INT8_GROUP, or the whole row where head_dim is not a multiple of it."""
    return INT8_GROUP if head_dim % INT8_GROUP == 0 else head_dim


def kv_row_bytes(head_dim: int, dtype_bytes: int | str) -> int:
    """One position's K (or V) of one kv head: head_dim values of dtype_bytes each, or for INT8_KV head_dim bytes and
    a 2-byte scale per int8_kv_group(head_dim) values."""
    if dtype_bytes == INT8_KV:
        return head_dim + 2 * (head_dim // int8_kv_group(head_dim))
    assert isinstance(dtype_bytes, int), dtype_bytes
    return head_dim * dtype_bytes


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int | str) -> int:
    """K and V of one position for every layer: 2 × layers × kv_heads × the bytes of one head's row (kv_row_bytes:
    head_dim × dtype bytes, or an int8 cache's values and scales)."""
    return 2 * num_layers * num_kv_heads * kv_row_bytes(head_dim, dtype_bytes)


def kv_bytes_per_block(
    num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype_bytes: int | str
) -> int:
    """K and V for every layer of one block; the model runner sizes its cache with this."""
    return block_size * kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype_bytes)


def kv_blocks_for_memory_utilization(
    total_bytes: int, utilization: float, used_bytes: int, per_block_bytes: int, free_bytes: int | None = None
) -> int:
    """KV blocks under vLLM's --gpu-memory-utilization: the engine may use `utilization` of the device's
    `total_bytes`; the cache gets what is left of that after `used_bytes` (the weights and the peak activations of a
    profiling step). `free_bytes`, the device's free memory once the profiling step's memory is released, bounds it:
    memory that other processes (or this process outside torch) hold is not ours to promise."""
    budget = int(total_bytes * utilization) - used_bytes
    gib = 1 << 30
    if free_bytes is not None and budget > free_bytes:
        raise ValueError(
            f"--gpu-memory-utilization {utilization} leaves {budget / gib:.2f} GiB for the KV cache, but only "
            f"{free_bytes / gib:.2f} GiB of the device's {total_bytes / gib:.2f} GiB are free (other processes or the "
            "CUDA context hold the rest): lower --gpu-memory-utilization or set --kv-cache-memory"
        )
    blocks = max(budget, 0) // per_block_bytes
    if blocks < 1:
        raise ValueError(
            f"no KV-cache block fits: --gpu-memory-utilization {utilization} of {total_bytes / gib:.2f} GiB is "
            f"{total_bytes * utilization / gib:.2f} GiB, and the weights and peak activations take "
            f"{used_bytes / gib:.2f} GiB of it, leaving less than one block ({per_block_bytes} bytes): raise "
            "--gpu-memory-utilization or lower --max-num-batched-tokens"
        )
    return blocks
