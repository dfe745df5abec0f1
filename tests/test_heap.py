"""release_freed_heap hands memory that was freed but kept in glibc's arenas back to the system."""

from __future__ import annotations

import ctypes
import ctypes.util
import subprocess
import sys

import pytest

from lmserve.heap import release_freed_heap

CHILD = r"""
import ctypes, ctypes.util
from lmserve.heap import release_freed_heap

def rss_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
# 2,048 blocks of 64 KiB (below malloc's mmap threshold: they live in the heap), each touched, then all freed but
# the last: it pins the heap's top, so glibc's own trimming at free() cannot give the pages back.
blocks = [libc.malloc(64 * 1024) for _ in range(2048)]
for block in blocks:
    ctypes.memset(block, 1, 64 * 1024)
for block in blocks[:-1]:
    libc.free(block)
before = rss_mib()
released = release_freed_heap()
print(released, before, rss_mib())
"""


def _glibc() -> bool:
    try:
        return hasattr(ctypes.CDLL(ctypes.util.find_library("c")), "malloc_trim")
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _glibc(), reason="malloc_trim is glibc's")
def test_freed_heap_pages_leave_the_resident_set() -> None:
    result = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60, check=True)
    released, before, after = result.stdout.split()
    assert released == "True"
    # 128 MiB were freed inside the heap; at least most of it must leave the resident set.
    assert float(before) - float(after) > 100, result.stdout


def test_release_reports_whether_the_c_library_could() -> None:
    assert release_freed_heap() is _glibc()


REUSE_CHILD = r"""
import ctypes, ctypes.util, resource, sys
from lmserve.heap import reuse_large_blocks

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
SIZE = 96 << 20  # above glibc's largest mmap threshold (32 MiB): a fresh mapping each time by default

def faults_of_a_written_block():
    block = libc.malloc(SIZE)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    ctypes.memset(block, 1, SIZE)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    libc.free(block)
    return faults

if sys.argv[1] == "reuse":
    assert reuse_large_blocks()
faults_of_a_written_block()
print(faults_of_a_written_block())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _glibc(), reason="mallopt's parameters are glibc's")
def test_large_blocks_are_reused_instead_of_faulted_in_afresh() -> None:
    pages = (96 << 20) // 4096
    faults = {}
    for mode in ("default", "reuse"):
        result = subprocess.run([sys.executable, "-c", REUSE_CHILD, mode], capture_output=True, text=True, timeout=60,
                                check=True)
        faults[mode] = int(result.stdout)
    # Without it the second block's pages fault in again (fewer where the kernel hands out huge pages); with it
    # the first block's pages are written again in place.
    assert faults["default"] > pages // 600, faults
    assert faults["reuse"] < 50, faults
