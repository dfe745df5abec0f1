"""The scheduler's side of prefill/decode disaggregation (lmserve.distributed.kv_storage has the storage, the
worker's kv_transfer.py the bytes).

A consumer, admitting a request, counts its local prefix-cache hit first, then pins the run of its prompt's next full
blocks that a producer stored; those blocks are allocated like computed ones, read in by the step before its forward
pass, and count as cached tokens (as vLLM counts external hits). The ranks read them in beside the forward passes of
other requests; the request waits (Request.kv_loading) until the driver rank reports its load done, as vLLM's
WAITING_FOR_REMOTE_KVS. The last prompt token is never loaded: its logits are needed. A producer names every full
prompt block a step completes that no file holds yet; the worker writes them once the forward pass has. Requests
asking for prompt logprobs compute every position, as with the prefix cache.

KVConnectorScheduler is the interface (vLLM V1's scheduler role), with one subclass per connector; a connector of the
user's comes from kv_connector_module_path.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Iterable
from pathlib import Path

from lmserve.config import EngineConfig
from lmserve.distributed.kv_storage import SharedKVStorage, model_fingerprint, remove_orphans
from lmserve.engine.kv_cache import KVCacheManager
from lmserve.engine.request import Request
from lmserve.kv_transfer_config import KVTransferConfig, plugged_connector
from lmserve.models import resolve_model


def keyed_to_model(config: EngineConfig) -> EngineConfig:
    """The configuration with its kv_transfer_config keyed to the model's files (model_key), so that the scheduler
    and every rank file and find blocks under this model's own directory: two models never read each other's."""
    transfer = config.cache.kv_transfer_config
    if transfer is None or transfer.model_key:
        return config
    keyed = dataclasses.replace(transfer, model_key=model_fingerprint(resolve_model(config.model.model).path))
    return dataclasses.replace(config, cache=dataclasses.replace(config.cache, kv_transfer_config=keyed))


class KVConnectorScheduler:
    """A connector's scheduler side (vLLM V1's KVConnectorBase_V1 in its scheduler role), one per engine. The
    scheduler asks it, admitting a request, for the stored blocks after its local prefix-cache hit (`pin`: handles
    that keep them until loaded, in block order), hands the pinned handles with their new block ids to the worker
    side (`loads`), and each step names the prompt blocks the step completes for the worker side to save (`saves`).
    This base class keeps the bookkeeping every connector shares; a connector says what is stored (`pin_stored`,
    `stored`) and releases what it held (`unpin`, `close`). Without storage it loads nothing and saves every block."""

    def __init__(self, config: KVTransferConfig, world_size: int, kv: KVCacheManager) -> None:
        self.config = config
        self.world_size = world_size
        self.kv = kv
        self._saved: dict[str, int] = {}  # request id -> its prompt blocks already named for saving
        self.num_loaded_blocks = 0
        self.num_saved_blocks = 0
        self.num_failed_loads = 0  # requests whose stored blocks could not be read: they computed them
        self.num_failed_saves = 0  # blocks the driver rank could not store (a full or failing disk)
        self._loading: dict[str, int] = {}  # request id -> blocks of its load in flight

    def pin_stored(self, block_hashes: list[bytes]) -> list[str]:
        """Pins the longest run of these blocks (prefix-cache hashes, in order) that is stored: a handle each."""
        return []

    def stored(self, block_hash: bytes) -> bool:
        """Whether a producer already saved this block (it is then not saved again)."""
        return False

    def unpin(self, pinned: list[str]) -> None:
        """Releases pins that will not be loaded (the request could not be admitted after all)."""

    def close(self) -> None:
        """The engine stops: releases what the connector holds."""

    def pin(self, request: Request, num_local_hit_blocks: int) -> list[str]:
        """Pins the stored blocks that follow the local hit (none for a producer-only instance). The last prompt
        token is never loaded: its logits are needed. Requests asking for prompt logprobs compute every position."""
        if not self.config.loads or request.num_prompt_logprobs_missing:
            return []
        hashes = self.kv.block_hashes(request)
        return self.pin_stored(hashes[num_local_hit_blocks : (request.num_tokens - 1) // self.kv.block_size])

    def loads(self, request: Request, first_block: int, pinned: list[str]) -> list[tuple[str, int, str]]:
        """(request id, block id, handle) of the pinned blocks, now allocated after the local hit."""
        table = self.kv.block_ids(request.request_id)
        self.num_loaded_blocks += len(pinned)
        self._loading[request.request_id] = len(pinned)
        return [(request.request_id, table[first_block + i], handle) for i, handle in enumerate(pinned)]

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
                if table[i] >= 0 and not self.stored(hashes[i]):
                    out.append((table[i], hashes[i].hex()))
            self._saved[request.request_id] = full
        self.num_saved_blocks += len(out)
        return out

    def load_failed(self, request: Request) -> None:
        """The ranks could not read the request's stored blocks: they count as computed no more."""
        self.num_failed_loads += 1
        self.num_loaded_blocks -= self._loading.pop(request.request_id, 0)

    def drop(self, request_id: str) -> None:
        """The request left the engine (finished, aborted)."""
        self._saved.pop(request_id, None)
        self._loading.pop(request_id, None)


