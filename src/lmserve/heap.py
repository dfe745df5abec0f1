"""Freed heap memory handed back to the operating system.

glibc keeps what a process frees in its arenas for later allocations; after a one-off burst (a tokenizer parsed from a
150k-entry JSON, a model's weights packed into kernel layouts) that memory stays resident although nothing uses it:
~95 MiB of the API process's 212 MiB after Qwen2.5's tokenizer loads. `malloc_trim(0)` returns the free pages.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim  # glibc only: musl and macOS have no malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def release_freed_heap() -> bool:
    """Collects the young generations' garbage and returns free heap pages to the system; False where the C library
    cannot. Not a full collection: that walks every object torch's import made (0.13 s of the engine's start-up) and
    freed nothing more (a Qwen2.5 0.5B server: 787 MiB at ready either way); the bursts this follows die young."""
    gc.collect(1)
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
