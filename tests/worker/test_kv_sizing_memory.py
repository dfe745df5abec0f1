"""KV-cache sizing: vLLM's --gpu-memory-utilization arithmetic, which setting wins where, and the profiling step that
measures the peak on CUDA (run here on the CPU: the same dummy batch, without torch.cuda's counters)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from lmserve.config import CacheConfig, add_engine_args, engine_kwargs, make_engine_config
from lmserve.config_values import GiB
from lmserve.kv_sizing import kv_blocks_for_memory_utilization
from lmserve.models import load_hf_config, resolve_model
from lmserve.worker.memory import DeviceMemory, num_kv_blocks, profiling_batch_lengths, profiling_step
from lmserve.worker.model_builder import build_model
from lmserve.worker.weights.loader import load_weights

MiB = 1 << 20
CUDA, CPU = torch.device("cuda"), torch.device("cpu")  # a device object needs no GPU


def test_utilization_is_a_fraction_of_the_whole_device() -> None:
    # 80 GiB at 0.9 is 72 GiB; weights and peak activations take 16 GiB: 56 GiB of 2 MiB blocks.
    assert kv_blocks_for_memory_utilization(80 * GiB, 0.9, 16 * GiB, 2 * MiB) == 56 * 512
    # Half the device: 40 - 16 = 24 GiB.
    assert kv_blocks_for_memory_utilization(80 * GiB, 0.5, 16 * GiB, 2 * MiB) == 24 * 512
    # Whole blocks only: one byte short of a block is one block fewer.
    assert kv_blocks_for_memory_utilization(10 * MiB, 1.0, 4 * MiB - 1, 2 * MiB) == 3
    # Free memory bounds it only when the budget exceeds it.
    assert kv_blocks_for_memory_utilization(80 * GiB, 0.9, 16 * GiB, 2 * MiB, free_bytes=60 * GiB) == 56 * 512


def test_no_block_fits_is_refused_with_the_numbers() -> None:
    with pytest.raises(ValueError, match=r"no KV-cache block fits.*0\.5.*raise --gpu-memory-utilization"):
        kv_blocks_for_memory_utilization(32 * GiB, 0.5, 16 * GiB, 2 * MiB)
    with pytest.raises(ValueError, match="no KV-cache block fits"):  # weights alone above the share
        kv_blocks_for_memory_utilization(32 * GiB, 0.3, 16 * GiB, 2 * MiB)


def test_more_than_is_free_is_refused() -> None:
    """Another process holding memory: vLLM refuses rather than promising memory that is not there."""
    with pytest.raises(ValueError, match="only 10.00 GiB .* are free"):
        kv_blocks_for_memory_utilization(80 * GiB, 0.9, 16 * GiB, 2 * MiB, free_bytes=10 * GiB)


def never_measured() -> DeviceMemory:
    raise AssertionError("measured the device where no measurement was due")


def test_which_setting_wins_where() -> None:
    per_block = 1 * MiB
    measured = DeviceMemory(total_bytes=100 * GiB, used_bytes=10 * GiB, free_bytes=85 * GiB)
    # CUDA, nothing explicit: the utilization of the measured device (0.9 by default).
    assert num_kv_blocks(CacheConfig(), per_block, CUDA, lambda: measured) == 80 * 1024
    assert num_kv_blocks(CacheConfig(gpu_memory_utilization=0.5), per_block, CUDA, lambda: measured) == 40 * 1024
    # An explicit --kv-cache-memory wins everywhere, and nothing is measured.
    assert num_kv_blocks(CacheConfig(kv_cache_memory=64 * MiB), per_block, CUDA, never_measured) == 64
    assert num_kv_blocks(CacheConfig(kv_cache_memory="64MiB"), per_block, CPU, never_measured) == 64
    # CPU: 2 GiB by default; the utilization does not apply.
    assert num_kv_blocks(CacheConfig(gpu_memory_utilization=0.1), per_block, CPU, never_measured) == 2048
    # Tests' num_blocks above all.
    assert num_kv_blocks(CacheConfig(num_blocks=7), per_block, CUDA, never_measured) == 7
    # CPU default: never more than max_num_seqs full-length requests can hold; an explicit size is taken as said.
    assert num_kv_blocks(CacheConfig(), per_block, CPU, never_measured, most_blocks_usable=300) == 300
    assert num_kv_blocks(CacheConfig(), per_block, CPU, never_measured, most_blocks_usable=10**6) == 2048
    assert num_kv_blocks(CacheConfig(kv_cache_memory="1GiB"), per_block, CPU, never_measured,
                         most_blocks_usable=300) == 1024
    with pytest.raises(ValueError, match="kv_cache_memory too small"):
        num_kv_blocks(CacheConfig(kv_cache_memory=1000), per_block, CPU, never_measured)


def test_gpu_memory_utilization_setting() -> None:
    assert make_engine_config().cache.gpu_memory_utilization == 0.9
    assert make_engine_config(gpu_memory_utilization=0.5).cache.gpu_memory_utilization == 0.5
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
            CacheConfig(gpu_memory_utilization=bad)


def test_the_flag_parses() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--gpu-memory-utilization", "0.75"])
    assert make_engine_config(**engine_kwargs(args)).cache.gpu_memory_utilization == 0.75


def test_profiling_batch_is_the_largest_step() -> None:
    assert profiling_batch_lengths(2048, 4096) == [2048]
    assert profiling_batch_lengths(2048, 512) == [512] * 4
    assert profiling_batch_lengths(1000, 300) == [300, 300, 300, 100]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_profiling_step_runs_the_model_on_a_full_step(tiny_llama3_dir, dtype) -> None:
    """The dummy step that measures the CUDA peak is a well-formed batch for the real model (run here on the CPU):
    several requests when the step is longer than the context, logits and a softmax for the sampled rows."""
    source = resolve_model(str(tiny_llama3_dir))
    model = build_model(load_hf_config(source), 128, CPU, dtype)
    model.load_weights(load_weights(source, dtype))
    probs = profiling_step(model, num_tokens=300, max_model_len=128, num_sampled=64, block_size=16,
                           attention_backend="sdpa", kv_cache_dtype=dtype)
    assert probs.shape == (64, model.config.vocab_size) and probs.dtype == torch.float32
    assert torch.isfinite(probs).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(64))


@pytest.mark.parametrize("rank", [0, 1])
def test_profiling_step_runs_each_pipeline_stage_alone(tiny_llama3_dir, rank: int) -> None:
    """A pipeline stage profiles on its own, as each rank sizes its cache before any stage talks to another: the
    first stage from the embedding, the last from zeros standing for what it would receive (it used to look the
    token ids up in an embedding only the first stage has, so `-pp` on CUDA failed at start-up)."""
    from lmserve.distributed.layout import RankLayout
    from lmserve.distributed.parallel_state import ParallelGroups

    source = resolve_model(str(tiny_llama3_dir))
    config = load_hf_config(source)
    model = build_model(config, 128, CPU, torch.float32, parallel=ParallelGroups(RankLayout(rank, pp_size=2)))
    model.load_weights(load_weights(source, torch.float32))
    out = profiling_step(model, num_tokens=40, max_model_len=128, num_sampled=8, block_size=16,
                         attention_backend="sdpa", kv_cache_dtype=torch.float32)
    if rank == 0:  # what it sends on: one row of hidden states per position
        assert out.shape == (40, config.hidden_size)
    else:
        assert out.shape == (8, config.vocab_size)
    assert torch.isfinite(out).all()


def resident_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_the_kv_cache_takes_memory_only_as_its_blocks_are_written(tiny_llama_dir) -> None:
    """A 1 GiB cache costs the process (almost) nothing until used: its pages come from calloc, not from zeros
    written one by one; and it reads as zeros."""
    from lmserve.config import ModelConfig
    from lmserve.worker.model_runner import ModelRunner

    before = resident_bytes()
    runner = ModelRunner(ModelConfig(model=str(tiny_llama_dir), device="cpu"), CacheConfig(kv_cache_memory="1GiB"))
    allocated = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in runner.kv_caches)
    assert allocated > 0.9 * GiB
    assert resident_bytes() - before < 256 * MiB
    key_cache = runner.kv_caches[0][0]
    assert not key_cache[:: max(1, key_cache.shape[0] // 64)].any()  # zeros, where sampled
    key_cache[-1].fill_(1.0)  # written pages become resident and hold what was written
    assert bool(key_cache[-1].eq(1.0).all())
