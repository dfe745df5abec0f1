"""`--kv-cache-dtype float16` on the default model: half the bytes per block, the same greedy answer."""

from __future__ import annotations

import torch

from lmserve import LLM, SamplingParams
from lmserve.cli import build_parser, engine_kwargs


def test_float16_cache_holds_twice_the_blocks_and_answers_alike() -> None:
    prompt = torch.randint(1000, 49152, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    runs = {}
    for dtype in ("float32", "float16"):
        llm = LLM(kv_cache_memory="64MiB", kv_cache_dtype=dtype, enable_prefix_caching=False)
        runner = llm.engine.runner
        assert runner.kv_caches[0][0].dtype == getattr(torch, dtype)
        runs[dtype] = (runner.num_blocks, llm.generate([prompt], params)[0].outputs[0].token_ids)
    assert runs["float16"][0] == 2 * runs["float32"][0]
    assert runs["float16"][1] == runs["float32"][1]


def test_the_flag_reaches_the_engine_config() -> None:
    args = build_parser().parse_args(["serve", "--kv-cache-dtype", "float16"])
    assert engine_kwargs(args)["kv_cache_dtype"] == "float16"
