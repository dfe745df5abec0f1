"""Prefill/decode disaggregation over shared storage (vLLM's SharedStorageConnector): where a block's KV lies.

One file per full prompt block and rank, `<prefix-cache hash>-r<rank>.kv`: the hash (SHA-256 chained over the tokens
before and in the block, engine/kv_cache.py) names the same prefix in every process and run, so a decode instance
finds the blocks a prefill instance computed for the same prompt. A file is written whole under another name and then
renamed, so one that exists is complete.

A consumer pins the files it will load by hard-linking them into a directory of its own when it admits the request:
a producer removing old files (its byte cap) or a second producer replacing one cannot change what the next step
loads. The worker removes the pins it loaded.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import socket
import uuid
from collections.abc import Sequence
from pathlib import Path

from lmserve.kv_transfer_config import KV_LINK_BUFFER_PREFIX as BUFFER_PREFIX
from lmserve.process_exit import process_alive

SAMPLE_BYTES = 1 << 20  # read at the start, middle and end of each weight file for its fingerprint
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")


def model_fingerprint(path: Path) -> str:
    """A short fingerprint of the model at `path` (a GGUF file or a Hugging Face directory): its configuration files
    whole, and each weight file's name, size and bytes sampled at its start, middle and end. Two fine-tunes of one
    base differ in their weights' bytes, so their blocks never mix; reading ~3 MiB a file keeps this cheap."""
    digest = hashlib.sha256()
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    for file in files:
        if file.suffix == ".json" and file.stat().st_size <= SAMPLE_BYTES:
            digest.update(f"{file.name}\0".encode() + file.read_bytes())
        elif file.suffix in WEIGHT_SUFFIXES:
            size = file.stat().st_size
            digest.update(f"{file.name}\0{size}\0".encode())
            with open(file, "rb") as weights:
                for offset in (0, max(0, size // 2 - SAMPLE_BYTES // 2), max(0, size - SAMPLE_BYTES)):
                    weights.seek(offset)
                    digest.update(weights.read(SAMPLE_BYTES))
    return digest.hexdigest()[:24]


def make_private_directory(path: Path) -> None:
    """Creates `path` and any missing parent with mode 0700 (mkdir's parents=True gives parents the default mode);
    a directory that exists keeps its mode."""
    missing = [p for p in (path, *path.parents) if not p.exists()]
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=0o700)
        except FileExistsError:
            pass


def block_file(directory: Path, name: str, rank: int) -> Path:
    return directory / f"{name}-r{rank}.kv"


# The names remove_orphans may remove, parsed whole: the machine is everything between the prefix and the last
# "-p<pid>-<id>", compared with this machine's name exactly (host node1 must not take gpu-node1's for its own).
_OWNED_NAMES = (re.compile(r"\.pins-(?P<host>.+)-p(?P<pid>[0-9]+)-[0-9a-f]{8}"),
                re.compile(re.escape(BUFFER_PREFIX) + r"[0-9]+-(?P<host>.+)-p(?P<pid>[0-9]+)-[0-9a-f]{12}"))


def owner(name: str) -> tuple[str, int] | None:
    """(machine, pid) of the process that made a pin directory or a consumer buffer of this name; None for any
    other name."""
    for pattern in _OWNED_NAMES:
        match = pattern.fullmatch(name)
        if match is not None:
            return match["host"], int(match["pid"])
    return None


def remove_orphans(base: Path) -> list[Path]:
    """Removes what processes killed before their clean-up left under `base`: consumer buffers (BUFFER_PREFIX, in
    /dev/shm: up to kv_buffer_size bytes each) and, in a storage directory, pin directories (hard links that keep
    block files' bytes alive after the producer removed their names), named by a process of this machine that is
    gone. Both name their machine: a storage directory may be shared between machines, and a buffer made by another
    node's ranks carries node 0's name and pid. Returns what it removed."""
    removed = []
    host = socket.gethostname()
    try:
        entries = list(base.iterdir())
    except OSError:
        return removed
    for entry in entries:
        made_by = owner(entry.name)
        if made_by is None or made_by[0] != host:
            continue
        pid = made_by[1]
        if pid != os.getpid() and not process_alive(pid):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


class SharedKVStorage:
    """The scheduler's view of the storage: which prompt blocks are there, and pinning them for a load."""

    def __init__(self, root: str, world_size: int) -> None:
        self.root = Path(root)
        make_private_directory(self.root)  # every stored prompt's KV: this user's only
        remove_orphans(self.root)
        self.world_size = world_size
        self.pins = self.root / f".pins-{socket.gethostname()}-p{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.pins.mkdir(mode=0o700)

    def has(self, block_hash: bytes) -> bool:
        """Whether the block was saved (by this or another producer): rank 0's file is written by the same step."""
        return block_file(self.root, block_hash.hex(), 0).exists()

    def pin(self, block_hashes: Sequence[bytes]) -> list[str]:
        """Pins the longest run of the given blocks whose files every rank finds: their pin names, in order."""
        pinned: list[str] = []
        for block_hash in block_hashes:
            name = f"{block_hash.hex()}-{uuid.uuid4().hex[:8]}"
            linked = []
            try:
                for rank in range(self.world_size):
                    target = block_file(self.pins, name, rank)
                    os.link(block_file(self.root, block_hash.hex(), rank), target)
                    linked.append(target)
            except OSError:  # not there (yet, or any more): the run ends here
                for target in linked:
                    target.unlink(missing_ok=True)
                break
            pinned.append(name)
        return pinned

    def unpin(self, names: Sequence[str]) -> None:
        for name in names:
            for rank in range(self.world_size):
                block_file(self.pins, name, rank).unlink(missing_ok=True)

    def close(self) -> None:
        shutil.rmtree(self.pins, ignore_errors=True)
