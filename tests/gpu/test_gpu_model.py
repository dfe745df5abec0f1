"""On CUDA in bfloat16: the model builds on the device (llama3-scaled RoPE included), a mixed batch of prefill chunks
and decodes matches transformers, and --gpu-memory-utilization sizes the KV cache within its share of the device.

The bound: bfloat16 rounds, so ours is compared with transformers in float32 and must be no further from it than
transformers' own bfloat16 run is, with a factor of 2 and a floor of BF16_FLOOR for tiny logits."""

from __future__ import annotations

import gc
from dataclasses import replace

import pytest
import torch
import transformers

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from lmserve.config import KV_BLOCK_SIZE, CacheConfig, ModelConfig, SchedulerConfig
from lmserve.sampling_params import SamplingParams
from lmserve.step import ScheduledRequest
from lmserve.worker.model_runner import ModelRunner

CUDA = torch.device("cuda")
BLOCK_SIZE = KV_BLOCK_SIZE
BF16_FLOOR = 2e-2
MODELS = ["tiny_llama_dir", "tiny_llama3_dir", "tiny_qwen2_dir"]  # default rope, llama3-scaled rope, tied + biases


def runner_for(path, **cache) -> ModelRunner:
    return ModelRunner(
        ModelConfig(model=str(path), device="cuda", dtype="bfloat16", max_model_len=256),
        CacheConfig(block_size=BLOCK_SIZE, **({"num_blocks": 32} | cache)),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=16),
    )


def scheduled(rid: str, seq: list[int], start: int, end: int, blocks: list[int]) -> ScheduledRequest:
    return ScheduledRequest(
        request_id=rid, token_ids=seq[start:end], start_position=start, block_ids=blocks, samples=True,
        sampling_params=SamplingParams(temperature=0.0), prompt_token_ids=seq[:end], output_token_ids=[],
    )


def run(runner: ModelRunner, batch: list[ScheduledRequest]) -> dict[str, torch.Tensor]:
    """Logits of every scheduled position, per request (rows attributed through the slot mapping)."""
    inputs = runner.prepare_inputs(batch)
    inputs = replace(inputs, logits_indices=torch.arange(inputs.input_ids.shape[0], device=CUDA))
    logits = runner.forward(inputs)
    blocks = (inputs.attn.slot_mapping // BLOCK_SIZE).tolist()
    owner = {b: s.request_id for s in batch for b in s.block_ids}
    return {s.request_id: logits[[i for i, b in enumerate(blocks) if owner[b] == s.request_id]] for s in batch}


@pytest.mark.parametrize("fixture", MODELS)
def test_everything_is_on_the_device(request, fixture: str) -> None:
    runner = runner_for(request.getfixturevalue(fixture))
    for name, tensor in [*runner.model.named_parameters(), *runner.model.named_buffers()]:
        assert (tensor.device.type, tensor.dtype) == ("cuda", torch.bfloat16), name
    for table in (runner.model.rotary["full_attention"].cos, runner.model.rotary["full_attention"].sin):
        assert (table.device.type, table.dtype) == ("cuda", torch.float32)
    assert all(k.device.type == "cuda" for pair in runner.kv_caches for k in pair)


@pytest.mark.parametrize("fixture", MODELS)
@torch.no_grad()
def test_bf16_mixed_batch_matches_transformers(request, fixture: str) -> None:
    path = request.getfixturevalue(fixture)
    runner = runner_for(path)
    hf32 = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(CUDA).eval()
    hf16 = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(CUDA).eval()
    gen = torch.Generator().manual_seed(0)
    # b crosses the llama3 fixture's 64-position original context.
    seqs = {rid: torch.randint(0, runner.vocab_size, (n,), generator=gen).tolist()
            for rid, n in (("a", 23), ("b", 75), ("c", 9))}
    expected, own_error = {}, 0.0
    for rid, seq in seqs.items():
        ids = torch.tensor([seq], device=CUDA)
        expected[rid] = hf32(ids).logits[0].float()
        own_error = max(own_error, (hf16(ids).logits[0].float() - expected[rid]).abs().max().item())
    bound = max(2 * own_error, BF16_FLOOR)
    blocks = {"a": [11, 3], "b": [6, 25, 1, 30, 2], "c": [20]}
    plan = [
        [("a", 0, 20), ("b", 0, 17)],  # two first chunks
        [("a", 20, 21), ("b", 17, 70), ("c", 0, 7)],  # a decode, a chunk over cached positions, a new prompt
        [("a", 21, 22), ("b", 70, 71), ("c", 7, 8)],  # decodes of different context lengths
        [("c", 8, 9), ("b", 71, 73), ("a", 22, 23)],  # decodes and a 2-position chunk
        [("b", 73, 74)],
        [("b", 74, 75)],
    ]
    worst = 0.0
    for step, entries in enumerate(plan):
        out = run(runner, [scheduled(rid, seqs[rid], s, e, blocks[rid]) for rid, s, e in entries])
        for rid, s, e in entries:
            error = (out[rid] - expected[rid][s:e]).abs().max().item()
            assert error <= bound, f"{fixture} step {step} request {rid}: {error:.3g} > {bound:.3g}"
            worst = max(worst, error)
    print(f"\n{fixture} bf16 on cuda: max abs logit error {worst:.3g} (transformers' own bf16: {own_error:.3g})")


def test_gpu_memory_utilization_sizes_the_cache_within_its_share(tiny_llama_dir) -> None:
    gc.collect()  # earlier tests' runners and references: the share counts everything this process holds
    torch.cuda.empty_cache()
    total = torch.cuda.mem_get_info()[1]
    small = runner_for(tiny_llama_dir, num_blocks=None, gpu_memory_utilization=0.02)
    kv_bytes = small.num_blocks * small.kv_bytes_per_block
    assert kv_bytes <= 0.02 * total and kv_bytes > 0.015 * total, (kv_bytes, total)
    assert torch.cuda.memory_allocated() <= 0.02 * total * 1.01
    del small
    larger = runner_for(tiny_llama_dir, num_blocks=None, gpu_memory_utilization=0.04)
    assert larger.num_blocks > 1.9 * (kv_bytes // larger.kv_bytes_per_block)
    del larger
    explicit = runner_for(tiny_llama_dir, num_blocks=None, kv_cache_memory="64MiB")
    assert explicit.num_blocks == (64 << 20) // explicit.kv_bytes_per_block
    del explicit
    with pytest.raises(ValueError, match="no KV-cache block fits"):
        runner_for(tiny_llama_dir, num_blocks=None, gpu_memory_utilization=1e-9)
