"""Paged KV cache bookkeeping: a pool of fixed-size blocks with reference counts and a prefix cache.

Only block ids live here; the tensors they index belong to the model runner.

Prefix caching: every full block of a request gets a chained hash of (parent block hash, its token ids, extra keys
such as the cache salt). A cached block keeps that whole key, and a lookup compares the key on a hit, so a collision
of the block's own hash can never hand out KV computed for other tokens.

Free blocks (reference count 0) wait in one queue that is also the eviction order: uncached blocks at the head (reused
first), freed cached blocks at the tail, where they stay hittable until they reach the head and are handed out again.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from lmserve.engine.request import Request
from lmserve.kv_sizing import blocks_needed

BlockHash = bytes
# (parent hash, the block's token ids, extra keys): what a hit must match exactly, not just the hash of it.
CacheKey = tuple[BlockHash | None, tuple[int, ...], tuple[object, ...] | None]

_ROOT = b"\0" * 32


def hash_block_tokens(
    parent_hash: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple[object, ...] | None = None
) -> BlockHash:
    """SHA-256 over a length-prefixed encoding, so the same prefix hashes the same in every process and run."""
    h = hashlib.sha256(parent_hash or _ROOT)
    h.update(len(token_ids).to_bytes(4, "little"))
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None  # set while the block is in the prefix cache
    cache_key: CacheKey | None = None

    def reset_hash(self) -> None:
        self.block_hash = None
        self.cache_key = None


class BlockPool:
    """The blocks, their free queue (LRU eviction order) and the hash → cached block map."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got num_blocks={num_blocks}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.enable_caching = enable_caching
        # Head = next block handed out; OrderedDict gives O(1) removal of a hit block from the middle.
        self.free_queue: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[BlockHash, Block] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def get_cached_block(self, block_hash: BlockHash, key: CacheKey) -> Block | None:
        block = self.cached.get(block_hash)
        return block if block is not None and block.cache_key == key else None

    def cache_block(self, block: Block, block_hash: BlockHash, key: CacheKey) -> None:
        # The first block cached under a hash stays the one hits return; a duplicate (the same prefix computed by
        # two requests at once) stays uncached and is reused first once freed.
        if not self.enable_caching or block.block_hash is not None or block_hash in self.cached:
            return
        block.block_hash, block.cache_key = block_hash, key
        self.cached[block_hash] = block

    def uncache(self, block: Block) -> None:
        if block.block_hash is not None and self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.reset_hash()

    def get_new_blocks(self, n: int) -> list[Block]:
        if n > len(self.free_queue):
            raise ValueError(f"cannot allocate {n} blocks: only {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            self.uncache(block)  # handed out again: its old contents are about to be overwritten
            block.ref_count = 1
            out.append(block)
        return out

    def touch(self, blocks: Sequence[Block]) -> None:
        """Takes a reference on prefix-cache hits, pulling free ones out of the free queue."""
        for block in blocks:
            if block.ref_count == 0:
                del self.free_queue[block.block_id]
            block.ref_count += 1

    def free_blocks(self, blocks: Sequence[Block]) -> None:
        """Drops one reference per block, in the given order (callers pass tail first)."""
        for block in blocks:
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block.block_id} freed more often than taken"
            if block.ref_count == 0:
                self.free_queue[block.block_id] = block
                if block.block_hash is None:
                    self.free_queue.move_to_end(block.block_id, last=False)

    def reset_prefix_cache(self) -> bool:
        if len(self.free_queue) != len(self.blocks):
            return False  # blocks in use: their hashes may still be needed by the requests holding them
        for block in self.cached.values():
            block.reset_hash()
        self.cached.clear()
        return True


