"""KVCacheManager: allocation, reference counts, prefix cache hits, LRU eviction, collision guard."""

from __future__ import annotations

import pytest

from lmserve.engine import kv_cache
from lmserve.engine.kv_cache import KVCacheManager
from lmserve.engine.request import Request
from lmserve.kv_sizing import blocks_needed
from lmserve.sampling_params import SamplingParams


def make_request(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=8), cache_salt=salt)


def admit(kv: KVCacheManager, request: Request) -> int:
    """What the scheduler does on admission of a whole prompt: look up hits, allocate, advance."""
    hits, num_hit = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_hit, hits, num_hit)
    request.num_computed_tokens = request.num_tokens
    return num_hit


def free_order(kv: KVCacheManager) -> list[int]:
    return list(kv.pool.free_queue)


def test_blocks_needed() -> None:
    assert [blocks_needed(n, 16) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]


def test_allocate_and_free_ref_counts() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r = make_request("r", range(10))
    admit(kv, r)
    assert kv.block_ids("r") == [0, 1, 2]
    assert kv.num_used_blocks == 3 and kv.num_free_blocks == 5 and kv.usage == pytest.approx(3 / 8)
    # Growing by one position inside the last block takes nothing; crossing a boundary takes one block.
    assert kv.allocate_slots(r, 2)
    assert len(kv.block_ids("r")) == 3
    r.num_computed_tokens = 12
    r.output_token_ids += [100, 101, 102]
    assert kv.allocate_slots(r, 1)
    assert len(kv.block_ids("r")) == 4
    kv.free(r)
    assert kv.ref_counts() == [0] * 8 and kv.num_free_blocks == 8
    kv.free(r)  # idempotent
    kv.free(make_request("unknown", [1]))
    assert kv.ref_counts() == [0] * 8


def test_allocate_failure_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request("a", range(12))
    admit(kv, a)
    before = (kv.ref_counts(), free_order(kv), dict(kv.pool.cached))
    b = make_request("b", range(100, 108))
    assert not kv.allocate_slots(b, 8)
    assert (kv.ref_counts(), free_order(kv), dict(kv.pool.cached)) == before
    assert kv.block_ids("b") == []


def test_prefix_hit_same_prompt() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=16)
    prompt = list(range(1000, 1040))
    a = make_request("a", prompt)
    assert admit(kv, a) == 0
    b = make_request("b", prompt)
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 32 and hits == kv.block_ids("a")[:2]
    # A lookup takes no reference.
    assert kv.ref_counts()[hits[0]] == 1
    assert kv.prefix_cache_queries == 80 and kv.prefix_cache_hits == 32
    assert kv.allocate_slots(b, 8, hits, num_hit)
    assert kv.block_ids("b")[:2] == hits and kv.block_ids("b")[2] != kv.block_ids("a")[2]
    assert [kv.ref_counts()[h] for h in hits] == [2, 2]
    kv.free(a)
    kv.free(b)
    assert kv.ref_counts() == [0] * 16


def test_full_hit_recomputes_last_position() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=16)
    prompt = list(range(32))
    admit(kv, make_request("a", prompt))
    b = make_request("b", prompt)
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 16 and len(hits) == 1  # the last block is dropped: its last token needs logits
    # One token past the boundary: both blocks hit, only the new token is computed.
    c = make_request("c", prompt + [99])
    assert kv.get_computed_blocks(c)[1] == 32


def test_salt_separates_caches() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(20))
    admit(kv, make_request("a", prompt, salt="alice"))
    assert kv.get_computed_blocks(make_request("b", prompt, salt="bob"))[1] == 0
    assert kv.get_computed_blocks(make_request("c", prompt))[1] == 0
    assert kv.get_computed_blocks(make_request("d", prompt, salt="alice"))[1] == 16


@pytest.mark.parametrize("key_generated_blocks", [False, True])
def test_blocks_of_generated_tokens_are_keyed_apart_where_the_model_computes_them_differently(
    key_generated_blocks: bool,
) -> None:
    """With prompt-bf16 a generated token's K/V differ from the same token's as a prompt token: a chat's next turn,
    whose prompt repeats the last answer, must not take the answer's blocks, while the request itself, recomputed after
    preemption, still finds them."""
    kv = KVCacheManager(num_blocks=16, block_size=16, key_generated_blocks=key_generated_blocks)
    a = make_request("a", list(range(1000, 1020)))  # 20 prompt tokens: block 1 holds the first generated tokens
    a.output_token_ids.extend(range(2000, 2030))
    assert admit(kv, a) == 0  # 50 tokens: blocks 0-2 full and cached
    next_turn = make_request("b", a.all_token_ids + [7])
    assert kv.get_computed_blocks(next_turn)[1] == (16 if key_generated_blocks else 48)
    resumed = make_request("a2", a.prompt_token_ids)
    resumed.output_token_ids.extend(a.output_token_ids)
    assert kv.get_computed_blocks(resumed)[1] == 48


