"""A KV connector of a test's own, plugged in by kv_connector_module_path (tests/engine/test_kv_connector_plugin.py):
blocks kept in this process's memory, in the store that kv_connector_extra_config names. It uses only the interface
(lmserve.engine.kv_transfer.KVConnectorScheduler, lmserve.worker.kv_transfer.KVConnectorWorker)."""

from __future__ import annotations

import torch

from lmserve.engine.kv_transfer import KVConnectorScheduler
from lmserve.worker.kv_transfer import KVConnectorWorker

STORES: dict[str, dict[str, torch.Tensor]] = {}  # store name -> block hash hex -> the block's bytes


def store_of(connector: KVConnectorScheduler | KVConnectorWorker) -> dict[str, torch.Tensor]:
    return STORES.setdefault(connector.config.extra_config["store"], {})


class MemoryScheduler(KVConnectorScheduler):
    def pin_stored(self, block_hashes: list[bytes]) -> list[str]:
        run = []
        for block_hash in block_hashes:
            if block_hash.hex() not in store_of(self):
                break
            run.append(block_hash.hex())
        return run

    def stored(self, block_hash: bytes) -> bool:
        return block_hash.hex() in store_of(self)


class MemoryWorker(KVConnectorWorker):
    def save(self, blocks: list[tuple[int, str]]) -> None:
        data = self.gather([block_id for block_id, _ in blocks]).clone()
        for row, (_, name) in zip(data, blocks, strict=True):
            store_of(self)[name] = row

    def load(self, blocks: list[tuple[int, str]]) -> None:
        self.scatter([block_id for block_id, _ in blocks], torch.stack([store_of(self)[name] for _, name in blocks]))


class MemoryConnector:
    scheduler = MemoryScheduler
    worker = MemoryWorker


class NoScheduler:  # its scheduler side is not one
    scheduler = dict
    worker = MemoryWorker


class NoWorker:
    scheduler = MemoryScheduler
