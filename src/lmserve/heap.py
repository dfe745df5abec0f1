"""Freed heap memory handed back to the operating system, and large blocks kept for reuse while serving.

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

# mallopt's parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
# The most free memory at the heap's top kept without trimming (mallopt takes an int).
KEPT_FREE_TOP_BYTES = 1 << 30


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c"))
    except (OSError, TypeError):
        return None


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        trim = _libc().malloc_trim  # glibc only: musl and macOS have no malloc_trim
    except AttributeError:
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


def reuse_large_blocks() -> bool:
    """From now on, large blocks that are freed stay in the heap for the next allocation: False where the C library
    cannot. glibc maps every block above 32 MiB afresh and unmaps it at free, so each prompt step's activations (a
    1.5B model's gate/up output for 2,048 tokens is 147 MB) came from new pages: 2.1 M page faults and zeroed pages
    a step, 13.7-14.7 against 11.3-11.6 s once reused (docs/benchmarks.md, "8-bit activations by default from 250 M
    decoder weights; large blocks reused"). The price: the heap keeps the largest step's activations resident after
    it (~300 MiB for that 1.5B step). Called once the weights and the KV cache are in place, so neither is affected
    (the KV pool maps its own pages: worker/lazy_zeros.py)."""
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None or not hasattr(libc, "malloc_trim"):  # glibc's parameters only
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, KEPT_FREE_TOP_BYTES))