class KVCacheManager:
    """Block tables per request on top of a BlockPool, plus prefix-cache lookups and statistics."""

    def __init__(
        self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True,
        key_generated_blocks: bool = False,
    ) -> None:
        """key_generated_blocks: the model computes prompt tokens and generated ones with different arithmetic
        (`--batched-weights prompt-bf16`), so a block holding generated tokens is keyed by where the prompt ends in it.
        A later request whose prompt repeats those tokens (a chat's next turn) computes them as prompt tokens, and must
        not take K/V that differ from what it would compute itself: a hit then would change its tokens."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.key_generated_blocks = key_generated_blocks
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.tables: dict[str, list[Block]] = {}
        # Chained hashes of each request's full blocks: they depend only on its tokens, which never change once
        # known, so they are computed once per request.
        self._hashes: dict[str, list[BlockHash]] = {}
        # How many leading blocks of a table have been offered to the prefix cache.
        self._num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    # ---- queries -------------------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.pool.num_free_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        return sum(1 for b in self.pool.free_queue.values() if b.block_hash is not None)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.tables.get(request_id, ())]

    def ref_counts(self) -> list[int]:
        return [b.ref_count for b in self.pool.blocks]

    # ---- prefix cache --------------------------------------------------------------------------------------

    def _block_hashes(self, request: Request, all_tokens: list[int]) -> list[BlockHash]:
        hashes = self._hashes.setdefault(request.request_id, [])
        bs = self.block_size
        for i in range(len(hashes), len(all_tokens) // bs):
            hashes.append(
                hash_block_tokens(
                    hashes[-1] if hashes else None,
                    all_tokens[i * bs : (i + 1) * bs],
                    self._extra_keys(request, i),
                )
            )
        return hashes

    def _cache_key(
        self, request: Request, hashes: list[BlockHash], all_tokens: list[int], i: int
    ) -> CacheKey:
        bs = self.block_size
        return (
            hashes[i - 1] if i else None,
            tuple(all_tokens[i * bs : (i + 1) * bs]),
            self._extra_keys(request, i),
        )

    def _extra_keys(self, request: Request, block_index: int) -> tuple[object, ...] | None:
        # Only the first block carries the salt; the chain carries it on to every later block.
        keys: tuple[object, ...] = ()
        if block_index == 0 and request.cache_salt is not None:
            keys = (request.cache_salt,)
        prompt_tokens_in_block = request.num_prompt_tokens - block_index * self.block_size
        if self.key_generated_blocks and 0 <= prompt_tokens_in_block < self.block_size:
            # The first block with a generated token; the chain carries the mark on to every later block.
            keys += (("prompt tokens", prompt_tokens_in_block),)
        return keys or None

    def get_computed_blocks(self, request: Request, record_stats: bool = True) -> tuple[list[int], int]:
        """The longest run of cached full blocks that prefixes the request's tokens: (block ids, tokens).

        Takes no references. The last known token is never a hit, because the next step needs its logits. With
        record_stats the lookup counts towards prefix_cache_queries/hits (in tokens); the scheduler passes False
        while a request waits for room and records once on admission, so a blocked request is not counted per step.
        """
        # A request that still needs prompt logprobs must compute every position (as vLLM): no hits for it.
        if not self.enable_prefix_caching or request.num_prompt_logprobs_missing:
            return [], 0
        all_tokens = request.all_token_ids
        hashes = self._block_hashes(request, all_tokens)
        hits: list[int] = []
        for i in range((request.num_tokens - 1) // self.block_size):
            block = self.pool.get_cached_block(hashes[i], self._cache_key(request, hashes, all_tokens, i))
            if block is None:
                break
            hits.append(block.block_id)
        num_hit_tokens = len(hits) * self.block_size
        if record_stats:
            self.record_prefix_lookup(request.num_tokens, num_hit_tokens)
        return hits, num_hit_tokens

    def record_prefix_lookup(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        if self.enable_prefix_caching:
            self.prefix_cache_queries += num_queried_tokens
            self.prefix_cache_hits += num_hit_tokens

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block; refused (False) while any block is in use."""
        return self.pool.reset_prefix_cache()

    # ---- allocation ----------------------------------------------------------------------------------------

    def _blocks_to_take(
        self, request: Request, num_total_tokens: int, new_computed_blocks: Sequence[int]
    ) -> int:
        """Free-queue blocks an allocation would consume: new blocks plus hits that sit in the free queue."""
        have = len(self.tables.get(request.request_id, ())) + len(new_computed_blocks)
        num_new = max(0, blocks_needed(num_total_tokens, self.block_size) - have)
        num_free_hits = sum(1 for b in new_computed_blocks if self.pool.blocks[b].ref_count == 0)
        return num_new + num_free_hits

    def can_fit(
        self, request: Request, num_total_tokens: int, new_computed_blocks: Sequence[int] = (), reserved: int = 0,
    ) -> bool:
        """Whether the request could hold num_total_tokens positions now, counting the given hits as its own and
        leaving `reserved` free blocks untouched (those promised to other requests)."""
        needed = self._blocks_to_take(request, num_total_tokens, new_computed_blocks)
        return needed <= self.num_free_blocks - reserved

    def num_blocks_to_finish(self, request: Request) -> int:
        """Blocks the request still needs to hold all of its known tokens."""
        have = len(self.tables.get(request.request_id, ()))
        return max(0, blocks_needed(request.num_tokens, self.block_size) - have)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[int] = (),
        num_new_computed_tokens: int = 0,
    ) -> bool:
        """Grows the request's table to hold num_computed + num_new_computed + num_new_tokens positions.

        Returns False and changes nothing when the free queue is too short. Blocks that this makes full are put in
        the prefix cache at once, before the step that writes their K/V runs (as in vLLM V1): a request admitted
        later in the same step may hit them, which is correct because a forward pass writes a layer's new K/V before
        any request of the batch attends over it.
        """
        assert num_new_computed_tokens == len(new_computed_blocks) * self.block_size
        num_total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        if not self.can_fit(request, num_total, new_computed_blocks):
            return False
        rid = request.request_id
        table = self.tables.setdefault(rid, [])
        hits = [self.pool.blocks[b] for b in new_computed_blocks]
        self.pool.touch(hits)
        table.extend(hits)
        table.extend(self.pool.get_new_blocks(max(0, blocks_needed(num_total, self.block_size) - len(table))))

        if self.enable_prefix_caching:
            num_full = min(num_total, request.num_tokens) // self.block_size
            start = self._num_cached_blocks.get(rid, 0)
            if num_full > start:
                all_tokens = request.all_token_ids
                hashes = self._block_hashes(request, all_tokens)
                for i in range(start, num_full):
                    if table[i].block_hash != hashes[i]:
                        self.pool.cache_block(
                            table[i], hashes[i], self._cache_key(request, hashes, all_tokens, i)
                        )
                self._num_cached_blocks[rid] = num_full
        return True

    def free(self, request: Request) -> None:
        """Releases the request's blocks, tail first so that its prefix outlives its suffix. Idempotent.

        A cached block whose K/V the request had not computed (num_computed_tokens was rolled back because the
        scheduler took back a step it had just planned) leaves the prefix cache, so no one can hit unwritten KV.
        """
        rid = request.request_id
        table = self.tables.pop(rid, None)
        self._hashes.pop(rid, None)
        self._num_cached_blocks.pop(rid, None)
        if table is None:
            return
        num_computed_blocks = request.num_computed_tokens // self.block_size
        for i in range(num_computed_blocks, len(table)):
            if table[i].ref_count == 1:
                self.pool.uncache(table[i])
        self.pool.free_blocks(table[::-1])
