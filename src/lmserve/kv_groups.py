"""Which layers share a KV-cache block, so that a sliding-window layer holds only its window (torch-free: the engine,
the worker and the planner all read it).

Without sliding windows every block holds one position range of every layer, and a request's one block table serves
them all. With them (Gemma 2/3, Mistral 7B v0.1, Phi-3-mini-4k), the layers are cut into groups of `slots` layers
each, all of one kind: a block belongs to one group and holds its `slots` layers; each group has its own block table
per request; a sliding group's table gives back the blocks that fell out of the window (vLLM's hybrid KV cache
manager). The KV tensors are `slots` pairs, and layer i's K/V lives in tensor `layer_slots[i]` at the block ids of
its group's table. Gemma 3 (5 sliding layers to 1 full) then holds the context of 1 layer in 6 plus 5 windows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lmserve.config import model_layer_types
from lmserve.kv_sizing import blocks_needed

SLIDING = "sliding_attention"


@dataclass(frozen=True)
class KVCacheGroups:
    windows: tuple[int, ...]  # per group: 0 for full attention, else its sliding window in positions
    layer_groups: tuple[int, ...]  # per layer: the group whose block table it reads
    layer_slots: tuple[int, ...]  # per layer: which of the `slots` KV tensors holds it
    slots: int  # KV tensors, i.e. layers a block holds

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def is_hybrid(self) -> bool:
        """Whether blocks are shared by slot rather than one block per position range of every layer."""
        return self.slots != len(self.layer_slots)

    def held_blocks(self, group: int, num_tokens: int, block_size: int, max_chunk_tokens: int) -> int:
        """The most blocks a request of num_tokens positions holds at once in `group`, prefilled in chunks of at
        most max_chunk_tokens: all of them for full attention; a window and a chunk for a sliding group."""
        total = blocks_needed(num_tokens, block_size)
        window = self.windows[group]
        if not window:
            return total
        return min(total, blocks_needed(window + max_chunk_tokens, block_size) + 1)

    def request_blocks(self, num_tokens: int, block_size: int, max_chunk_tokens: int) -> int:
        """Blocks of the pool a request of num_tokens positions holds at most, over all groups."""
        return sum(self.held_blocks(g, num_tokens, block_size, max_chunk_tokens) for g in range(self.num_groups))


def model_kv_groups(config: Any, hybrid: bool = True) -> KVCacheGroups:
    """The KV-cache groups of a model config (transformers' or a GGUFConfig)."""
    return kv_cache_groups(model_layer_types(config), getattr(config, "sliding_window", None), hybrid)


def kv_cache_groups(layer_types: Sequence[str], sliding_window: int | None, hybrid: bool = True) -> KVCacheGroups:
    """The grouping of a model's layers. `hybrid` False (--disable-hybrid-kv-cache-manager, vLLM's flag) keeps one
    block table for every layer: windows still hide keys, but blocks out of every window stay held."""
    n = len(layer_types)
    identity = tuple(range(n))
    sliding = [i for i, kind in enumerate(layer_types) if kind == SLIDING]
    if not hybrid or not sliding or not sliding_window:
        return KVCacheGroups((0,), (0,) * n, identity, n)
    if len(sliding) == n:  # every layer slides: one table, which drops what falls out of the window
        return KVCacheGroups((sliding_window,), (0,) * n, identity, n)
    full = [i for i in range(n) if i not in set(sliding)]
    slots = min(len(full), len(sliding))
    windows: list[int] = []
    layer_groups, layer_slots = [0] * n, [0] * n
    for layers, window in ((full, 0), (sliding, sliding_window)):
        for start in range(0, len(layers), slots):
            for slot, layer in enumerate(layers[start : start + slots]):
                layer_groups[layer], layer_slots[layer] = len(windows), slot
            windows.append(window)
    return KVCacheGroups(tuple(windows), tuple(layer_groups), tuple(layer_slots), slots)


def kv_capacity_tokens(
    num_blocks: int, block_size: int, max_model_len: int, groups: KVCacheGroups | None, max_chunk_tokens: int
) -> int:
    """The longest request a pool of num_blocks holds alone (a longer one could never run): every block for one
    table; with sliding groups, what their windows leave to the full-attention groups."""
    if groups is None or groups.num_groups == 1 and not groups.windows[0]:
        return num_blocks * block_size
    low, high = 0, max_model_len  # the largest length whose blocks fit
    while low < high:
        mid = (low + high + 1) // 2
        if groups.request_blocks(mid, block_size, max_chunk_tokens) <= num_blocks:
            low = mid
        else:
            high = mid - 1
    return low
