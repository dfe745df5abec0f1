"""A rank's side of prefill/decode disaggregation (lmserve.distributed.kv_storage): writes the KV of the blocks the
scheduler names after the step computed them (a producer), and reads pinned blocks into the cache on a thread of its
own, beside the forward passes of the requests already running (a consumer; the scheduler runs the loading request
once the driver rank reports its load done, and a rank waits for a load before any step that reads or reuses its
blocks: vLLM V1's start_load_kv / get_finished). Over PyNcclConnector, the producer sends the blocks over this rank's link
(lmserve.distributed.kv_link) instead, and the consumer's link thread writes what arrives into its own buffer
directory, from which the step loads it as from shared storage. KVConnectorWorker is the interface (vLLM V1's worker
role), with one subclass per connector; a connector of the user's comes from kv_connector_module_path.

A block's file holds, for each of this rank's layers, its K then its V block as the cache stores them, raw. A layout
file per rank (the model, the element type, the block shapes) must match between the instances: a decode instance on
another CPU kind (K blocks transposed or not) or model refuses to start instead of reading wrong numbers.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import uuid
from collections import OrderedDict, deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from lmserve.distributed.kv_link import MAX_BLOCKS_PER_MESSAGE, KVLink
from lmserve.distributed.kv_storage import block_file, make_private_directory
from lmserve.kv_transfer_config import KVTransferConfig, plugged_connector

logger = logging.getLogger(__name__)


class KVConnectorWorker:
    """A connector's worker side (vLLM V1's KVConnectorBase_V1 in its worker role), one per rank, over this rank's
    KV cache tensors. `save` writes or sends the blocks the scheduler side named, after the step's forward pass
    computed them; `load` reads pinned blocks (the scheduler side's handles) into the cache, on a thread of its own
    beside the forward passes (vLLM's start_load_kv / get_finished: `start_loads`, `finished_loads`, and `wait_for`
    before a step that reads or reuses a loading block). A subclass says how blocks are saved and loaded; this class
    runs the loads and gives a block's bytes (`gather`, `scatter`: each block's K then V of every layer, raw)."""

    def __init__(self, config: KVTransferConfig, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], rank: int,
                 model_name: str) -> None:
        self.config = config
        self.kv_caches = kv_caches
        self.rank = rank
        self.model_name = model_name
        self.parts = [t[0] for layer in kv_caches for t in layer]  # one block of each cache tensor
        self.block_bytes = sum(p.numel() * p.element_size() for p in self.parts)
        self._loader: ThreadPoolExecutor | None = None  # started by the first load
        self._loading: dict[str, tuple[Future, frozenset[int]]] = {}  # request id -> its load and its blocks
        self._failed_loads: list[str] = []  # requests whose load failed since the last finished_loads()
        self.num_failed_saves = 0  # blocks a save could not write (a full or failing disk): counted, not fatal

    def save(self, blocks: list[tuple[int, str]]) -> None:
        """Saves each (block id, hash hex) the scheduler side named; called after the step's forward pass."""
        raise NotImplementedError

    def load(self, blocks: list[tuple[int, str]]) -> None:
        """Reads each (block id, handle) into the cache; runs on the loading thread."""
        raise NotImplementedError

    def gather(self, block_ids: list[int]) -> torch.Tensor:
        """(blocks, block bytes): each block's bytes, cache tensor after cache tensor; one index_select per tensor (a
        block is ~60 small pieces: copied one by one, 120 blocks took 50 ms)."""
        index = torch.tensor(block_ids, device=self.parts[0].device)
        return torch.cat([t.index_select(0, index).reshape(len(block_ids), -1).view(torch.uint8)
                          for layer in self.kv_caches for t in layer], dim=1)

    def scatter(self, block_ids: list[int], data: torch.Tensor) -> None:
        """gather's inverse: (blocks, block bytes) into the cache's blocks."""
        index = torch.tensor(block_ids, device=self.parts[0].device)
        offset = 0
        for layer in self.kv_caches:
            for t in layer:
                size = t[0].numel() * t.element_size()
                part = data[:, offset : offset + size].contiguous().view(t.dtype).reshape(len(block_ids), *t.shape[1:])
                t.index_copy_(0, index, part.to(t.device))
                offset += size

    def close(self) -> None:
        self.wait_for(self._loading)
        if self._loader is not None:
            self._loader.shutdown()

    @property
    def loading(self) -> bool:
        return bool(self._loading)

    def start_loads(self, loads: list[tuple[str, int, str]]) -> None:
        """Starts reading each request's (request id, block id, handle) on the loading thread."""
        by_request: dict[str, list[tuple[int, str]]] = {}
        for request_id, block_id, handle in loads:
            by_request.setdefault(request_id, []).append((block_id, handle))
        if self._loader is None:
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="lmserve-kv-load")
        for request_id, blocks in by_request.items():
            self.wait_for([request_id])  # an earlier load of the same request (preempted, admitted again)
            future = self._loader.submit(self._load_in_thread, blocks)
            self._loading[request_id] = (future, frozenset(block_id for block_id, _ in blocks))

    def _load_in_thread(self, blocks: list[tuple[int, str]]) -> bool:
        """True once the blocks are in; False where a block's file was missing, short or unreadable (the request
        then computes those positions itself: one bad file must not end the engine)."""
        # One OpenMP thread for the copies: a second team of the compute threads' size would fight them for the
        # cores. OpenMP's count is per thread (the forward passes keep theirs), but torch also keeps the last one set
        # for threads that start later: it is put back after the load.
        previous = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with torch.inference_mode():  # the cache's tensors are inference tensors
                if blocks:
                    self.load(blocks)
        except (OSError, ValueError) as exc:
            logger.warning("kv transfer: rank %d could not load %d stored block(s) (%s): the request computes them",
                           self.rank, len(blocks), exc)
            return False
        finally:
            torch.set_num_threads(previous)
        return True

    def wait_for(self, request_ids: Iterable[str], block_ids: Iterable[int] = ()) -> None:
        """Waits for the loads of these requests, and for any load into these blocks (a load's error is raised)."""
        if not self._loading:
            return
        wanted = set(request_ids) & self._loading.keys()
        blocks = set(block_ids)
        if blocks:
            wanted |= {rid for rid, (_, loading) in self._loading.items() if not loading.isdisjoint(blocks)}
        for request_id in wanted:
            self._loading[request_id][0].result()

    def finished_loads(self) -> tuple[list[str], list[str]]:
        """The requests whose loads ended since the last call, and of those the ones whose load failed (their
        blocks hold nothing usable; an unexpected error is raised)."""
        done = [request_id for request_id, (future, _) in self._loading.items() if future.done()]
        for request_id in done:
            if self._loading.pop(request_id)[0].result() is False:
                self._failed_loads.append(request_id)
        failed, self._failed_loads = self._failed_loads, []
        return done, failed


