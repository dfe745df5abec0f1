"""What `--kv-cache-dtype int8` costs in accuracy on a real file, beside llama.cpp's q8_0 cache on the same file and
text (issue 75). Accuracy only: run by hand, results in docs/benchmarks.md.

lmserve: the text's tokens (Debian's GPL-3 by default) cut into chunks of --ctx (512) as llama-perplexity cuts them
(benchmarks/perplexity_peers.py), each chunk one prompt through lmserve's own forward pass with a KV cache of each
dtype; the paged-cpu kernel reads every key and value back from the cache (a prompt's rows included), so each chunk's
logits saw int8 K and V everywhere. Scored as llama-perplexity scores: the second half of each chunk. Reported against
the float16 cache (auto's choice for these files on a CPU with F16C): perplexity and its change, the mean and 99th
percentile KL divergence of the next-token distribution, and the share of positions whose top token is the same.
float32 is the float16 cache's own reference.

llama.cpp: `llama-perplexity -fa on` with its f16 cache (saving its logits, --kl-divergence-base) and then with
`-ctk q8_0 -ctv q8_0` (--kl-divergence against them): the same measures for its 8-bit cache.

`--formats N`: instead, which rounding of K and V costs what, over N chunks: the model runs under sdpa with a float32
cache, and each layer's new K and V are rounded to a candidate format before attention sees them (the cache's int8
rows as groups of 32, 16 or 8 values; K only; K with a scale per channel over each block of 16 positions, as KIVI).

    .venv/bin/python benchmarks/kv_cache_int8.py [MODEL.gguf] [--ctx 512] [--chunks 15] [--llama-perplexity PATH]
    .venv/bin/python benchmarks/kv_cache_int8.py [MODEL.gguf] --formats 1
"""

from __future__ import annotations

import argparse
import math
import re
import subprocess
import tempfile
from pathlib import Path

import torch
from perplexity_peers import LLAMA_PERPLEXITY, text_chunks

from lmserve.config import CacheConfig, ModelConfig
from lmserve.model_tokenizer import load_tokenizer
from lmserve.models import resolve_model
from lmserve.sampling_params import SamplingParams
from lmserve.step import ScheduledRequest
from lmserve.worker.model_runner import ModelRunner

DEFAULT_MODEL = Path.home() / ".cache/lmserve/real-models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
CACHES = ("float32", "float16", "int8")
BASE = "float16"


