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
import heapq
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from lmserve.config import KV_BLOCK_SIZE
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


@dataclass(eq=False, slots=True)  # one per KV block (43,690 for a 2 GiB pool of Gemma 3 270M): no __dict__ each
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


# What a block table holds where a sliding-window group gave a block back (or never needed it): the kernels skip
# blocks before a window, and the sdpa path masks them, so any valid id does.
NULL_BLOCK_ID = 0


class StateSlots:
    """A hybrid model's per-request state slots (the worker holds each slot's tensors: the linear layers' conv and
    recurrent states, worker/models/gated_deltanet.py's LinearStates). A request takes one when it is admitted,
    beside its first blocks, and holds it until it finishes, is aborted or is preempted (a preempted request
    recomputes its state from position 0 when it runs again). Lowest free slot first, so a run's slots do not
    depend on which were freed when."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots))
        heapq.heapify(self._free)
        self.owners: dict[str, int] = {}  # request id -> its slot

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_hold(self, request_id: str) -> bool:
        return request_id in self.owners or bool(self._free)

    def take(self, request_id: str) -> int:
        if request_id not in self.owners:
            self.owners[request_id] = heapq.heappop(self._free)
        return self.owners[request_id]

    def release(self, request_id: str) -> None:
        slot = self.owners.pop(request_id, None)
        if slot is not None:
            heapq.heappush(self._free, slot)


class KVCacheManager:
    """Block tables per request on top of a BlockPool, plus prefix-cache lookups and statistics.

    With sliding-window layers in their own groups (lmserve.kv_groups), a request has one table per group; a sliding
    group's table gives back the blocks that fell out of its window as the request advances. Group 0 is always a
    full-attention group unless every layer slides (then it is the one, windowed, group)."""

    def __init__(
        self, num_blocks: int, block_size: int = KV_BLOCK_SIZE, enable_prefix_caching: bool = True,
        key_generated_blocks: bool = False, windows: Sequence[int] = (0,), max_chunk_tokens: int | None = None,
        num_state_slots: int = 0,
    ) -> None:
        """key_generated_blocks: the model computes prompt tokens and generated ones with different arithmetic
        (`--batched-weights prompt-bf16`), so a block holding generated tokens is keyed by where the prompt ends in it.
        A later request whose prompt repeats those tokens (a chat's next turn) computes them as prompt tokens, and must
        not take K/V that differ from what it would compute itself: a hit then would change its tokens.
        windows: per KV-cache group, 0 (full attention) or its sliding window. max_chunk_tokens: the most positions
        a step computes for one request (the scheduler's token budget), which bounds what a sliding group holds.
        num_state_slots: a hybrid model's state slots (StateSlots), 0 for none: then a request needs a free slot as
        well as free blocks to be allocated anything."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.key_generated_blocks = key_generated_blocks
        self.windows = tuple(windows) or (0,)
        self.max_chunk_tokens = max_chunk_tokens
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.state_slots = StateSlots(num_state_slots) if num_state_slots else None
        # Per request, per group: block i holds positions [i * block_size, (i + 1) * block_size); None where a
        # sliding group holds nothing (out of its window).
        self.tables: dict[str, list[list[Block | None]]] = {}
        # Chained hashes of each request's full blocks: they depend only on its tokens, which never change once
        # known, so they are computed once per request.
        self._hashes: dict[str, list[BlockHash]] = {}
        # Per request and group, how many leading blocks of its table have been offered to the prefix cache.
        self._num_cached_blocks: dict[str, list[int]] = {}
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def _first_needed(self, group: int, position: int) -> int:
        """The first block a group needs for computing from `position` on: 0 for full attention; for a sliding
        window, the block of the earliest key the query at `position` sees, (position - window, position]."""
        window = self.windows[group]
        return max(0, position - window + 1) // self.block_size if window else 0

    def _held_cap(self, group: int) -> int | None:
        """The most blocks a sliding group holds for one request at once: a window and a step's chunk."""
        window = self.windows[group]
        if not window or self.max_chunk_tokens is None:
            return None
        return blocks_needed(window + self.max_chunk_tokens, self.block_size) + 1

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

    def block_ids(self, request_id: str, group: int = 0) -> list[int]:
        """One group's block table (NULL_BLOCK_ID where a sliding group holds nothing)."""
        tables = self.tables.get(request_id)
        if tables is None:
            return []
        return [NULL_BLOCK_ID if b is None else b.block_id for b in tables[group]]

    def state_slot(self, request_id: str) -> int:
        """The request's state slot (-1: the model keeps no per-request state)."""
        return -1 if self.state_slots is None else self.state_slots.owners.get(request_id, -1)

    def group_block_ids(self, request_id: str) -> list[list[int]]:
        """Every group's block table, group 0's first."""
        return [self.block_ids(request_id, g) for g in range(self.num_groups)]

    def ref_counts(self) -> list[int]:
        return [b.ref_count for b in self.pool.blocks]

    # ---- prefix cache --------------------------------------------------------------------------------------

    def block_hashes(self, request: Request) -> list[BlockHash]:
        """The prefix-cache hashes of the request's full blocks (the same prefix hashes alike in every process)."""
        return self._block_hashes(request, request.all_token_ids)

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
        # Every other group must hold the hit's blocks too: all of them for full attention, the window before the
        # hit's end for a sliding group. The longest hit they all have.
        while hits and self._group_hits(request, len(hits)) is None:
            hits.pop()
        num_hit_tokens = len(hits) * self.block_size
        if record_stats:
            self.record_prefix_lookup(request.num_tokens, num_hit_tokens)
        return hits, num_hit_tokens

    def _group_key(self, group: int, block_hash: BlockHash, key: CacheKey) -> tuple[BlockHash, CacheKey]:
        """A block's prefix-cache hash and key in its group: group 0's own, the others' told apart by the group."""
        if group == 0:
            return block_hash, key
        return block_hash + group.to_bytes(2, "little"), (key[0], key[1], (key[2], ("kv group", group)))

    def _group_hits(self, request: Request, num_blocks: int) -> list[list[Block | None]] | None:
        """Groups 1..: their cached blocks for a hit of num_blocks blocks (None where a sliding group needs none);
        None if one of them is missing."""
        all_tokens = request.all_token_ids
        hashes = self._block_hashes(request, all_tokens)
        out: list[list[Block | None]] = []
        for group in range(1, self.num_groups):
            first = self._first_needed(group, num_blocks * self.block_size)
            blocks: list[Block | None] = [None] * first
            for i in range(first, num_blocks):
                block = self.pool.get_cached_block(
                    *self._group_key(group, hashes[i], self._cache_key(request, hashes, all_tokens, i))
                )
                if block is None:
                    return None
                blocks.append(block)
            out.append(blocks)
        return out

    def record_prefix_lookup(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        if self.enable_prefix_caching:
            self.prefix_cache_queries += num_queried_tokens
            self.prefix_cache_hits += num_hit_tokens

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block; refused (False) while any block is in use."""
        return self.pool.reset_prefix_cache()

    # ---- allocation ----------------------------------------------------------------------------------------

    def _new_blocks(self, group: int, table_len: int, num_hits: int, position: int, num_total_tokens: int) -> int:
        """Blocks a group takes from the pool to hold positions up to num_total_tokens, computing from `position`:
        a table of table_len blocks, then num_hits hit blocks; a sliding group skips blocks before its window."""
        first = max(table_len + num_hits, self._first_needed(group, position))
        return max(0, blocks_needed(num_total_tokens, self.block_size) - first)

    def _blocks_to_take(
        self, request: Request, num_total_tokens: int, new_computed_blocks: Sequence[int]
    ) -> int:
        """Free-queue blocks an allocation would consume: new blocks plus hits that sit in the free queue."""
        tables = self.tables.get(request.request_id)
        num_hits = len(new_computed_blocks)
        position = request.num_computed_tokens + num_hits * self.block_size
        hit_blocks = [[self.pool.blocks[b] for b in new_computed_blocks]]
        if num_hits and self.num_groups > 1:
            hit_blocks += self._group_hits(request, num_hits) or []
        needed = 0
        for group in range(self.num_groups):
            table_len = len(tables[group]) if tables else 0
            new = self._new_blocks(group, table_len, num_hits, position, num_total_tokens)
            cap = self._held_cap(group)
            if cap is not None:  # a long prompt's earlier chunks give their blocks back before later ones need more
                new = min(new, cap)
            hits = hit_blocks[group] if group < len(hit_blocks) else []
            needed += new + sum(1 for b in hits if b is not None and b.ref_count == 0)
        return needed

    def can_fit(
        self, request: Request, num_total_tokens: int, new_computed_blocks: Sequence[int] = (), reserved: int = 0,
    ) -> bool:
        """Whether the request could hold num_total_tokens positions now, counting the given hits as its own and
        leaving `reserved` free blocks untouched (those promised to other requests)."""
        if self.state_slots is not None and not self.state_slots.can_hold(request.request_id):
            return False  # no state slot free: it waits as for blocks
        needed = self._blocks_to_take(request, num_total_tokens, new_computed_blocks)
        return needed <= self.num_free_blocks - reserved

    def num_blocks_to_finish(self, request: Request) -> int:
        """Blocks the request still needs to hold all of its known tokens."""
        return self._blocks_to_take(request, request.num_tokens, ())

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[int] = (),
        num_new_computed_tokens: int = 0,
    ) -> bool:
        """Grows the request's tables to hold num_computed + num_new_computed + num_new_tokens positions, and gives
        back what sliding groups no longer need (blocks wholly before the window of this step's first position).

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
        if self.state_slots is not None:
            self.state_slots.take(rid)
        tables = self.tables.setdefault(rid, [[] for _ in self.windows])
        position = request.num_computed_tokens + num_new_computed_tokens  # this step's first position
        hits: list[list[Block | None]] = [[self.pool.blocks[b] for b in new_computed_blocks]]
        if new_computed_blocks and self.num_groups > 1:
            hits += self._group_hits(request, len(new_computed_blocks)) or []
        for group, table in enumerate(tables):
            if new_computed_blocks:
                group_hits = hits[group]
                self.pool.touch([b for b in group_hits if b is not None])
                table.extend(group_hits)
            first = self._first_needed(group, position)
            if len(table) < first:
                table.extend([None] * (first - len(table)))
            table.extend(self.pool.get_new_blocks(max(0, blocks_needed(num_total, self.block_size) - len(table))))
            # Out of the window for this step and every later one: back to the pool (cached blocks stay hittable).
            dropped = [b for b in table[:first] if b is not None]
            if dropped:
                table[:first] = [None] * first
                self.pool.free_blocks(dropped[::-1])

        if self.enable_prefix_caching:
            num_full = min(num_total, request.num_tokens) // self.block_size
            cached = self._num_cached_blocks.setdefault(rid, [0] * self.num_groups)
            if num_full > min(cached):
                all_tokens = request.all_token_ids
                hashes = self._block_hashes(request, all_tokens)
                for group, table in enumerate(tables):
                    for i in range(cached[group], num_full):
                        block = table[i]
                        if block is None:
                            continue
                        block_hash, key = self._group_key(
                            group, hashes[i], self._cache_key(request, hashes, all_tokens, i)
                        )
                        if block.block_hash != block_hash:
                            self.pool.cache_block(block, block_hash, key)
                    cached[group] = max(cached[group], num_full)
        return True

    def uncache_from(self, request: Request, first_block: int) -> None:
        """Takes the request's blocks from `first_block` on out of the prefix cache (blocks being loaded from a
        producer: nobody may hit them before their bytes are in, and a failed load leaves them holding nothing).
        The request's next allocate_slots caches them again, once its step is about to write them."""
        for table in self.tables.get(request.request_id, ()):
            for block in table[first_block:]:
                if block is not None:
                    self.pool.uncache(block)
        cached = self._num_cached_blocks.get(request.request_id)
        if cached is not None:
            cached[:] = [min(count, first_block) for count in cached]

    def free_beyond(self, request: Request, num_tokens: int) -> None:
        """Gives back the blocks of the request's tables past the first num_tokens positions (drafts a step
        rejected). They hold no known token, so none of them is in the prefix cache."""
        keep = blocks_needed(num_tokens, self.block_size)
        for table in self.tables.get(request.request_id, ()):
            surplus = [b for b in table[keep:] if b is not None]
            del table[keep:]
            if surplus:
                self.pool.free_blocks(surplus[::-1])

    def free(self, request: Request) -> None:
        """Releases the request's blocks, tail first so that its prefix outlives its suffix. Idempotent.

        A cached block whose K/V the request had not computed (num_computed_tokens was rolled back because the
        scheduler took back a step it had just planned) leaves the prefix cache, so no one can hit unwritten KV.
        """
        rid = request.request_id
        if self.state_slots is not None:
            self.state_slots.release(rid)
        tables = self.tables.pop(rid, None)
        self._hashes.pop(rid, None)
        self._num_cached_blocks.pop(rid, None)
        if tables is None:
            return
        num_computed_blocks = request.num_computed_tokens // self.block_size
        for table in tables:
            for block in table[num_computed_blocks:]:
                if block is not None and block.ref_count == 1:
                    self.pool.uncache(block)
            self.pool.free_blocks([b for b in table[::-1] if b is not None])
