"""`--kv-cache-dtype` on the default model: float16 holds twice the blocks and gives the same greedy answer; auto
picks it on this CPU (paged-cpu kernel, F16C)."""

from __future__ import annotations

import pytest
import torch

from lmserve import LLM, SamplingParams
from lmserve.cli import build_parser, engine_kwargs
from lmserve.worker.kernels import cpu_flags


def test_float16_cache_holds_twice_the_blocks_and_answers_alike() -> None:
    prompt = torch.randint(1000, 49152, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    runs = {}
    for dtype in ("float32", "float16", "auto"):
        llm = LLM(kv_cache_memory="64MiB", kv_cache_dtype=dtype, enable_prefix_caching=False)
        runner = llm.engine.executor.runner
        runs[dtype] = (runner.kv_caches[0][0].dtype, runner.num_blocks,
                       llm.generate([prompt], params)[0].outputs[0].token_ids)
    assert runs["float32"][0] == torch.float32 and runs["float16"][0] == torch.float16
    assert runs["float16"][1] == 2 * runs["float32"][1]
    assert runs["float16"][2] == runs["float32"][2]
    assert runs["auto"] == (runs["float16"] if "f16c" in cpu_flags() else runs["float32"])


def test_the_flag_reaches_the_engine_config() -> None:
    args = build_parser().parse_args(["serve", "--kv-cache-dtype", "float16"])
    assert engine_kwargs(args)["kv_cache_dtype"] == "float16"


def prompt_logprobs(output) -> list[float]:
    return [e.logprob for e in output.prompt_logprobs[1:]]


def test_int8_cache_holds_1_9x_the_blocks_of_float16_and_scores_alike() -> None:
    """int8 takes 68 bytes per kv head's row of 64 values where float16 takes 128. Not only greedy tokens: every
    prompt position's logprob of this random prompt stays within 0.3 of the float16 cache's, 0.05 on average (int8's
    rounding moved them by up to 0.15 here)."""
    prompt = torch.randint(1000, 49152, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, prompt_logprobs=0)
    runs = {}
    for dtype in ("float16", "int8", "fp8"):
        llm = LLM(kv_cache_memory="64MiB", kv_cache_dtype=dtype, enable_prefix_caching=False)
        runner = llm.engine.executor.runner
        out = llm.generate([prompt], params)[0]
        runs[dtype] = (runner.kv_caches[0][0].dtype, runner.num_blocks, out.outputs[0].token_ids, prompt_logprobs(out))
    assert runs["int8"][0] == torch.int8 and runs["int8"][:3] == runs["fp8"][:3]  # vLLM's fp8 is stored as int8
    assert runs["int8"][1] == (64 << 20) // (30 * 2 * 3 * 16 * 68)  # 30 layers, K and V, 3 kv heads, 16 positions
    assert abs(runs["int8"][1] - runs["float16"][1] * 128 / 68) <= 1
    differences = torch.tensor(runs["int8"][3]) - torch.tensor(runs["float16"][3])
    assert differences.abs().max() < 0.3 and 0 < differences.abs().mean() < 0.05
    assert runs["int8"][2][:8] == runs["float16"][2][:8]


def logprobs_of(output) -> list[float]:
    return [e.logprob for e in output.outputs[0].logprobs]


@pytest.mark.parametrize("backend", ["paged-cpu", "sdpa"])
def test_int8_prefix_hit_and_recompute_after_preemption_match_a_fresh_run(backend: str) -> None:
    """A prompt whose blocks come from the prefix cache (their int8 values and scales) gives the fresh run's tokens
    and logprobs, bit for bit under paged-cpu (SDPA's sums follow a chunk's length: there to 2e-2); so do requests
    preempted out of a 4-block pool and recomputed."""

    def same_logprobs(a, b) -> None:
        if backend == "paged-cpu":
            assert logprobs_of(a) == logprobs_of(b)
        else:
            # A row computed in another chunk shape differs by float32 noise, and a value next to an int8 rounding
            # boundary then lands one step (a 1/127 of its group's largest) away: logprobs moved by up to 5e-3 here.
            torch.testing.assert_close(torch.tensor(logprobs_of(a)), torch.tensor(logprobs_of(b)), atol=2e-2, rtol=0)

    prompts = [
        ("The three laws of thermodynamics state that energy cannot be created or destroyed, that the entropy of an "
         "isolated system never decreases, and that"),
        "Once upon a time, in a small village by the sea, there lived an old fisherman who",
        'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    ]
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=0)
    llm = LLM(dtype="float32", kv_cache_dtype="int8", attention_backend=backend, num_blocks=64)
    assert llm.engine.executor.runner.kv_caches[0][0].dtype == torch.int8
    fresh = [llm.generate(p, params)[0] for p in prompts]
    assert llm.engine.scheduler.kv_cache_manager.reset_prefix_cache()
    (first,) = llm.generate(prompts[0], params)
    (hit,) = llm.generate(prompts[0], params)
    assert first.num_cached_tokens == 0 and hit.num_cached_tokens == (len(hit.prompt_token_ids) - 1) // 16 * 16 > 0
    assert hit.outputs[0].token_ids == fresh[0].outputs[0].token_ids
    same_logprobs(hit, fresh[0])
    del llm
    tiny = LLM(dtype="float32", kv_cache_dtype="int8", attention_backend=backend, num_blocks=4)
    outputs = tiny.generate(prompts, [params] * len(prompts))
    assert tiny.engine.num_preemptions > 0, "the tiny pool was expected to force preemptions"
    for out, alone in zip(outputs, fresh, strict=True):
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
        same_logprobs(out, alone)


def test_a_bad_kv_cache_dtype_is_refused_naming_the_choices(capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-cache-dtype", "int4"])
    assert "invalid choice: 'int4'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown KV cache dtype 'int4'.*int8"):
        LLM(kv_cache_dtype="int4", num_blocks=8)
    args = build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8_e4m3"])
    assert engine_kwargs(args)["kv_cache_dtype"] == "fp8_e4m3"