class SharedStorageWorker(KVConnectorWorker):
    """SharedStorageConnector: a block's file per rank in the storage directory; loads read the scheduler's pins."""

    def __init__(self, config: KVTransferConfig, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], rank: int,
                 model_name: str) -> None:
        super().__init__(config, kv_caches, rank, model_name)
        self.root = Path(config.storage_directory)
        self.written: deque[tuple[Path, int]] = deque()  # this rank's files on disk, oldest first, for the byte cap
        self.bytes_written = 0
        if self.keeps_files:
            make_private_directory(self.root)
            self._count_files_on_disk()
        self._check_layout()
        self._keep_to_cap()

    def _count_files_on_disk(self) -> None:
        """The cap bounds what is on disk, not only what this process wrote: a restarted producer finds its
        predecessors' files, oldest first."""
        found = []
        for path in self.root.glob(f"*-r{self.rank}.kv"):
            try:
                found.append((path.stat().st_mtime_ns, path, path.stat().st_size))
            except OSError:  # removed meanwhile
                continue
        for _, path, size in sorted(found):
            self.written.append((path, size))
            self.bytes_written += size

    @property
    def keeps_files(self) -> bool:
        return True

    def _layout(self) -> dict:
        return {"model": self.model_name, "dtype": str(self.parts[0].dtype) if self.parts else "",
                "block_shapes": [list(p.shape) for p in self.parts], "block_bytes": self.block_bytes}

    def _check_layout(self) -> None:
        layout = self._layout()
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
        missing = [(block_id, path) for block_id, name in blocks
                   if not (path := block_file(self.root, name, self.rank)).exists()]
        if missing:
            data = self.gather([block_id for block_id, _ in missing]).cpu()
            for written, (row, (_, path)) in enumerate(zip(data, missing, strict=True)):
                try:
                    self._write(path, row)
                except OSError as exc:  # ENOSPC, EIO: these blocks are not stored; the decode side computes them
                    self.num_failed_saves += len(missing) - written
                    logger.warning("kv transfer: rank %d could not store %d block(s) in %s (%s); skipped",
                                   self.rank, len(missing) - written, self.root, exc)
                    break
        self._keep_to_cap()

    def _write(self, path: Path, data: torch.Tensor) -> None:
        temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
        try:
            data.numpy().tofile(temporary)
            os.replace(temporary, path)
        except OSError:
            temporary.unlink(missing_ok=True)
            raise
        self.written.append((path, self.block_bytes))
        self.bytes_written += self.block_bytes

    def _keep_to_cap(self) -> None:
        while self.bytes_written > self.config.max_storage_bytes and self.written:
            path, size = self.written.popleft()
            path.unlink(missing_ok=True)
            self.bytes_written -= size

    def load(self, blocks: list[tuple[int, str]]) -> None:
        """Reads each (block id, pin) into the cache, then drops the pins (a failed read drops them too: the request
        computes those blocks, and nothing else holds the pins)."""
        data = np.empty((len(blocks), self.block_bytes), dtype=np.uint8)
        paths = [block_file(Path(pin).parent, Path(pin).name, self.rank) for _, pin in blocks]
        try:
            for row, path in zip(data, paths, strict=True):
                _read_into(path, row)
            self.scatter([block_id for block_id, _ in blocks], torch.from_numpy(data))
        finally:
            for path in paths:
                path.unlink(missing_ok=True)


