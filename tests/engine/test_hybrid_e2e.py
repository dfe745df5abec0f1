"""A hybrid linear-attention model end to end through the offline LLM: greedy tokens equal transformers' greedy
tokens, with prompts prefilled in chunks whose boundaries fall inside them, several requests sharing steps, and
preemptions (the victim's state slot freed, its state recomputed from position 0); afterwards no block and no state
slot is held."""

from __future__ import annotations

import functools

import pytest
import torch
import transformers

from lmserve import LLM, SamplingParams
from lmserve.engine.request import Request

PROMPT_LENGTHS = (5, 30, 51, 70)
MAX_TOKENS = 8


def prompts(vocab_size: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


@functools.cache
def transformers_model(directory) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


@functools.cache
@torch.no_grad()
def _transformers_greedy(directory, prompt: tuple[int, ...]) -> list[int]:
    model = transformers_model(directory)
    tokens = list(prompt)
    for _ in range(MAX_TOKENS):
        tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt) :]


def transformers_greedy(directory, prompt: list[int]) -> list[int]:
    """transformers' greedy tokens, one full forward per token (no cache of its own involved)."""
    return _transformers_greedy(directory, tuple(prompt))


def assert_nothing_held(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    kv = engine.scheduler.kv_cache_manager
    assert set(kv.ref_counts()) == {0} and not kv.tables
    assert kv.state_slots is not None and not kv.state_slots.owners
    assert kv.state_slots.num_free == kv.state_slots.num_slots


@pytest.mark.parametrize("num_blocks", [64, 12])  # 12 blocks of 16: the four requests cannot all hold theirs
def test_greedy_tokens_are_transformers_through_chunks_shared_steps_and_preemptions(hybrid_dirs,
                                                                                    num_blocks: int) -> None:
    """(Qwen3-Next's and Qwen3.5-MoE's layers are held to transformers in tests/worker/test_hybrid.py; the engine's
    part is the same for every family.)"""
    directory = hybrid_dirs["qwen3_5_text"]
    llm = LLM(model=str(directory), dtype="float32", kv_cache_dtype="float32", num_blocks=num_blocks, max_num_seqs=4,
              max_num_batched_tokens=32)
    assert not llm.engine.scheduler.kv_cache_manager.enable_prefix_caching
    token_prompts = prompts(llm.engine.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(token_prompts, params)
    got = [out.outputs[0].token_ids for out in outputs]
    expected = [transformers_greedy(directory, p) for p in token_prompts]
    assert got == expected
    assert (llm.engine.num_preemptions > 0) == (num_blocks == 12)
    assert_nothing_held(llm)


def test_an_abort_mid_prefill_frees_the_slot_and_the_next_request_starts_from_an_empty_state(hybrid_dirs) -> None:
    directory = hybrid_dirs["qwen3_5_text"]
    llm = LLM(model=str(directory), dtype="float32", kv_cache_dtype="float32", num_blocks=32, max_num_seqs=1,
              max_num_batched_tokens=16)
    first, second = prompts(llm.engine.vocab_size)[2:4]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm.engine.add_request(Request("aborted", first, params))
    llm.engine.step()  # its first chunk of 16 positions writes its slot's state
    llm.engine.abort_requests(["aborted"])
    assert llm.engine.scheduler.kv_cache_manager.state_slots.num_free == 1
    out = llm.generate([second], params)[0]
    assert out.outputs[0].token_ids == transformers_greedy(directory, second)
    assert_nothing_held(llm)
