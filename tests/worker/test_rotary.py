"""RoPE tables on the CPU are computed as positions are first used, in fixed pieces: whatever order batches reach
positions in, each position's cos and sin are the whole table's, bit for bit, and a long context's tables take no
memory until it is used."""

from __future__ import annotations

import ctypes
import os
import types

import torch

from lmserve.worker.models.rotary import ROPE_CHUNK, RotaryEmbedding

CONFIG = types.SimpleNamespace(rope_theta=1e6)  # what the rotary code reads of a config: the default rope type
HEAD_DIM = 256  # Gemma 3's: the widest tables of the models served
LIBC = ctypes.CDLL(None, use_errno=True)


def resident_mib(table: torch.Tensor) -> float:
    """The resident pages of `table`'s own bytes (mincore(2)). Not its mapping's Rss in /proc/self/smaps: the kernel
    merges an anonymous mapping with a neighbouring one of the same kind, whose pages that would count too (it read
    1 MiB for an untouched table in a pytest-xdist worker)."""
    page = os.sysconf("SC_PAGE_SIZE")
    start = table.data_ptr() // page * page
    length = table.data_ptr() + table.numel() * table.element_size() - start
    flags = (ctypes.c_ubyte * ((length + page - 1) // page))()
    if LIBC.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), flags) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(flag & 1 for flag in flags) * page / 2**20


def test_positions_reached_in_any_order_give_the_whole_tables_values() -> None:
    max_position = 3 * ROPE_CHUNK + 100  # a last piece shorter than the others
    whole = RotaryEmbedding(CONFIG, HEAD_DIM, max_position, torch.device("cpu"))
    whole_cos, whole_sin = whole.cos.clone(), whole.sin.clone()
    assert whole_cos.shape == (max_position, HEAD_DIM // 2) and bool((whole_cos[1:] != 1.0).any())
    batches = [[2 * ROPE_CHUNK + 5], [0, 1, 2], list(range(max_position - 7, max_position)), [ROPE_CHUNK - 1, 17],
               list(range(ROPE_CHUNK, ROPE_CHUNK + 300))]
    lazy = RotaryEmbedding(CONFIG, HEAD_DIM, max_position, torch.device("cpu"))
    for batch in batches:
        positions = torch.tensor(batch)
        cos, sin = lazy.tables(positions)
        assert torch.equal(cos[:, 0], whole_cos[positions]) and torch.equal(sin[:, 0], whole_sin[positions])
    positions = torch.arange(max_position)
    cos, sin = lazy.tables(positions)
    assert torch.equal(cos[:, 0], whole_cos) and torch.equal(sin[:, 0], whole_sin)


def test_a_long_contexts_tables_take_memory_only_for_the_positions_used() -> None:
    max_position = 65_536  # whole: 65,536 x 128 floats = 32 MiB a table
    rope = RotaryEmbedding(CONFIG, HEAD_DIM, max_position, torch.device("cpu"))
    assert resident_mib(rope._cos) < 1  # built: nothing resident
    rope.tables(torch.arange(2 * ROPE_CHUNK))
    assert resident_mib(rope._cos) <= 4  # 2,048 rows of 512 bytes: 1 MiB, in huge pages where the kernel uses them
    cos = rope.cos  # the whole table asked for: every row computed
    assert resident_mib(cos) > 31 and bool((cos[-1] != 0).all())
