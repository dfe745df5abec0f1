"""The two attention backends side by side: one attention layer, then the whole engine.

Layer: SmolLM2's attention shape (9 query heads over 3 KV heads of 64), a 4,096-block cache with each request's
blocks scattered through it, one `PagedAttention.forward` per call (K/V write included), median of 30 calls; the
paged kernel also over a float16 copy of the cache (`--kv-cache-dtype float16`). Also
the paged kernel on prefill chunks against SDPA (paged-cpu now sends every chunk to the kernel, for row invariance).

Steps: `ModelRunner.execute` on the default model for a fixed batch (decodes at a given context, or decodes beside a
prefill chunk), median of 10, for each pair of settings: sdpa without fused ops, paged-cpu, paged-cpu with fused ops.

Engine: `LLM` on the default model with each backend in turn: 64 requests of 256 random tokens / 128 output tokens
at 16 concurrent sequences (W1's shape), and one stream of 256 decode tokens after a 128-token prompt (W4's shape).

    .venv/bin/python benchmarks/paged_attention.py [--skip-steps] [--skip-engine] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from timing import median_ms

from lmserve import LLM, SamplingParams
from lmserve.worker.attention import PagedAttention, ScheduledChunk, build_metadata
from lmserve.worker.kernels import paged_attention_op, paged_keys_transposed

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
NUM_BLOCKS = 4096
# (label, [(query length, context length)]), decodes first as the runner orders them
LAYER_CASES = [
    ("1 decode at 400", [(1, 400)]),
    ("16 decodes at 300-375", [(1, 300 + 5 * i) for i in range(16)]),
    ("16 decodes at 1000-1075", [(1, 1000 + 5 * i) for i in range(16)]),
    ("4 decodes at 200 + 1 at 1500 (W3)", [(1, 200)] * 4 + [(1, 1500)]),
    ("4 decodes at 200 + 32-token chunk at 1450", [(1, 200)] * 4 + [(32, 1450)]),
    ("4 decodes at 330 + 16-token chunk at 1484 (W3, threshold 16)", [(1, 330)] * 4 + [(16, 1484)]),
]
CHUNK_CASES = [(8, 1484), (16, 1484), (16, 400), (32, 1450), (64, 1088), (256, 1280), (512, 2048)]


def layer_case(requests: list[tuple[int, int]], backend: str, caches) -> float:
    gen = torch.Generator().manual_seed(0)
    order = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    chunks, used = [], 0
    for q_len, ctx in requests:
        n = -(-ctx // BLOCK)
        chunks.append(ScheduledChunk(ctx - q_len, q_len, order[used : used + n]))
        used += n
    rows = sum(q for q, _ in requests)
    q, k, v = (torch.randn(rows, h, HEAD_DIM, generator=gen) for h in (HEADS, KV_HEADS, KV_HEADS))
    attn = PagedAttention(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)
    md = build_metadata(chunks, BLOCK, backend, torch.device("cpu"), torch.float32)
    return median_ms(lambda: attn.forward(q, k, v, *caches, md), 30)


def kernel_on_chunk(q_len: int, ctx: int, caches, kernel_keys) -> tuple[float, float]:
    """One chunk over a cached prefix: the paged kernel against block gather + SDPA (what the backends do)."""
    k_cache, v_cache = caches
    blocks = torch.randperm(NUM_BLOCKS)[: -(-ctx // BLOCK)]
    q = torch.randn(q_len, HEADS, HEAD_DIM)
    out = torch.empty_like(q)
    table, info = blocks.int()[None], torch.tensor([[0, q_len, ctx]])
    positions = torch.arange(ctx - q_len, ctx)[:, None]
    mask = torch.where(torch.arange(ctx)[None, :] <= positions, 0.0, float("-inf"))

    def sdpa() -> None:
        keys = k_cache.index_select(0, blocks).transpose(0, 1).reshape(KV_HEADS, -1, HEAD_DIM)[:, :ctx]
        values = v_cache.index_select(0, blocks).transpose(0, 1).reshape(KV_HEADS, -1, HEAD_DIM)[:, :ctx]
        F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None], values[None], attn_mask=mask,
                                       enable_gqa=True)

    kernel = paged_attention_op()
    return median_ms(lambda: kernel(out, q, kernel_keys, v_cache, table, info, HEAD_DIM**-0.5), 20), median_ms(sdpa, 20)


STEP_CASES = [  # (label, decodes, their context, prefill chunk length, chunk's context)
    ("16 decodes at 320", 16, 320, 0, 0),
    ("1 decode at 200", 1, 200, 0, 0),
    ("4 decodes at 200 + 32-token chunk at 1450", 4, 200, 32, 1450),
]
STEP_SETTINGS = [("sdpa", "none"), ("paged-cpu", "none"), ("paged-cpu", "cpu")]


def step_ms(runner, decodes: int, context: int, chunk: int, chunk_context: int) -> float:
    from lmserve.step import ScheduledRequest, SchedulerOutput

    def request(rid: str, start: int, length: int, first_block: int) -> ScheduledRequest:
        blocks = list(range(first_block, first_block + -(-(start + length) // runner.block_size)))
        return ScheduledRequest(request_id=rid, token_ids=[1000] * length, start_position=start, block_ids=blocks,
                                samples=True, sampling_params=SamplingParams(temperature=0),
                                prompt_token_ids=[1000] * (start + length), output_token_ids=[])

    span = -(-(max(context, chunk_context) + 1) // runner.block_size)
    batch = [request(str(i), context, 1, i * span) for i in range(decodes)]
    if chunk:
        batch.append(request("chunk", chunk_context - chunk, chunk, decodes * span))
    step = SchedulerOutput(scheduled=batch)
    return median_ms(lambda: runner.execute(step), 10)


def steps() -> None:
    from lmserve.config import CacheConfig, ModelConfig
    from lmserve.worker.model_runner import ModelRunner

    print("\n| engine step (ms) | " + " | ".join(f"{a}, fused ops {f}" for a, f in STEP_SETTINGS) + " |")
    print("|---|" + "---|" * len(STEP_SETTINGS))
    runners = [ModelRunner(ModelConfig(attention_backend=a, fused_ops=f), CacheConfig(num_blocks=2048))
               for a, f in STEP_SETTINGS]
    for label, *case in STEP_CASES:
        print(f"| {label} | " + " | ".join(f"{step_ms(r, *case):.0f}" for r in runners) + " |", flush=True)


def engine(backend: str, repeats: int) -> dict[str, float]:
    llm = LLM(attention_backend=backend, max_num_seqs=16, enable_prefix_caching=False)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(1000, llm.input_processor.vocab_size, (64, 256), generator=gen).tolist()
    single = torch.randint(1000, llm.input_processor.vocab_size, (128,), generator=gen).tolist()
    llm.generate(prompts[:4], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))  # warm-up
    batch, stream = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_tokens=128, temperature=0, ignore_eos=True))
        batch.append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - started))
        times = [time.perf_counter() for _ in llm.stream(single, SamplingParams(max_tokens=256, temperature=0,
                                                                                ignore_eos=True))]
        stream.append((len(times) - 1) / (times[-1] - times[0]))
    return {"batch": statistics.median(batch), "single": statistics.median(stream)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip-steps", action="store_true")
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    shape = (NUM_BLOCKS, KV_HEADS, BLOCK, HEAD_DIM)
    caches = (torch.randn(shape), torch.randn(shape))
    # attention.kv_cache_shapes("paged-cpu"): K transposed where the kernel is built for AVX-512
    paged_keys = caches[0].transpose(2, 3).contiguous() if paged_keys_transposed() else caches[0]
    paged_caches = (paged_keys, caches[1])
    half_caches = (paged_caches[0].half(), paged_caches[1].half())  # --kv-cache-dtype float16
    print("\n| one attention layer (ms) | sdpa | paged-cpu | ratio | paged-cpu, float16 cache | float32 / float16 |"
          "\n|---|---|---|---|---|---|")
    for label, requests in LAYER_CASES:
        sdpa, paged = layer_case(requests, "sdpa", caches), layer_case(requests, "paged-cpu", paged_caches)
        half = layer_case(requests, "paged-cpu", half_caches)
        print(f"| {label} | {sdpa:.3f} | {paged:.3f} | {sdpa / paged:.2f}x | {half:.3f} | {paged / half:.2f}x |")
    print("\n| prefill chunk over a cached prefix (ms) | gather + SDPA | paged kernel | kernel / SDPA |\n|---|---|---|---|")
    for q_len, ctx in CHUNK_CASES:
        kernel, sdpa = kernel_on_chunk(q_len, ctx, caches, paged_caches[0])
        print(f"| {q_len} queries at context {ctx} | {sdpa:.2f} | {kernel:.2f} | {kernel / sdpa:.2f}x |")
    if not args.skip_steps:
        steps()
    if args.skip_engine:
        return
    print("\n| engine, default model | W1 shape output tok/s | W4 shape decode tok/s |\n|---|---|---|")
    for backend in ("sdpa", "paged-cpu"):
        found = engine(backend, args.repeats)
        print(f"| {backend} | {found['batch']:.1f} | {found['single']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