class SharedStorageScheduler(KVConnectorScheduler):
    """SharedStorageConnector: blocks are files of a directory both instances reach; a pin is a hard link."""

    def __init__(self, config: KVTransferConfig, world_size: int, kv: KVCacheManager) -> None:
        super().__init__(config, world_size, kv)
        self.storage = SharedKVStorage(config.storage_directory, world_size)

    def pin_stored(self, block_hashes: list[bytes]) -> list[str]:
        return [str(self.storage.pins / name) for name in self.storage.pin(block_hashes)]

    def stored(self, block_hash: bytes) -> bool:
        return self.storage.has(block_hash)

    def unpin(self, pinned: list[str]) -> None:
        self.storage.unpin([Path(handle).name for handle in pinned])

    def close(self) -> None:
        self.storage.close()


class PyNcclScheduler(SharedStorageScheduler):
    """PyNcclConnector: the consumer reads its own buffer directory, which its ranks' links fill; the producer has
    no storage (its ranks remember what they sent on the link now up)."""

    def __init__(self, config: KVTransferConfig, world_size: int, kv: KVCacheManager) -> None:
        if config.loads:  # buffers of consumers killed before their clean-up, beside ours
            remove_orphans(Path(config.shared_storage_path).parent)
            super().__init__(config, world_size, kv)
        else:
            KVConnectorScheduler.__init__(self, config, world_size, kv)
            self.storage = None

    def pin_stored(self, block_hashes: list[bytes]) -> list[str]:
        return super().pin_stored(block_hashes) if self.storage is not None else []

    def stored(self, block_hash: bytes) -> bool:
        return False  # the producer's ranks skip what they sent

    def unpin(self, pinned: list[str]) -> None:
        if self.storage is not None:
            super().unpin(pinned)

    def close(self) -> None:
        if self.storage is not None:
            super().close()
            shutil.rmtree(self.config.shared_storage_path, ignore_errors=True)  # the consumer's own buffer


BUILT_IN: dict[str, type[KVConnectorScheduler]] = {"SharedStorageConnector": SharedStorageScheduler,
                                                    "PyNcclConnector": PyNcclScheduler}


def scheduler_connector(config: KVTransferConfig, world_size: int, kv: KVCacheManager) -> KVConnectorScheduler:
    """The scheduler side of the configured connector: a built-in one, or a kv_connector_module_path's `scheduler`."""
    side = getattr(plugged_connector(config), "scheduler", None) if config.module_path else BUILT_IN[config.kv_connector]
    if not (isinstance(side, type) and issubclass(side, KVConnectorScheduler)):
        raise ValueError(f"kv_transfer_config: {config.module_path}.{config.kv_connector}.scheduler must be a "  # noqa: TRY004 - a configuration error
                         "subclass of lmserve.engine.kv_transfer.KVConnectorScheduler")
    return side(config, world_size, kv)
