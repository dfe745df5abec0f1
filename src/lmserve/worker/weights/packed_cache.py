"""The block layers' packed weights kept on disk, so that a GGUF file's later starts map them instead of packing its
blocks again.

Packing rearranges every matrix of a GGUF file into its kernel's layout (block_packing, kquants): for a 4 GB mixture
of experts that is 4 GB of fresh pages written at every start, the largest part of its time to ready. The first start
packs as before and then, on a background thread, writes what its layers hold into one file under the cache
directory (`--packed-weights-cache`, default `<lmserve cache>/packed`: the model may sit where its user cannot
write); a later start with the same key maps that file read-only and hands each layer its bytes (PackedBlocks), so
nothing is packed, and the pages are the page cache's, shared by every server on the machine and given back under
memory pressure instead of swapped.

The key: the model file's size, modification time and header (gguf_header_digest), the packing's layout (LAYOUT_VERSION,
the packers' Python sources and the kernels' build_key: their C++ sources, -march and torch), the CPU and the
features turned off, every block layer's name, format, shape and activations, and the settings and rank that chose
them. Anything else is a miss, never a wrong layout.

An entry is written to a temporary file and renamed into place, so that a crash or a second server never sees half
of one. It is checked before use: its size, a trailer written last, a digest of its table of tensors, and a CRC of
each tensor's first and last 4 KiB; one that fails is removed and packed again (a flipped bit inside a tensor is not
found: checking every byte would read the whole file at start, the cost this cache is for). The directory is kept
under a size (`--packed-weights-cache-size`): the entries read least recently go first, and entries whose model file
changed or is gone go whenever a new one is written. Where the directory cannot be written, the model packs in memory
as before, with a log line.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import struct
import threading
import time
import uuid
import warnings
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from lmserve.config import cache_directory
from lmserve.formats.block_formats import STORED_BLOCK_BYTES, block_width
from lmserve.formats.gguf_file import gguf_header_digest
from lmserve.worker import kernels
from lmserve.worker.weights.block_linear import BlockQuantizedLinear
from lmserve.worker.weights.block_packing import PackedBlocks
from lmserve.worker.weights.pending import PendingBlockLinear

logger = logging.getLogger(__name__)

# Raise when a packer's layout changes in a way its sources' digest would not show (e.g. a table in another module).
LAYOUT_VERSION = 1
# Python modules whose code decides the packed bytes (with the kernels' own sources, kernels.build_key).
_PACKER_MODULES = ("block_packing.py", "block_linear.py", "kquants.py", "stored_formats.py")
DIRECTORY_VARIABLE = "LMSERVE_PACKED_CACHE"  # what --packed-weights-cache auto reads: a directory, or off
DEFAULT_MAX_BYTES = 40 << 30
# Models whose layers pack in well under a second are not worth a file each (the test suite's tiny models).
DEFAULT_MIN_BYTES = 64 << 20
FREE_SPACE_MARGIN = 1 << 30  # an entry is not written where it would leave the disk with less than this
ENTRY_SUFFIX = ".packed"
_MAGIC, _END_MAGIC = b"LMSPACK1", b"LMSPEND1"
_ALIGNMENT = 4096  # each tensor starts on a page
_SAMPLE_BYTES = 4096
_TRAILER = struct.Struct("<8sQ32s")  # end magic, the file's size, SHA-256 of the table of tensors
_ABANDONED_TEMPORARY_SECONDS = 3600


@dataclass(frozen=True)
class PackedCacheSettings:
    directory: Path | None  # None: off
    max_bytes: int = DEFAULT_MAX_BYTES
    min_bytes: int = DEFAULT_MIN_BYTES


def packed_cache_settings(setting: str | None, max_bytes: int | None = None, min_bytes: int | None = None
                          ) -> PackedCacheSettings:
    """--packed-weights-cache: auto ($LMSERVE_PACKED_CACHE where set, a directory or off; else <lmserve
    cache>/packed), off, or a directory."""
    value = (setting or "auto").strip()
    if value == "auto":
        value = os.environ.get(DIRECTORY_VARIABLE, "").strip() or str(cache_directory() / "packed")
    directory = None if value.lower() in ("off", "none", "0", "false", "no") else Path(value).expanduser()
    return PackedCacheSettings(directory, DEFAULT_MAX_BYTES if max_bytes is None else max_bytes,
                               DEFAULT_MIN_BYTES if min_bytes is None else min_bytes)


def _packers_digest() -> str:
    digest = hashlib.sha256(f"layout {LAYOUT_VERSION}".encode())
    here = Path(__file__).parent
    for name in _PACKER_MODULES:
        digest.update(name.encode() + b"\0" + (here / name).read_bytes())
    digest.update((here.parent.parent / "formats" / "block_formats.py").read_bytes())
    return digest.hexdigest()


def _source_record(path: Path) -> dict[str, Any]:
    stat = path.stat()
    return {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


class PackedWeightsCache:
    """One model's entry: `load` maps it where a valid one exists; `save` writes what the finished layers hold."""

    def __init__(self, settings: PackedCacheSettings, model_path: Path, layers: Mapping[str, PendingBlockLinear],
                 context: Mapping[str, Any]) -> None:
        """layers: the model's pending block layers by name (what will be packed); context: what else chose their
        layout (settings, rank), as plain values."""
        assert settings.directory is not None
        self.settings = settings
        self.directory = settings.directory
        self.model_path = Path(model_path)
        self.names = sorted(layers)
        self.plan = {name: (layers[name].method, layers[name].out_features, layers[name].in_features)
                     for name in self.names}
        self.source = _source_record(self.model_path)
        key = {
            "source": {"size": self.source["size"], "mtime_ns": self.source["mtime_ns"],
                       "header": gguf_header_digest(self.model_path)},
            "packers": _packers_digest(),
            "kernels": kernels.build_key(),
            "cpu": kernels.cpu_signature(),
            "disabled": sorted(kernels.disabled_features()),
            "layers": [[name, layers[name].method, layers[name].out_features, layers[name].in_features,
                        layers[name].activations] for name in self.names],
            "context": dict(context),
        }
        self.key = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
        self.path = self.directory / f"{self.model_path.stem[:60]}-{self.key[:20]}{ENTRY_SUFFIX}"

    # ------------------------------------------------------------------------------------------------ reading

    def load(self) -> dict[str, PackedBlocks] | None:
        """Every cached layer's blocks, mapped read-only from the entry; None where there is no valid entry (one
        that fails its checks is removed, to be written again)."""
        try:
            mapped = np.memmap(self.path, mode="r", dtype=np.uint8)
        except (OSError, ValueError):  # none yet (ValueError: an empty file), or unreadable
            return None
        try:
            layers = self._read(mapped)
        except (ValueError, KeyError, TypeError, struct.error) as problem:
            logger.warning("packed weights cache: %s is damaged (%s); removing it and packing again", self.path,
                           problem)
            with contextlib.suppress(OSError):
                self.path.unlink()
            return None
        with contextlib.suppress(OSError):
            os.utime(self.path)  # the entry's modification time is when it was last read: eviction's order
        return layers

    def _read(self, mapped: np.ndarray) -> dict[str, PackedBlocks]:
        size = mapped.shape[0]
        if size < len(_MAGIC) + 8 + _TRAILER.size or bytes(mapped[: len(_MAGIC)]) != _MAGIC:
            raise ValueError("not a packed weights file")
        magic, recorded_size, table_digest = _TRAILER.unpack(bytes(mapped[size - _TRAILER.size :]))
        if magic != _END_MAGIC or recorded_size != size:
            raise ValueError(f"truncated: {size} bytes, its trailer says {recorded_size}")
        (table_length,) = struct.unpack("<Q", bytes(mapped[len(_MAGIC) : len(_MAGIC) + 8]))
        table_start = len(_MAGIC) + 8
        table_bytes = bytes(mapped[table_start : table_start + table_length])
        if hashlib.sha256(table_bytes).digest() != table_digest:
            raise ValueError("its table of tensors does not match its digest")
        table = json.loads(table_bytes)
        if table["key"] != self.key:
            raise ValueError("written for another key")
        layers = {}
        with warnings.catch_warnings():  # a read-only mapping: torch warns that it cannot be written (nothing does)
            warnings.simplefilter("ignore", UserWarning)
            for entry in table["tensors"]:
                start, nbytes = int(entry["offset"]), int(entry["nbytes"])
                shape = tuple(int(n) for n in entry["shape"])
                if self.plan.get(entry["name"]) != (entry["method"], entry["out_features"], entry["in_features"]):
                    raise ValueError(f"{entry['name']} is not a layer of this model's shape")
                if start % _ALIGNMENT or start + nbytes > size - _TRAILER.size or nbytes != int(np.prod(shape)):
                    raise ValueError(f"{entry['name']}'s bytes lie outside the file")
                # Every kernel layout holds at least the stored blocks' bytes (it widens scales, pads rows): fewer
                # would let a kernel read past the tensor.
                method, rows, columns = self.plan[entry["name"]]
                if nbytes < rows * columns // block_width(method) * STORED_BLOCK_BYTES[method]:
                    raise ValueError(f"{entry['name']} has fewer bytes than its blocks")
                data = mapped[start : start + nbytes]
                if _sample_crc(data) != entry["crc"]:
                    raise ValueError(f"{entry['name']}'s bytes do not match their checksum")
                layers[entry["name"]] = PackedBlocks(entry["method"], torch.from_numpy(data.reshape(shape)),
                                                     int(entry["out_features"]), int(entry["in_features"]),
                                                     entry["activations"])
        return layers

    # ------------------------------------------------------------------------------------------------ writing

    def packed_layers(self, model: nn.Module) -> dict[str, PackedBlocks]:
        """What the finished block layers under `model` hold, by the pending layers' names (after the kernels are
        settled: the layout they run)."""
        layers = {}
        for name in self.names:
            layer = model.get_submodule(name)
            if isinstance(layer, BlockQuantizedLinear) and layer.blocks.dtype == torch.uint8:
                layers[name] = PackedBlocks(layer.method, layer.blocks.contiguous(), layer.out_features,
                                            layer.in_features, layer.activations)
        return layers

    def save_in_background(self, model: nn.Module) -> threading.Thread | None:
        """Writes the entry on a thread of its own (the server is ready meanwhile); None where there is nothing to
        write. A daemon: a server stopped while it writes leaves a temporary file, which a later save removes."""
        layers = self.packed_layers(model)
        total = sum(p.blocks.numel() for p in layers.values())
        if total < self.settings.min_bytes:
            return None
        # NumPy views, taken here: the thread then only copies bytes and never calls into torch.
        arrays = {name: p.blocks.numpy() for name, p in layers.items()}
        thread = threading.Thread(target=self._save_or_log, args=(layers, arrays), name="packed-weights-cache",
                                  daemon=True)
        thread.start()
        return thread

    def _save_or_log(self, layers: Mapping[str, PackedBlocks], arrays: Mapping[str, np.ndarray]) -> None:
        try:
            self.save(layers, arrays)
        except Exception:  # a thread's failure is this cache's, never the server's: the weights are in memory
            logger.exception("packed weights cache: saving %s failed; the next start packs again", self.path)

    def save(self, layers: Mapping[str, PackedBlocks], arrays: Mapping[str, np.ndarray] | None = None) -> Path | None:
        """Writes the entry (temporary file, then renamed into place); the path written, or None where it was not
        (with a log line: this start's layers are packed in memory all the same)."""
        arrays = arrays or {name: p.blocks.numpy() for name, p in layers.items()}
        started = time.perf_counter()
        head, entries, data_end, table = self._layout(layers, arrays)
        temporary = self.directory / f".{self.path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self.remove_stale_entries()
            if data_end > self.settings.max_bytes:
                logger.info("packed weights cache: %.1f GB of packed weights exceed the cache's %.1f GB; not saved",
                            data_end / 1e9, self.settings.max_bytes / 1e9)
                return None
            self._make_room(data_end)
            if shutil.disk_usage(self.directory).free < data_end + FREE_SPACE_MARGIN:
                logger.info("packed weights cache: too little free disk space under %s for %.1f GB; not saved",
                            self.directory, data_end / 1e9)
                return None
            with open(temporary, "wb") as f:
                f.write(head)
                for entry in entries:
                    f.seek(entry["offset"])
                    f.write(memoryview(np.ascontiguousarray(arrays[entry["name"]])).cast("B"))
                f.seek(data_end)
                f.write(_TRAILER.pack(_END_MAGIC, data_end + _TRAILER.size, hashlib.sha256(table).digest()))
                f.flush()
                os.fsync(f.fileno())
            os.replace(temporary, self.path)
        except OSError as problem:
            logger.warning("packed weights cache: could not write %s (%s); the weights stay packed in memory only, "
                           "and the next start packs them again", self.path, problem)
            with contextlib.suppress(OSError):
                temporary.unlink()
            return None
        logger.info("packed weights cache: saved %d layers (%.2f GB) to %s in %.1f s", len(layers), data_end / 1e9,
                    self.path, time.perf_counter() - started)
        return self.path

    def _layout(self, layers: Mapping[str, PackedBlocks], arrays: Mapping[str, np.ndarray]
                ) -> tuple[bytes, list[dict[str, Any]], int, bytes]:
        """The file's head (magic, the table's length, the table, zeros up to the first tensor), the table's entries,
        where the tensors' data ends (the trailer's place) and the table's bytes."""
        entries, offset = [], 0
        for name in sorted(layers):
            packed, array = layers[name], arrays[name]
            entries.append({"name": name, "method": packed.method, "out_features": packed.out_features,
                            "in_features": packed.in_features, "activations": packed.activations,
                            "shape": list(array.shape), "nbytes": array.nbytes,
                            "crc": _sample_crc(np.ascontiguousarray(array)), "offset": offset})
            offset += -(-array.nbytes // _ALIGNMENT) * _ALIGNMENT
        # Where the data starts depends on the table's length, which holds the offsets: sized with room for them.
        draft = json.dumps({"key": self.key, "source": self.source, "tensors": entries}).encode()
        start = -(-(len(_MAGIC) + 8 + len(draft) + 24 * len(entries) + 64) // _ALIGNMENT) * _ALIGNMENT
        for entry in entries:
            entry["offset"] += start
        table = json.dumps({"key": self.key, "source": self.source, "tensors": entries}).encode()
        prefix = _MAGIC + struct.pack("<Q", len(table)) + table
        if len(prefix) > start:
            raise AssertionError("the packed weights' table outgrew its room")
        return prefix + b"\0" * (start - len(prefix)), entries, start + offset, table

    def _make_room(self, incoming: int) -> None:
        """Removes the entries read least recently until `incoming` more bytes fit under the size limit."""
        entries = []
        for entry in self.directory.glob(f"*{ENTRY_SUFFIX}"):
            with contextlib.suppress(OSError):
                stat = entry.stat()
                entries.append((stat.st_mtime, stat.st_size, entry))
        used = sum(size for _, size, entry in entries if entry != self.path)
        for _, size, entry in sorted(entries):
            if used + incoming <= self.settings.max_bytes:
                break
            if entry == self.path:
                continue
            with contextlib.suppress(OSError):
                entry.unlink()
                used -= size
                logger.info("packed weights cache: removed %s (least recently read) to stay under %.1f GB", entry,
                            self.settings.max_bytes / 1e9)

    def remove_stale_entries(self) -> None:
        """Removes entries no start would read again (their model file changed or is gone) and temporary files
        their writer left long ago."""
        now = time.time()
        for entry in self.directory.iterdir():
            with contextlib.suppress(OSError):
                if entry.name.startswith(".") and entry.name.endswith(".tmp"):
                    if now - entry.stat().st_mtime > _ABANDONED_TEMPORARY_SECONDS:
                        entry.unlink()
                elif entry.name.endswith(ENTRY_SUFFIX) and entry != self.path and not _source_unchanged(entry):
                    entry.unlink()
                    logger.info("packed weights cache: removed %s (its model file changed or is gone)", entry)


def _sample_crc(data: np.ndarray) -> int:
    """A CRC of a tensor's first and last bytes (its length is checked apart)."""
    flat = data.reshape(-1)
    return zlib.crc32(flat[-_SAMPLE_BYTES:], zlib.crc32(flat[:_SAMPLE_BYTES]))


def _source_unchanged(entry: Path) -> bool:
    """Whether an entry's model file is still the one it was packed from (an unreadable entry: no)."""
    try:
        with entry.open("rb") as f:
            head = f.read(len(_MAGIC) + 8)
            if head[: len(_MAGIC)] != _MAGIC:
                return False
            (length,) = struct.unpack("<Q", head[len(_MAGIC) :])
            source = json.loads(f.read(length))["source"]
        return _source_record(Path(source["path"])) == source
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return False


def use_packed_cache(model: nn.Module, settings: PackedCacheSettings, model_path: Path, context: Mapping[str, Any]
                     ) -> tuple[PackedWeightsCache | None, bool]:
    """Before a GGUF's weights load into `model` (built, its block layers pending): hands each pending block layer
    its cached blocks where a valid entry exists. (the cache, whether it was read); (None, False) where the cache is
    off, the model has no block layers, or its key cannot be made (the weights are packed as without it)."""
    if settings.directory is None:
        return None, False
    layers = {name: m for name, m in model.named_modules() if isinstance(m, PendingBlockLinear)}
    if not layers:
        return None, False
    try:
        cache = PackedWeightsCache(settings, model_path, layers, context)
    except OSError as problem:
        logger.warning("packed weights cache: not used for %s (%s)", model_path, problem)
        return None, False
    packed = cache.load()
    if packed is None:
        return cache, False
    for name, blocks in packed.items():
        layers[name].use_packed(blocks)
    logger.info("packed weights cache: %d of %d block layers mapped from %s", len(packed), len(layers), cache.path)
    return cache, True