def test_hash_collision_never_returns_wrong_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_cache, "hash_block_tokens", lambda *args: b"same")
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a_prompt = list(range(12)) + [50]
    admit(kv, make_request("a", a_prompt))
    # Every block of every request now has the same hash: only exact (parent, tokens, extra) keys may hit.
    cases = [
        ("b", list(range(100, 113)), 0),
        ("c", [0, 1, 2, 3, 9, 9, 9, 9, 8, 9, 10, 11, 5], 4),  # a real hit on the first block still works
        ("d", [7, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 5], 0),
        ("e", a_prompt, 4),  # later blocks collided with the first one when cached, so they were not cached
    ]
    for rid, prompt, expected in cases:
        hits, num_hit = kv.get_computed_blocks(make_request(rid, prompt))
        assert num_hit == expected
        for i, block_id in enumerate(hits):
            assert kv.pool.blocks[block_id].cache_key[1] == tuple(prompt[4 * i : 4 * i + 4])
    assert kv.get_computed_blocks(make_request("d", list(range(100, 113))))[1] == 0
    salted = make_request("e", a_prompt, salt="s")
    assert kv.get_computed_blocks(salted)[1] == 0


def test_caching_disabled() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    admit(kv, make_request("a", range(10)))
    assert kv.get_computed_blocks(make_request("b", range(10))) == ([], 0)
    assert kv.prefix_cache_queries == 0 and not kv.pool.cached


def test_tail_first_release_and_lru_eviction() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", range(12))  # three full blocks
    admit(kv, a)
    a_blocks = kv.block_ids("a")
    kv.free(a)
    # Uncached blocks stay at the head; a's blocks go to the tail, its last block first.
    assert free_order(kv) == [3, 4, 5, 6, 7] + a_blocks[::-1]
    assert kv.num_cached_free_blocks == 3
    b = make_request("b", range(100, 112))
    admit(kv, b)
    b_blocks = kv.block_ids("b")
    kv.free(b)
    assert free_order(kv) == [6, 7] + a_blocks[::-1] + b_blocks[::-1]
    # Taking 4 blocks: two uncached, then a's suffix block, then its middle one. a's first block survives.
    c = make_request("c", range(200, 216))
    admit(kv, c)
    assert kv.block_ids("c") == [6, 7, a_blocks[2], a_blocks[1]]
    assert kv.get_computed_blocks(make_request("a2", list(range(12)) + [1]))[1] == 4
    # b's blocks were freed later, so they all survive.
    assert kv.get_computed_blocks(make_request("b2", list(range(100, 112)) + [1]))[1] == 12


def test_uncached_partial_block_reused_first() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = make_request("a", range(6))  # one full (cached) block and one partial block
    admit(kv, a)
    full, partial = kv.block_ids("a")
    kv.free(a)
    assert free_order(kv) == [partial, 2, full]
    b = make_request("b", range(50, 52))
    admit(kv, b)
    assert kv.block_ids("b") == [partial]


def test_hit_on_free_block_takes_it_out_of_the_free_queue() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request("a", range(9))
    admit(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 4
    b = make_request("b", range(9))
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    # The hits sit in the free queue, so they count against it: 2 hits + 1 new block of 4 free.
    assert kv.can_fit(b, 9, hits) and not kv.can_fit(b, 21, hits)
    assert kv.allocate_slots(b, 1, hits, num_hit)
    assert kv.num_free_blocks == 1 and all(kv.ref_counts()[h] == 1 for h in hits)


def test_reused_block_is_evicted_from_the_cache() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=4)
    a = make_request("a", range(5))
    admit(kv, a)
    kv.free(a)
    admit(kv, make_request("b", range(100, 108)))  # takes both blocks, overwriting a's
    assert kv.get_computed_blocks(make_request("a2", range(5)))[1] == 0
    assert len(kv.pool.cached) == 2


def test_blocks_full_after_allocation_are_cached_with_known_tokens_only() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r = make_request("r", range(6))
    assert kv.allocate_slots(r, 3)  # chunk of 3: no full block yet
    assert not kv.pool.cached
    r.num_computed_tokens = 3
    assert kv.allocate_slots(r, 3)  # positions 3..5: block 0 is full
    assert len(kv.pool.cached) == 1
    r.num_computed_tokens = 6
    r.output_token_ids.append(7)
    assert kv.allocate_slots(r, 1)  # position 6 of 7 known tokens: block 1 not full yet
    assert len(kv.pool.cached) == 1


