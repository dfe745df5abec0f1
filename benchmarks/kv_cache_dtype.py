"""`--kv-cache-dtype float16` against float32 on the default model: what the rounding of K and V costs, then speed.

Accuracy. The shipped prose (lmserve/bench/data/passages.txt) is scored in windows through lmserve's own forward pass,
fed in chunks of 16 tokens: every chunk follows cached positions, so the paged kernel reads every key and value of
the window back from the cache, as decodes do. Reported against the float32 cache: perplexity, the mean KL divergence
of the next-token distribution, and the share of positions where both pick the same top token. As a yardstick, the
same float32 model scoring each window in one prefill (SDPA over the chunk's own K/V, no cache reads): the spread
that batch shape alone already gives. Then greedy answers to a few chat prompts from the engine, each setting.

Speed. Two engines in one process, 16 requests of 256 random tokens each decoding, stepped in turns of 5 steps
(so that both see the same machine state): the median decode step of each.

    .venv/bin/python benchmarks/kv_cache_dtype.py [--window 512] [--skip-speed]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from quantization import CHAT_PROMPTS, passage_windows, scores_against

from lmserve import LLM, SamplingParams
from lmserve.config import CacheConfig, ModelConfig
from lmserve.step import ScheduledRequest
from lmserve.worker.model_runner import ModelRunner

CHUNK = 16  # the paged kernel's query tile: chunks of this size after cached positions run in the kernel


def window_logprobs(runner: ModelRunner, tokens: list[int], chunk: int) -> torch.Tensor:
    """log-softmax of the next-token distribution at every position of a window fed `chunk` tokens at a time."""
    blocks = list(range(-(-len(tokens) // runner.block_size)))
    out = []
    for start in range(0, len(tokens), chunk):
        piece = tokens[start : start + chunk]
        request = ScheduledRequest(
            request_id="score", token_ids=piece, start_position=start, block_ids=blocks, samples=True,
            sampling_params=SamplingParams(max_tokens=1), prompt_token_ids=tokens, output_token_ids=[],
        )
        batch = runner.prepare_inputs([request])
        with torch.inference_mode():
            hidden = runner.model(batch.input_ids, batch.positions, runner.kv_caches, batch.attn)
            out.append(torch.log_softmax(runner.model.compute_logits(hidden), dim=-1))
    return torch.cat(out)


def accuracy(window: int) -> dict:
    windows = passage_windows(LLM(enable_prefix_caching=False, num_blocks=64).input_processor, window)
    settings = {  # name: (cache dtype, chunk)
        "float32 cache": ("float32", CHUNK),
        "float16 cache": ("float16", CHUNK),
        "float32, one prefill per window": ("float32", window),
    }
    logprobs = {}
    for name, (dtype, chunk) in settings.items():
        runner = ModelRunner(ModelConfig(), CacheConfig(num_blocks=-(-window // 16), kv_cache_dtype=dtype))
        logprobs[name] = [window_logprobs(runner, w, chunk) for w in windows]
    report = {"positions": sum(len(w) - 1 for w in windows),
              "settings": {name: scores_against(windows, lps, logprobs["float32 cache"])
                           for name, lps in logprobs.items()}}
    answers = {}
    for dtype in ("float32", "float16"):
        engine = LLM(enable_prefix_caching=False, kv_cache_dtype=dtype)
        chats = [[{"role": "user", "content": p}] for p in CHAT_PROMPTS]
        outs = engine.chat(chats, SamplingParams(max_tokens=96, temperature=0))
        answers[dtype] = [o.outputs[0].token_ids for o in outs]
        del engine
    report["greedy_same"] = sum(a == b for a, b in zip(answers["float32"], answers["float16"], strict=True))
    report["greedy_first_difference"] = [
        next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        for a, b in zip(answers["float32"], answers["float16"], strict=True)
    ]
    return report


def speed(batch: int = 16, rounds: int = 30) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(1000, 49000, (batch, 256), generator=gen).tolist()
    engines = {dtype: LLM(max_num_seqs=batch, enable_prefix_caching=False, kv_cache_dtype=dtype)
               for dtype in ("float32", "float16")}
    params = SamplingParams(max_tokens=130, temperature=0, ignore_eos=True)

    def fill(llm: LLM) -> None:
        for p in prompts:
            llm._add(p, params, 0)
        while not (len(llm.engine.scheduler.running) == batch
                   and all(r.output_token_ids for r in llm.engine.scheduler.running)):
            llm._step()

    times: dict[str, list[float]] = {dtype: [] for dtype in engines}
    for llm in engines.values():
        fill(llm)
    for _ in range(rounds):
        for dtype, llm in engines.items():
            for _ in range(5):
                if not llm.engine.has_unfinished_requests():
                    fill(llm)
                started = time.perf_counter()
                llm._step()
                times[dtype].append(time.perf_counter() - started)
    return {dtype: statistics.median(t) * 1e3 for dtype, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--skip-speed", action="store_true")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    acc = accuracy(args.window)
    print(f"\nAccuracy over {acc['positions']} positions of passages.txt ({args.window}-token windows, fed "
          f"{CHUNK} tokens at a time unless said)\n")
    print("| setting | perplexity | mean KL vs float32 cache | same top token |\n|---|---|---|---|")
    for name, r in acc["settings"].items():
        print(f"| {name} | {r['perplexity']:.4f} | {r['kl']:.2e} | {100 * r['top1_same']:.2f}% |")
    print(f"\nGreedy chat answers (96 tokens) identical with either cache: {acc['greedy_same']} of "
          f"{len(CHAT_PROMPTS)}; first differing token: {acc['greedy_first_difference']}")
    if args.skip_speed:
        return
    found = speed()
    print("\n| engine decode step, 16 requests (ms) | float32 cache | float16 cache | ratio |\n|---|---|---|---|")
    print(f"| median | {found['float32']:.1f} | {found['float16']:.1f} | {found['float32'] / found['float16']:.2f}x |")


if __name__ == "__main__":
    main()