class PyNcclWorker(SharedStorageWorker):
    """PyNcclConnector: the producer sends the blocks over this rank's link (lmserve.distributed.kv_link); the
    consumer's link thread writes what arrives into its own buffer directory, from which the step loads it as from
    shared storage. The link checks the two sides' layouts when it comes up."""

    def __init__(self, config: KVTransferConfig, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], rank: int,
                 model_name: str) -> None:
        _check_buffer_machine(config, rank)
        super().__init__(config, kv_caches, rank, model_name)
        # Names sent on the link now up, as many as the consumer's buffer holds: one sent longer ago than that may be
        # gone there, so it is sent again.
        self._sent: OrderedDict[str, None] = OrderedDict()
        self._sent_generation = 0
        device = kv_caches[0][0].device if kv_caches else torch.device("cpu")
        self.link = KVLink(config, rank, self._layout(), device, self.block_bytes, self._keep)

    @property
    def keeps_files(self) -> bool:
        return self.config.loads  # a link's producer keeps no files

    def _check_layout(self) -> None:
        """The link compares layouts when it comes up."""

    def save(self, blocks: list[tuple[int, str]]) -> None:
        """Sends each (block id, hash) the consumer does not hold yet."""
        if self.link.generation != self._sent_generation:  # a new consumer (or the same one, restarted) holds none
            self._sent.clear()
            self._sent_generation = self.link.generation
        fresh = [(block_id, name) for block_id, name in blocks if name not in self._sent]
        capacity = max(1, self.config.max_storage_bytes // max(1, self.block_bytes))
        for start in range(0, len(fresh), MAX_BLOCKS_PER_MESSAGE):
            chunk = fresh[start : start + MAX_BLOCKS_PER_MESSAGE]
            if not self.link.send([name for _, name in chunk], self.gather([b for b, _ in chunk]).reshape(-1)):
                return  # no consumer linked: it computes these blocks itself
            for _, name in chunk:
                self._sent[name] = None
            while len(self._sent) > capacity:
                self._sent.popitem(last=False)

    def _keep(self, names: list[str], data: torch.Tensor) -> None:
        """The consumer's link thread: the received blocks into this rank's buffer files, before it acknowledges."""
        for i, name in enumerate(names):
            path = block_file(self.root, name, self.rank)
            if not path.exists():
                self._write(path, data[i * self.block_bytes : (i + 1) * self.block_bytes])
        self._keep_to_cap()

    def close(self) -> None:
        super().close()
        self.link.close()


BUILT_IN: dict[str, type[KVConnectorWorker]] = {"SharedStorageConnector": SharedStorageWorker,
                                                 "PyNcclConnector": PyNcclWorker}


def worker_connector(config: KVTransferConfig, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], rank: int,
                     model_name: str) -> KVConnectorWorker:
    """The worker side of the configured connector: a built-in one, or a kv_connector_module_path's `worker`."""
    side = getattr(plugged_connector(config), "worker", None) if config.module_path else BUILT_IN[config.kv_connector]
    if not (isinstance(side, type) and issubclass(side, KVConnectorWorker)):
        raise ValueError(f"kv_transfer_config: {config.module_path}.{config.kv_connector}.worker must be a "  # noqa: TRY004 - a configuration error
                         "subclass of lmserve.worker.kv_transfer.KVConnectorWorker")
    return side(config, kv_caches, rank, model_name)


def _check_buffer_machine(config: KVTransferConfig, rank: int) -> None:
    """A consumer's engine pins a block only where every rank's file of it is in the buffer directory of its own
    machine: a rank on another machine (--nnodes, Ray) would fill a /dev/shm that engine never sees, so every prompt
    would be computed again, and the buffer would outlive the server."""
    here = socket.gethostname()
    if config.over_network and config.loads and config.buffer_host and config.buffer_host != here:
        raise ValueError(f"kv transfer: PyNcclConnector's kv_consumer keeps the blocks it receives on the machine of "
                         f"its engine ({config.buffer_host}); rank {rank} runs on {here}, where that engine would find "
                         "none of them. Run a kv_consumer's ranks on one machine, or use SharedStorageConnector with a "
                         "shared_storage_path that every machine mounts")


def _read_into(path: Path, row: np.ndarray) -> None:
    with open(path, "rb") as file:
        size = file.readinto(memoryview(row))
        if size != row.size or file.read(1):
            raise ValueError(f"kv transfer: {path} is not one block of {row.size} bytes")
