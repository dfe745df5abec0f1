"""Offline throughput of lmserve against transformers' generate, side by side in one run.

Workloads (issue 2): 64 prompts of 256 random tokens, 128 output tokens each, EOS ignored → output tokens/s;
one request (128-token prompt, 256 output tokens) → decode tokens/s. transformers.generate runs the same prompts
at batch 1 (a subset, it is slow) and batch 16. Prints a markdown table; paste it into docs/benchmarks.md.

    .venv/bin/python benchmarks/offline_throughput.py [--dtypes float32 bfloat16] [--hf]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

from lmserve import LLM, SamplingParams
from lmserve.models import load_hf_config, resolve_model
from lmserve.worker.weights.loader import load_weights

CORES = os.cpu_count() or 1


def random_prompts(vocab: int, count: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Skip the first ids: byte-level and special tokens make odd prompts.
    return torch.randint(1000, vocab, (count, length), generator=g).tolist()


def bench_lmserve(dtype: str, prompts: list[list[int]], single: list[int], repeats: int) -> dict:
    torch.set_num_threads(CORES)  # the float32 engine lowers it to 1 for itself (see ModelRunner)
    llm = LLM(dtype=dtype, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))  # warm-up
    rates, singles = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - started
        rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / elapsed)
        singles.append(single_stream_rate(llm, single))
    return {"throughput": statistics.median(rates), "single": statistics.median(singles)}


def single_stream_rate(llm: LLM, prompt: list[int]) -> float:
    params = SamplingParams(max_tokens=256, temperature=0, ignore_eos=True)
    first = last = None
    count = 0
    for delta in llm.stream(prompt, params):
        now = time.perf_counter()
        n = sum(len(o.token_ids) for o in delta.outputs)
        if n and first is None:
            first = now
            count = -1  # time from the first token on: decode only
        count += n
        last = now
    return count / (last - first)


def bench_transformers(prompts: list[list[int]], single: list[int], batch1_prompts: int) -> dict:
    from transformers import LlamaForCausalLM

    torch.set_num_threads(CORES)
    source = resolve_model("smollm2-135m-instruct")
    # The same dequantized weights as ours (transformers' own GGUF path needs accelerate and is slow).
    model = LlamaForCausalLM(load_hf_config(source))
    model.load_state_dict(dict(load_weights(source, torch.float32)), strict=False)
    model.tie_weights()
    model.eval()
    kwargs = {"do_sample": False, "max_new_tokens": 128, "min_new_tokens": 128, "pad_token_id": 0}
    with torch.inference_mode():
        started = time.perf_counter()
        for p in prompts[:batch1_prompts]:
            model.generate(torch.tensor([p]), **kwargs)
        batch1 = batch1_prompts * 128 / (time.perf_counter() - started)
        started = time.perf_counter()
        for i in range(0, len(prompts), 16):
            model.generate(torch.tensor(prompts[i : i + 16]), **kwargs)
        batch16 = len(prompts) * 128 / (time.perf_counter() - started)
        one = torch.tensor([single])
        model.generate(one, do_sample=False, max_new_tokens=1, pad_token_id=0)
        started = time.perf_counter()
        model.generate(one, do_sample=False, max_new_tokens=257, min_new_tokens=257, pad_token_id=0)
        t_257 = time.perf_counter() - started
        started = time.perf_counter()
        model.generate(one, do_sample=False, max_new_tokens=1, pad_token_id=0)
        t_1 = time.perf_counter() - started
    return {"batch1": batch1, "batch16": batch16, "single": 256 / (t_257 - t_1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hf", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--hf-batch1-prompts", type=int, default=4)
    args = parser.parse_args()

    prompts = random_prompts(49152, args.num_prompts, 256)
    single = random_prompts(49152, 1, 128, seed=1)[0]
    rows = []
    for dtype in args.dtypes:
        r = bench_lmserve(dtype, prompts, single, args.repeats)
        rows.append((f"lmserve {dtype}", r["throughput"], r["single"]))
    if args.hf:
        h = bench_transformers(prompts, single, args.hf_batch1_prompts)
        rows.append(("transformers generate fp32, batch 1", h["batch1"], h["single"]))
        rows.append(("transformers generate fp32, batch 16", h["batch16"], None))
    base = next((r[1] for r in rows if "batch 16" in r[0]), None)
    print(f"machine: {platform.machine()}, {CORES} cores, torch CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}; torch {torch.__version__}; python {platform.python_version()}; "
          f"{args.num_prompts} prompts")
    print(f"| engine | {args.num_prompts}×(256 in, 128 out) output tok/s | single stream decode tok/s | ratio to HF batch 16 |")
    print("|---|---|---|---|")
    for name, thr, one in rows:
        ratio = f"{thr / base:.2f}×" if base else "-"
        print(f"| {name} | {thr:.1f} | {'-' if one is None else f'{one:.1f}'} | {ratio} |")


if __name__ == "__main__":
    main()
