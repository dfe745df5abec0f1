"""A rank's side of prefill/decode disaggregation (lmserve.distributed.kv_storage): writes the KV of the blocks the
scheduler names after the step computed them (a producer), and reads pinned blocks into the cache before the step
that attends over them (a consumer).

A block's file holds, for each of this rank's layers, its K then its V block as the cache stores them, raw. A layout
file per rank (the model, the element type, the block shapes) must match between the instances: a decode instance on
another CPU kind (K blocks transposed or not) or model refuses to start instead of reading wrong numbers.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from collections import deque
from pathlib import Path

import numpy as np
import torch

from lmserve.config import KVTransferConfig
from lmserve.distributed.kv_storage import block_file

logger = logging.getLogger(__name__)


class KVBlockFiles:
    def __init__(self, config: KVTransferConfig, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], rank: int,
                 model_name: str) -> None:
        self.config = config
        self.root = Path(config.shared_storage_path)
        self.root.mkdir(parents=True, exist_ok=True)
        self.kv_caches = kv_caches
        self.rank = rank
        self.parts = [t[0] for layer in kv_caches for t in layer]  # one block of each cache tensor
        self.block_bytes = sum(p.numel() * p.element_size() for p in self.parts)
        self._check_layout(model_name)
        self.written: deque[tuple[Path, int]] = deque()  # this producer's files, oldest first, for its byte cap
        self.bytes_written = 0

    def _check_layout(self, model_name: str) -> None:
        layout = {"model": model_name, "dtype": str(self.parts[0].dtype) if self.parts else "",
                  "block_shapes": [list(p.shape) for p in self.parts], "block_bytes": self.block_bytes}
        path = self.root / f"layout-r{self.rank}.json"
        try:
            found = json.loads(path.read_text())
        except FileNotFoundError:
            temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
            temporary.write_text(json.dumps(layout))
            os.replace(temporary, path)
            return
        except (OSError, ValueError) as exc:
            raise ValueError(f"kv transfer: cannot read {path}: {exc}") from None
        if found != layout:
            raise ValueError(f"kv transfer: {self.root} holds KV blocks of another layout ({path}: {found}); this "
                             f"instance's is {layout}. Use another shared_storage_path, or the same model, "
                             "--kv-cache-dtype and CPU kind on both sides")

    def save(self, blocks: list[tuple[int, str]]) -> None:
        """Writes each (block id, hash) that no producer wrote yet."""
        for block_id, name in blocks:
            path = block_file(self.root, name, self.rank)
            if path.exists():
                continue
            data = torch.cat([t[block_id].reshape(-1).view(torch.uint8).cpu()
                              for layer in self.kv_caches for t in layer])
            temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
            data.numpy().tofile(temporary)
            os.replace(temporary, path)
            self.written.append((path, self.block_bytes))
            self.bytes_written += self.block_bytes
        while self.bytes_written > self.config.max_storage_bytes and self.written:
            path, size = self.written.popleft()
            path.unlink(missing_ok=True)
            self.bytes_written -= size

    def load(self, blocks: list[tuple[int, str]]) -> None:
        """Reads each (block id, pin) into the cache, then drops the pin."""
        for block_id, pin in blocks:
            path = block_file(Path(pin).parent, Path(pin).name, self.rank)
            data = torch.from_numpy(_read_bytes(path, self.block_bytes))
            offset = 0
            for layer in self.kv_caches:
                for t in layer:
                    target = t[block_id].reshape(-1).view(torch.uint8)
                    target.copy_(data[offset : offset + target.numel()])
                    offset += target.numel()
            path.unlink(missing_ok=True)


def _read_bytes(path: Path, expected: int) -> np.ndarray:
    data = np.fromfile(path, dtype=np.uint8)
    if data.size != expected:
        raise ValueError(f"kv transfer: {path} holds {data.size} bytes, a block is {expected}")
    return data
