"""How many KV-cache blocks and bytes a number of positions takes: one formula for the engine and the planner."""

from __future__ import annotations


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold num_tokens positions."""
    return -(-num_tokens // block_size)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """K and V of one position for every layer: 2 × layers × kv_heads × head_dim × dtype bytes."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def kv_bytes_per_block(
    num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype_bytes: int
) -> int:
    """K and V for every layer of one block; the model runner sizes its cache with this."""
    return block_size * kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype_bytes)