def chunk_logprobs(runner: ModelRunner, tokens: list[int]) -> torch.Tensor:
    """log-softmax of the next-token distribution at every position of one chunk, fed as one prompt."""
    blocks = list(range(-(-len(tokens) // runner.block_size)))
    request = ScheduledRequest(
        request_id="score", token_ids=tokens, start_position=0, block_ids=blocks, samples=True,
        sampling_params=SamplingParams(max_tokens=1), prompt_token_ids=tokens, output_token_ids=[],
    )
    batch = runner.prepare_inputs([request])
    with torch.inference_mode():
        hidden = runner.model(batch.input_ids, batch.positions, runner.kv_caches, batch.attn)
        return torch.log_softmax(runner.model.compute_logits(hidden).float(), dim=-1)


def lmserve_rows(model: Path, text: str, ctx: int, chunks: int) -> list[dict]:
    runners = {dtype: ModelRunner(ModelConfig(model=str(model)), CacheConfig(num_blocks=ctx // 16 + 1,
                                                                            kv_cache_dtype=dtype))
               for dtype in CACHES}
    cut, _ = text_chunks(load_tokenizer(resolve_model(str(model))), text, ctx, chunks)
    nll = {dtype: 0.0 for dtype in CACHES}
    kls: dict[str, list[torch.Tensor]] = {dtype: [] for dtype in CACHES}
    same = {dtype: 0 for dtype in CACHES}
    count = 0
    for ids in cut:
        # Positions ctx/2 .. ctx-2 predict tokens ctx/2 + 1 .. ctx - 1: what llama-perplexity scores.
        scored = slice(ctx // 2, ctx - 1)
        targets = torch.tensor(ids[ctx // 2 + 1 : ctx])
        logprobs = {dtype: chunk_logprobs(runners[dtype], ids)[scored] for dtype in CACHES}
        base = logprobs[BASE]
        for dtype, lp in logprobs.items():
            nll[dtype] -= lp.gather(1, targets[:, None]).sum().item()
            kls[dtype].append((base.exp() * (base - lp)).sum(-1))
            same[dtype] += (lp.argmax(-1) == base.argmax(-1)).sum().item()
        count += len(targets)
    rows = []
    for dtype in CACHES:
        kl = torch.cat(kls[dtype]).double()
        rows.append({"who": f"lmserve {dtype} cache", "perplexity": math.exp(nll[dtype] / count),
                     "kl_mean": kl.mean().item(), "kl_p99": kl.quantile(0.99).item(),
                     "top1_same": same[dtype] / count, "tokens": count})
    return rows


def llama_rows(binary: Path, model: Path, text: Path, ctx: int, chunks: int) -> list[dict]:
    common = [str(binary), "-m", str(model), "-f", str(text), "-c", str(ctx), "--chunks", str(chunks), "-t", "2",
              "-b", str(ctx), "-fa", "on"]
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        base = Path(scratch) / "f16.kld"
        for cache, extra in (("f16", ["--kl-divergence-base", str(base)]),
                             ("q8_0", ["--kl-divergence-base", str(base), "--kl-divergence"])):
            result = subprocess.run([*common, "-ctk", cache, "-ctv", cache, *extra], capture_output=True, text=True,
                                    check=True)
            log = result.stdout + result.stderr
            ppl = re.search(r"Final estimate: PPL = ([0-9.]+)", log) or re.search(r"Mean PPL\(Q\)\s*:\s*([0-9.]+)", log)
            if ppl is None:
                raise RuntimeError(f"no perplexity in llama-perplexity's output:\n{log[-3000:]}")
            row = {"who": f"llama.cpp {cache} cache", "perplexity": float(ppl.group(1)), "kl_mean": 0.0,
                   "kl_p99": 0.0, "top1_same": 1.0, "tokens": None}
            if cache == "q8_0":
                kl = re.search(r"Mean\s+KLD:\s*([0-9.eE+-]+)", log)
                p99 = re.search(r"99\.0%\s+KLD:\s*([0-9.eE+-]+)", log)
                top = re.search(r"Same top p:\s*([0-9.]+)", log)
                row.update(kl_mean=float(kl.group(1)) if kl else float("nan"),
                           kl_p99=float(p99.group(1)) if p99 else float("nan"),
                           top1_same=float(top.group(1)) / 100 if top else float("nan"), log_tail=log[-2500:])
            rows.append(row)
    return rows


def grouped(group: int):
    """Rounding to int8 with a float16 scale per `group` values of a row (group 32: the int8 cache's rows)."""
    def round_rows(x: torch.Tensor) -> torch.Tensor:
        y = x.reshape(*x.shape[:-1], x.shape[-1] // group, group)
        scale = (y.abs().amax(-1, keepdim=True) / 127).half().float()
        inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
        return (torch.round(y * inverse).clamp(-127, 127) * scale).reshape(x.shape)
    return round_rows


def per_channel(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """Rounding to int8 with a scale per channel over each run of `block` positions ([T, heads, dim])."""
    pad = (-x.shape[0]) % block
    y = torch.cat([x, x[-1:].expand(pad, -1, -1)]) if pad else x
    runs = y.reshape(-1, block, *x.shape[1:])
    scale = (runs.abs().amax(1, keepdim=True) / 127).clamp(min=1e-12)
    return (torch.round(runs / scale).clamp(-127, 127) * scale).reshape(-1, *x.shape[1:])[: x.shape[0]]


def format_rows(model: Path, text: str, ctx: int, chunks: int) -> list[dict]:
    from lmserve.worker import attention

    formats = {"none (float32)": (None, None), "int8 rows, groups of 32": (grouped(32), grouped(32)),
               "K only, groups of 32": (grouped(32), None), "groups of 16": (grouped(16), grouped(16)),
               "groups of 8": (grouped(8), grouped(8)), "K per channel over 16 positions, V groups of 32":
               (per_channel, grouped(32))}
    chosen: dict[str, object] = {}
    forward = attention.PagedAttention.forward

    def rounded_forward(self, q, k, v, k_cache, v_cache, md):
        k = chosen["k"](k) if chosen["k"] else k
        v = chosen["v"](v) if chosen["v"] else v
        return forward(self, q, k, v, k_cache, v_cache, md)

    attention.PagedAttention.forward = rounded_forward
    runner = ModelRunner(ModelConfig(model=str(model), attention_backend="sdpa"),
                         CacheConfig(num_blocks=ctx // 16 + 1, kv_cache_dtype="float32"))
    cut, _ = text_chunks(load_tokenizer(resolve_model(str(model))), text, ctx, chunks)
    base: list[torch.Tensor] = []
    rows = []
    for name, (round_k, round_v) in formats.items():
        chosen.update(k=round_k, v=round_v)
        nll, kl, count = 0.0, 0.0, 0
        for i, ids in enumerate(cut):
            lp = chunk_logprobs(runner, ids)[ctx // 2 : ctx - 1]
            targets = torch.tensor(ids[ctx // 2 + 1 : ctx])
            nll -= lp.gather(1, targets[:, None]).sum().item()
            count += len(targets)
            if not base or len(base) <= i:
                base.append(lp)
            kl += (base[i].exp() * (base[i] - lp)).sum().item()
        rows.append({"who": name, "perplexity": math.exp(nll / count), "kl_mean": kl / count})
    attention.PagedAttention.forward = forward
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path, nargs="?", default=DEFAULT_MODEL)
    parser.add_argument("--text", type=Path, default=Path("/usr/share/common-licenses/GPL-3"))
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=15)
    parser.add_argument("--llama-perplexity", type=Path, default=LLAMA_PERPLEXITY)
    parser.add_argument("--skip-llama", action="store_true")
    parser.add_argument("--formats", type=int, default=0, help="compare roundings of K and V over this many chunks")
    args = parser.parse_args()
    if args.formats:
        rows = format_rows(args.model, args.text.read_text(), args.ctx, args.formats)
        print(f"{args.model.name}; {args.formats} chunk(s) of {args.ctx}, second halves scored; sdpa")
        print("| K and V rounded to | perplexity | mean KL vs float32 |\n|---|---|---|")
        for row in rows:
            print(f"| {row['who']} | {row['perplexity']:.4f} | {row['kl_mean']:.2e} |")
        return
    rows = lmserve_rows(args.model, args.text.read_text(), args.ctx, args.chunks)
    if not args.skip_llama and args.llama_perplexity.is_file():
        rows += llama_rows(args.llama_perplexity, args.model, args.text, args.ctx, args.chunks)
    print(f"{args.model.name}; text {args.text} ({args.chunks} chunks of {args.ctx}, second halves scored); "
          f"torch {torch.__version__}")
    print("| KV cache | perplexity | vs its float16 cache | mean KL | KL p99 | same top token |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        base = next(r["perplexity"] for r in rows if r["who"].split()[0] == row["who"].split()[0]
                    and ("float16" in r["who"] or "f16" in r["who"]))
        print(f"| {row['who']} | {row['perplexity']:.4f} | {(row['perplexity'] / base - 1) * 100:+.3f}% | "
              f"{row['kl_mean']:.2e} | {row['kl_p99']:.2e} | {100 * row['top1_same']:.2f}% |")
    for row in rows:
        if "log_tail" in row:
            print("\nllama-perplexity q8_0 log (tail):\n" + row["log_tail"])


if __name__ == "__main__":
    main()