def test_free_after_rollback_uncaches_unwritten_blocks() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    r = make_request("r", range(8))
    assert kv.allocate_slots(r, 8)  # planned, and both blocks cached at allocation
    assert len(kv.pool.cached) == 2
    r.num_computed_tokens = 4  # the plan for positions 4..7 was taken back before it ran
    kv.free(r)
    assert kv.get_computed_blocks(make_request("s", range(9)))[1] == 4


def test_reset_prefix_cache() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request("a", range(9))
    admit(kv, a)
    assert not kv.reset_prefix_cache()
    kv.free(a)
    assert kv.reset_prefix_cache()
    assert kv.get_computed_blocks(make_request("b", range(9)))[1] == 0
    assert kv.num_cached_free_blocks == 0


def chunked(kv: KVCacheManager, request: Request, chunk: int) -> None:
    """Prefill in chunks of `chunk` positions, as the scheduler does under a token budget."""
    while request.num_computed_tokens < request.num_tokens:
        n = min(chunk, request.num_tokens - request.num_computed_tokens)
        assert kv.allocate_slots(request, n)
        request.num_computed_tokens += n


def test_a_sliding_group_gives_back_what_falls_out_of_its_window_and_it_stays_hittable() -> None:
    # Group 0 full attention, group 1 a window of 6 positions; blocks of 4; chunks of 8.
    kv = KVCacheManager(num_blocks=40, block_size=4, windows=(0, 6), max_chunk_tokens=8)
    a = make_request("a", range(30))
    chunked(kv, a, 8)
    # The last chunk computed from position 24: its first query sees keys from 19 on, in block 4.
    assert len(kv.block_ids("a")) == 8 and kv_cache.NULL_BLOCK_ID not in kv.block_ids("a")[1:]
    window_table = kv.tables["a"][1]
    assert [b is None for b in window_table] == [True] * 4 + [False] * 4
    assert kv.block_ids("a", 1)[:4] == [kv_cache.NULL_BLOCK_ID] * 4
    assert kv.num_used_blocks == 8 + 4
    # The blocks given back are free but keep their hashes: the same prompt hits every full block of both groups.
    b = make_request("b", range(30))
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 28 and hits == kv.block_ids("a")[:7]
    assert kv.allocate_slots(b, 2, hits, num_hit)
    assert kv.block_ids("b", 1)[5:7] == kv.block_ids("a", 1)[5:7]  # the window before position 28, shared
    assert kv.block_ids("b", 1)[:5] == [kv_cache.NULL_BLOCK_ID] * 5
    kv.free(a)
    kv.free(b)
    assert set(kv.ref_counts()) == {0} and kv.num_free_blocks == 40


def test_a_hit_needs_the_window_before_it_in_every_sliding_group() -> None:
    kv = KVCacheManager(num_blocks=24, block_size=4, windows=(0, 6), max_chunk_tokens=8)
    a = make_request("a", range(30))
    chunked(kv, a, 8)
    window_block_5 = kv.tables["a"][1][5]
    kv.free(a)
    kv.pool.uncache(window_block_5)  # evicted: group 0 still holds all 7 full blocks of the prompt
    b = make_request("b", range(30))
    hits, num_hit = kv.get_computed_blocks(b)
    # A hit of 28 or 24 positions needs the window group's block 5 (keys from 23 or 19 on); one of 20 needs blocks
    # 3 and 4 only, which it kept (given back while a ran, still cached).
    assert num_hit == 20 and len(hits) == 5


def test_admission_counts_a_sliding_group_at_its_window_and_a_chunk() -> None:
    """A prompt much longer than the window is admitted when its full-attention blocks and one window fit: the
    sliding group's earlier chunks give their blocks back before the later ones need more."""
    kv = KVCacheManager(num_blocks=16, block_size=4, windows=(0, 4), max_chunk_tokens=4)
    long = make_request("long", range(40))  # 10 blocks of group 0; group 1 holds at most 4 + 4 positions: 3 blocks
    assert kv.can_fit(long, long.num_tokens)
    chunked(kv, long, 4)
    assert kv.num_used_blocks <= 10 + 3
    full = KVCacheManager(num_blocks=16, block_size=4, windows=(0, 0), max_chunk_tokens=4)
    assert not full.can_fit(make_request("long", range(40)), 40)  # 20 blocks without the window
