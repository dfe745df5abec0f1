"""The folders under lmserve's cache that hold GGUF files' converted tokenizers: one per file (path, size,
modification time) and transformers and tokenizers version. An entry names the file it was made from, so an entry
that can never be read again (its file deleted, replaced or touched) is removed when a new one is saved: a file
downloaded again, or the temporary files a test suite makes, would otherwise leave a copy of their vocabulary
(33 MB for Gemma 3's) in the cache for good. Entries nobody read for UNUSED_DAYS go too (other versions')."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCE_FILE = "lmserve-source.json"
UNUSED_DAYS = 30
# A folder being written by save_pretrained ("." + the entry's name): left alone unless its writer died long ago.
ABANDONED_STAGING_SECONDS = 3600


def source_record(path: Path, versions: str) -> dict[str, object]:
    stat = path.stat()
    return {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "versions": versions}


def entry_directory(parent: Path, path: Path, versions: str) -> Path:
    record = source_record(path, versions)
    key = f"{record['path']} {record['size']} {record['mtime_ns']} {versions}"
    return parent / f"{path.stem[:60]}-{hashlib.sha1(key.encode()).hexdigest()[:16]}"


def write_source(staging: Path, path: Path, versions: str) -> None:
    (staging / SOURCE_FILE).write_text(json.dumps(source_record(path, versions)))


def mark_used(entry: Path, path: Path, versions: str) -> None:
    """An entry's folder's modification time is when it was last read: what UNUSED_DAYS counts from. An entry an
    older lmserve saved gets its record here (it was just found under its file's key)."""
    try:
        if not (entry / SOURCE_FILE).is_file():
            write_source(entry, path, versions)
        os.utime(entry)
    except OSError:
        pass


def _can_be_read_again(entry: Path, now: float) -> bool:
    try:
        if now - entry.stat().st_mtime > UNUSED_DAYS * 86400:
            return False
        record = json.loads((entry / SOURCE_FILE).read_text())
        stat = Path(record["path"]).stat()
    except (OSError, ValueError, KeyError, TypeError):  # no record (an older lmserve's entry), or its file is gone
        return False
    return (stat.st_size, stat.st_mtime_ns) == (record["size"], record["mtime_ns"])


def remove_stale_entries(parent: Path, keep: Path) -> list[Path]:
    """Removes the entries under `parent` that no later start would read; returns them. Best effort: a folder that
    cannot be read or removed stays, and a reader that loses a folder to this rebuilds it."""
    now = time.time()
    removed = []
    try:
        entries = list(parent.iterdir())
    except OSError:
        return removed
    for entry in entries:
        if entry == keep or not entry.is_dir():
            continue
        if entry.name.startswith("."):
            try:
                stale = now - entry.stat().st_mtime > ABANDONED_STAGING_SECONDS
            except OSError:
                continue
        else:
            stale = not _can_be_read_again(entry, now)
        if stale:
            shutil.rmtree(entry, ignore_errors=True)
            if not entry.exists():
                removed.append(entry)
    if removed:
        logger.info("removed %d cached tokenizers that no start would read again", len(removed))
    return removed
