"""Hybrid linear-attention models (Qwen3.5 dense, Qwen3.5-MoE, Qwen3-Next) through the real ModelRunner match
transformers on the same weights: a prompt in chunks whose boundaries fall inside it (each chunk starting from the
state the one before left), then decodes; mixed batches where decodes and prefill chunks share a step. Each request
has its own state slot, as the engine hands them out.

The checks are test_model_parity's (each row's logits against one full transformers forward), on both kernel sets.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from hybrid_models import HYBRID_FAMILIES
from test_model_parity import KERNELS, TINY_ATOL, Parity, chunked_prefill_then_decode, mixed_batch, scheduled

from lmserve.config import CacheConfig, ModelConfig, SchedulerConfig
from lmserve.kv_transfer_config import parse_kv_transfer_config
from lmserve.models import load_hf_config, resolve_model
from lmserve.speculative_config import parse_speculative_config
from lmserve.worker.model_runner import ModelRunner
from lmserve.worker.models.hybrid import HybridForCausalLM

SLOTS = {"a": 0, "b": 1, "c": 2}


class HybridParity(Parity):
    """Parity whose requests carry a state slot each (the engine's part: engine/kv_cache.py)."""

    def run(self, batch):
        for s in batch:
            s.state_slot = SLOTS[s.request_id]
        return super().run(batch)


@pytest.mark.parametrize("kernels", list(KERNELS))
@pytest.mark.parametrize("family", list(HYBRID_FAMILIES))
def test_a_hybrid_model_matches_transformers(hybrid_dirs, family: str, kernels: str) -> None:
    p = HybridParity(hybrid_dirs[family], max_model_len=256, num_blocks=32, atol=TINY_ATOL, kernels=kernels)
    model = p.runner.model
    assert isinstance(model, HybridForCausalLM)
    assert model.linear_layers == [0, 1, 2] and model.attention_layers == [3]
    assert len(p.runner.kv_caches) == 1  # K/V for the full-attention layer only
    assert bool(model.moe_blocks()) == (family != "qwen3_5_text")
    error, scale = chunked_prefill_then_decode(p, p.sequence(76, 0), split=29, prompt_len=70,
                                               blocks=[9, 0, 17, 4, 30])
    print(f"\n{p.name}: chunked prefill + decode, max abs logit error {error:.3g} (max |logit| {scale:.3g})")
    error, scale = mixed_batch(p, {"a": [11, 3], "b": [6, 25, 1], "c": [20]})
    print(f"\n{p.name}: mixed batch, max abs logit error {error:.3g} (max |logit| {scale:.3g})")


def test_a_chunk_longer_than_the_delta_rules_inner_chunk_and_a_one_token_prompt(hybrid_dirs) -> None:
    """A prefill chunk of 100 positions (two of the chunked form's 64-position chunks, the state carried between
    them), its continuation, decodes; and a one-token prompt, which the runner lays out as a decode row that starts
    from an empty state, beside another request's decode."""
    p = HybridParity(hybrid_dirs["qwen3_5_text"], max_model_len=256, num_blocks=32, atol=TINY_ATOL)
    chunked_prefill_then_decode(p, p.sequence(160, 4), split=100, prompt_len=157,
                                blocks=list(range(10)))
    seq_b, seq_c = p.sequence(8, 5), p.sequence(3, 6)
    expected_b, expected_c = p.reference_logits(seq_b), p.reference_logits(seq_c)
    p.run([scheduled("b", seq_b, 0, 7, [10])])
    out = p.run([scheduled("b", seq_b, 7, 8, [10]), scheduled("c", seq_c, 0, 1, [11])])  # two decode rows
    p.check(out["b"][1], expected_b[out["b"][0]], "decode beside a one-token prompt")
    p.check(out["c"][1], expected_c[out["c"][0]], "one-token prompt")
    for step in (1, 2):
        out = p.run([scheduled("c", seq_c, step, step + 1, [11])])
        p.check(out["c"][1], expected_c[out["c"][0]], f"its decode {step}")


def test_a_rows_result_does_not_depend_on_its_batch(hybrid_dirs) -> None:
    """The same decode alone and beside a prefill chunk and another decode: the same logits to float32 rounding of
    the shared matmuls (the linear layers' state updates are each row's own)."""
    p = HybridParity(hybrid_dirs["qwen3_next"], max_model_len=256, num_blocks=32, atol=TINY_ATOL)
    seq_a, seq_b, seq_c = p.sequence(30, 7), p.sequence(20, 8), p.sequence(40, 9)
    results = []
    for others in (False, True):
        p.run([scheduled("a", seq_a, 0, 29, [0, 1])])
        batch = [scheduled("a", seq_a, 29, 30, [0, 1])]
        if others:
            p.run([scheduled("b", seq_b, 0, 19, [2, 3])])
            batch += [scheduled("b", seq_b, 19, 20, [2, 3]), scheduled("c", seq_c, 0, 40, [4, 5, 6])]
        results.append(p.run(batch)["a"][1])
    assert (results[0] - results[1]).abs().max().item() < 1e-6


def test_a_multimodal_checkpoint_is_refused_with_a_clear_error(hybrid_dirs, tmp_path) -> None:
    directory = tmp_path / "qwen3_5_vl"
    shutil.copytree(hybrid_dirs["qwen3_5_text"], directory)
    config = json.loads((directory / "config.json").read_text())
    config.update(model_type="qwen3_5", architectures=["Qwen3_5ForConditionalGeneration"])
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="vision tower.*Qwen3_5ForConditionalGeneration.*text-only"):
        load_hf_config(resolve_model(str(directory)))


