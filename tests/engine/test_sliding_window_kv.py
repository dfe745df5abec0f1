"""Sliding-window layers hold only their window (lmserve.kv_groups): a tiny Gemma 3 (five local layers with a window
of 8 to one global layer) computes the same tokens with its local layers' blocks given back as without, in mixed
batches, chunks, preemptions and prefix hits, and holds a fraction of the blocks on a long request."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmserve import LLM, SamplingParams
from lmserve.engine.request import Request
from lmserve.kv_groups import kv_cache_groups

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
OPTIONS = {"dtype": "float32", "quantization": "none", "max_model_len": 256, "max_num_batched_tokens": 40}


def prompts() -> list[list[int]]:
    shared = list(range(300, 340))  # a prefix several requests share: prefix hits across groups
    return [shared + list(range(500 + 7 * i, 520 + 11 * i)) for i in range(4)] + [list(range(600, 700))]


def run(path: Path, **options) -> tuple[list[list[int]], dict]:
    with LLM(str(path), **OPTIONS, **options) as llm:
        first = llm.generate(prompts()[:1], GREEDY)  # caches the shared prefix for the batch after it
        outputs = first + llm.generate(prompts()[1:], GREEDY)
        stats = llm.engine.stats()
        kv = llm.engine.scheduler.kv_cache_manager
        assert set(kv.ref_counts()) == {0} and not kv.tables  # every block came back
        return [list(o.outputs[0].token_ids) for o in outputs], {
            "groups": kv.num_groups, "hits": stats.prefix_cache_hits, "preemptions": stats.num_preemptions,
            "drafted": stats.spec_decode_num_draft_tokens, "accepted": stats.spec_decode_num_accepted_tokens,
        }


@pytest.mark.parametrize("num_blocks", [None, 30], ids=["roomy", "tight"])
def test_local_layers_giving_blocks_back_change_no_token(tiny_gemma3_dir: Path, num_blocks: int | None) -> None:
    pool = {} if num_blocks is None else {"num_blocks": num_blocks}
    windowed, seen = run(tiny_gemma3_dir, **pool)
    held, _ = run(tiny_gemma3_dir, disable_hybrid_kv_cache_manager=True,
                  **({} if num_blocks is None else {"num_blocks": 60}))
    assert windowed == held
    assert seen["groups"] == 6 and seen["hits"] > 0  # the global layer's, and one per local layer
    if num_blocks is not None:
        assert seen["preemptions"] > 0, seen  # the tight pool preempts, and the tokens still agree


def test_a_long_request_holds_the_global_layer_and_one_window(tiny_gemma3_dir: Path) -> None:
    """Blocks held at position ~200 of one request: 13 blocks of all 6 layers without groups; with them (one layer a
    block) the global layer's 13 and each local layer's window and a chunk (8 + 40 positions: at most 4 blocks),
    so 78 layer-blocks become at most 33."""
    held = {}
    for hybrid in (True, False):
        with LLM(str(tiny_gemma3_dir), **OPTIONS, disable_hybrid_kv_cache_manager=not hybrid) as llm:
            engine = llm.engine
            engine.add_request(Request("long", list(range(100, 300)), SamplingParams(max_tokens=8, ignore_eos=True)))
            while engine.scheduler.requests["long"].num_computed_tokens < 200:
                engine.step()
            kv = engine.scheduler.kv_cache_manager
            held[hybrid] = (kv.num_used_blocks, engine.executor.info.kv_bytes_per_block)
            while engine.has_unfinished_requests():
                engine.step()
    (blocks, block_bytes), (blocks_all, block_bytes_all) = held[True], held[False]
    assert blocks_all == 13 and block_bytes_all == 6 * block_bytes
    assert 13 + 5 <= blocks <= 13 + 5 * 4, blocks
    assert blocks * block_bytes < blocks_all * block_bytes_all / 2


def test_groups_of_a_gemma_3_model() -> None:
    kinds = (["sliding_attention"] * 5 + ["full_attention"]) * 3  # Gemma 3 270M: 18 layers
    groups = kv_cache_groups(kinds, 512)
    assert groups.slots == 3 and groups.windows == (0, 512, 512, 512, 512, 512)
    assert [groups.layer_groups[i] for i in (5, 11, 17)] == [0, 0, 0]
    assert sorted(zip(groups.layer_groups, groups.layer_slots, strict=True)) == sorted(
        {(g, s) for g in range(6) for s in range(3)})  # every (group, slot) once: no layer shares a tensor's block
    # A 16k-token conversation, prefilled 2,048 positions at a time: blocks of 3 layers each.
    assert groups.request_blocks(16384, 16, 2048) == 1024 + 5 * 161  # 512 + 2,048 positions: 161 blocks
    assert kv_cache_groups(kinds, 512, hybrid=False).slots == 18
    assert kv_cache_groups(["sliding_attention"] * 4, 4096).windows == (4096,)  # Mistral v0.1: one windowed table
    assert kv_cache_groups(["full_attention"] * 4, None).windows == (0,)


@pytest.mark.parametrize("num_blocks", [None, 30], ids=["roomy", "tight"])
def test_drafted_positions_roll_back_in_every_group(tiny_gemma3_dir: Path, num_blocks: int | None) -> None:
    """Speculative decoding over local and global groups: drafts past a local window, rejected positions given back
    in each group's table, preemptions in the tight pool: the tokens of plain decoding, and every block back."""
    pool = {"num_blocks": num_blocks} if num_blocks else {}
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    plain, _ = run(tiny_gemma3_dir, **pool)
    drafted, seen = run(tiny_gemma3_dir, **pool, speculative_config=spec)
    assert drafted == plain
    assert seen["groups"] > 1 and seen["drafted"] > 0, seen
