"""The scheduler's side of prefill/decode disaggregation (lmserve.distributed.kv_storage has the storage, the
worker's kv_transfer.py the bytes).

A consumer, admitting a request, counts its local prefix-cache hit first, then pins the run of its prompt's next full
blocks that a producer stored; those blocks are allocated like computed ones, read in by the step before its forward
pass, and count as cached tokens (as vLLM counts external hits). The ranks read them in beside the forward passes of
other requests; the request waits (Request.kv_loading) until the driver rank reports its load done, as vLLM's
WAITING_FOR_REMOTE_KVS. The last prompt token is never loaded: its logits are needed. A producer names every full prompt block a step completes that no file holds yet; the worker writes them once
the forward pass has. Requests asking for prompt logprobs compute every position, as with the prefix cache.

Over PyNcclConnector the consumer's storage is its own buffer directory, which its ranks' links fill; the producer
has none (its ranks remember what they sent on the link now up).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path

from lmserve.distributed.kv_storage import SharedKVStorage, remove_orphans
from lmserve.engine.kv_cache import KVCacheManager
from lmserve.engine.request import Request
from lmserve.kv_transfer_config import KVTransferConfig


class KVTransferScheduling:
    def __init__(self, config: KVTransferConfig, world_size: int, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        if config.over_network and config.loads:  # buffers of consumers killed before their clean-up, beside ours
            remove_orphans(Path(config.shared_storage_path).parent)
        self.storage = (SharedKVStorage(config.shared_storage_path, world_size)
                        if config.loads or not config.over_network else None)
        self._saved: dict[str, int] = {}  # request id -> its prompt blocks already named for saving
        self.num_loaded_blocks = 0
        self.num_saved_blocks = 0

    def pin(self, request: Request, num_local_hit_blocks: int) -> list[str]:
        """Pins the stored blocks that follow the local hit (none for a producer-only instance)."""
        if not self.config.loads or request.num_prompt_logprobs_missing:
            return []
        hashes = self.kv.block_hashes(request)
        assert self.storage is not None
        return self.storage.pin(hashes[num_local_hit_blocks : (request.num_tokens - 1) // self.kv.block_size])

    def unpin(self, pinned: list[str]) -> None:
        if self.storage is not None:
            self.storage.unpin(pinned)

    def loads(self, request: Request, first_block: int, pinned: list[str]) -> list[tuple[str, int, str]]:
        """(request id, block id, pinned file) of the pinned blocks, now allocated after the local hit."""
        table = self.kv.block_ids(request.request_id)
        assert self.storage is not None
        self.num_loaded_blocks += len(pinned)
        return [(request.request_id, table[first_block + i], str(self.storage.pins / name))
                for i, name in enumerate(pinned)]

    def saves(self, requests: Iterable[Request]) -> list[tuple[int, str]]:
        """(block id, hash hex) of the prompt blocks this step completes that are not stored yet."""
        if not self.config.saves:
            return []
        out = []
        block_size = self.kv.block_size
        for request in requests:
            full = min(request.num_computed_tokens, request.num_prompt_tokens) // block_size
            done = self._saved.get(request.request_id, 0)
            if full <= done:
                continue
            hashes, table = self.kv.block_hashes(request), self.kv.block_ids(request.request_id)
            for i in range(done, full):
                if table[i] >= 0 and (self.storage is None or not self.storage.has(hashes[i])):
                    out.append((table[i], hashes[i].hex()))
            self._saved[request.request_id] = full
        self.num_saved_blocks += len(out)
        return out

    def drop(self, request_id: str) -> None:
        self._saved.pop(request_id, None)

    def close(self) -> None:
        if self.storage is not None:
            self.storage.close()
        if self.config.over_network and self.config.loads:  # the consumer's own buffer
            shutil.rmtree(self.config.shared_storage_path, ignore_errors=True)
