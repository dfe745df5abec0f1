"""`--kv-cache-dtype` on the default model: float16 holds twice the blocks and gives the same greedy answer; auto
picks it on this CPU (paged-cpu kernel, F16C)."""

from __future__ import annotations

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
