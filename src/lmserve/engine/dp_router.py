"""Which data-parallel replica takes a request: the one that holds its prompt's prefix unless it is busier than the
least loaded by more than `load_slack` requests, else the least loaded.

Each replica has its own KV cache, so a prompt that shares a prefix with an earlier one only hits the prefix cache
on the replica that computed it. The router remembers, per block hash (the engine's own chained hash of a full
block, salt included), which replica last received a prompt with that block; it never asks the replicas, so a
block the replica has since evicted still attracts its followers, which then recompute it there (no worse than
anywhere else).

Load is what the front-end sent and has not seen end: requests running or waiting in each replica. A prefix is worth
a little load, not any: a chat template's default system prompt puts the same first blocks into every request, and
following the prefix alone sent every such request to one replica. As SGLang's cache-aware router does (with an
absolute threshold sized for GPU batches), a replica busier than the least loaded by more than the slack loses the
request to it, which then holds that prefix too.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from lmserve.engine.kv_cache import BlockHash, hash_block_tokens

# Block hashes remembered; at 16 positions a block, 1.6M prompt positions of distinct prefixes (~10 MB).
MAX_REMEMBERED_BLOCKS = 100_000
# Requests in flight that a prefix hit may cost over the least loaded replica: a few, since a CPU replica's batch is
# a handful of requests and one more of them slows every other.
LOAD_SLACK = 2


def prompt_block_hashes(
    token_ids: Sequence[int], block_size: int, cache_salt: str | None = None
) -> list[BlockHash]:
    """The chained hashes of the prompt's full blocks, as KVCacheManager computes them (the salt in the first)."""
    hashes: list[BlockHash] = []
    for i in range(len(token_ids) // block_size):
        extra = (cache_salt,) if i == 0 and cache_salt is not None else None
        hashes.append(hash_block_tokens(hashes[-1] if hashes else None,
                                        token_ids[i * block_size: (i + 1) * block_size], extra))
    return hashes


class DataParallelRouter:
    def __init__(
        self, num_replicas: int, block_size: int, enable_prefix_caching: bool = True,
        max_remembered_blocks: int = MAX_REMEMBERED_BLOCKS, load_slack: int = LOAD_SLACK,
    ) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        self.num_replicas = num_replicas
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.max_remembered_blocks = max_remembered_blocks
        self.load_slack = load_slack
        self.block_owner: OrderedDict[BlockHash, int] = OrderedDict()  # LRU order: oldest first
        self.owner: dict[str, int] = {}  # in-flight engine request id -> its replica
        self.in_flight = [0] * num_replicas
        # n>1 children share their prompt: the first child's replica takes the rest. parent id -> (replica, live).
        self.parents: dict[str, tuple[int, int]] = {}
        self.child_parent: dict[str, str] = {}

    def route(
        self, request_id: str, prompt_token_ids: Sequence[int], cache_salt: str | None = None,
        parent_id: str | None = None,
    ) -> int:
        """Picks the request's replica and counts it there until `release`."""
        if request_id in self.owner:
            return self.owner[request_id]  # a duplicate id: the replica that has it rejects it
        if parent_id is not None and parent_id in self.parents:
            replica, live = self.parents[parent_id]
            self.parents[parent_id] = (replica, live + 1)
        else:
            replica = self._choose(prompt_token_ids, cache_salt)
            if parent_id is not None:
                self.parents[parent_id] = (replica, 1)
        if parent_id is not None:
            self.child_parent[request_id] = parent_id
        self.owner[request_id] = replica
        self.in_flight[replica] += 1
        return replica

    def _choose(self, prompt_token_ids: Sequence[int], cache_salt: str | None) -> int:
        if not self.enable_prefix_caching:
            return self.least_loaded()
        hashes = prompt_block_hashes(prompt_token_ids, self.block_size, cache_salt)
        replica = self.longest_prefix_owner(hashes)
        least = self.least_loaded()
        if replica is None or self.in_flight[replica] - self.in_flight[least] > self.load_slack:
            replica = least
        self._remember(hashes, replica)
        return replica

    def longest_prefix_owner(self, hashes: Sequence[BlockHash]) -> int | None:
        """The replica that last received the longest of these prefixes. A chained hash stands for its whole
        prefix, so the deepest remembered block wins, whoever received its shallower blocks since."""
        for block_hash in reversed(hashes):
            replica = self.block_owner.get(block_hash)
            if replica is not None:
                return replica
        return None

    def least_loaded(self) -> int:
        """Fewest in flight; ties go to the lowest index, so an idle server fills replica 0 first."""
        return min(range(self.num_replicas), key=self.in_flight.__getitem__)

    def _remember(self, hashes: Sequence[BlockHash], replica: int) -> None:
        owners = self.block_owner
        for block_hash in hashes:
            owners[block_hash] = replica
            owners.move_to_end(block_hash)
        while len(owners) > self.max_remembered_blocks:
            owners.popitem(last=False)

    def replica_of(self, request_id: str) -> int | None:
        return self.owner.get(request_id)

    def by_replica(self, request_ids: Iterable[str]) -> dict[int, list[str]]:
        """The in-flight ones among the ids, grouped by replica (finished or unknown ids are dropped)."""
        groups: dict[int, list[str]] = {}
        for request_id in request_ids:
            replica = self.owner.get(request_id)
            if replica is not None:
                groups.setdefault(replica, []).append(request_id)
        return groups

    def release(self, request_ids: Iterable[str]) -> None:
        """The requests ended (finished, aborted, rejected); idempotent."""
        for request_id in request_ids:
            replica = self.owner.pop(request_id, None)
            if replica is None:
                continue
            self.in_flight[replica] -= 1
            parent_id = self.child_parent.pop(request_id, None)
            if parent_id is not None:
                parent_replica, live = self.parents[parent_id]
                if live > 1:
                    self.parents[parent_id] = (parent_replica, live - 1)
                else:
                    del self.parents[parent_id]