def test_speculative_decoding_is_refused_for_a_hybrid_model(hybrid_dirs) -> None:
    with pytest.raises(ValueError, match="speculative decoding is not supported for qwen3_5_text"):
        ModelRunner(ModelConfig(model=str(hybrid_dirs["qwen3_5_text"]), dtype="float32", device="cpu"),
                    CacheConfig(num_blocks=8),
                    scheduler_config=SchedulerConfig(speculative_config=parse_speculative_config(
                        '{"method": "ngram", "num_speculative_tokens": 2}')))


@pytest.mark.parametrize(("memory", "slots"), [("1MiB", 4), ("48KiB", 2)])
def test_the_state_slots_are_paid_from_the_kv_memory_budget(hybrid_dirs, memory: str, slots: int) -> None:
    """One slot per --max-num-seqs request, or where they would take more than half the budget, what half holds."""
    runner = ModelRunner(ModelConfig(model=str(hybrid_dirs["qwen3_5_text"]), dtype="float32", device="cpu"),
                         CacheConfig(kv_cache_memory=memory, kv_cache_dtype="float32"),
                         scheduler_config=SchedulerConfig(max_num_seqs=4))
    per_slot = 3 * 4 * (96 * 3 + 4 * 16 * 8)  # 3 linear layers: conv (96 channels x 3) + state (4 heads x 16 x 8)
    assert runner.num_state_slots == slots and runner.state_bytes_per_slot == per_slot
    assert runner.model.states.recurrent.shape == (3, slots, 4, 16, 8)
    budget = 2**20 if memory == "1MiB" else 48 * 2**10
    assert runner.num_blocks == (budget - slots * per_slot) // runner.kv_bytes_per_block
    assert torch.count_nonzero(runner.model.states.conv) == 0


def test_kv_transfer_is_refused_for_a_hybrid_model(hybrid_dirs, tmp_path) -> None:
    """A consumer would start a request from stored blocks without the linear layers' state."""
    transfer = parse_kv_transfer_config(json.dumps({
        "kv_connector": "SharedStorageConnector", "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}}))
    with pytest.raises(ValueError, match="kv transfer is not supported for qwen3_next"):
        ModelRunner(ModelConfig(model=str(hybrid_dirs["qwen3_next"]), dtype="float32", device="cpu"),
                    CacheConfig(num_blocks=8, kv_transfer_config=transfer))
