"""W1 and W4 on one GPU: lmserve (the offline engine, bfloat16) against transformers' `generate` on the same device,
on a random-weight model of Llama-3.2-1B's shape (hidden 2048, 16 layers, 32 heads over 8 KV heads, intermediate
8192, vocabulary 128,256, tied embeddings, Llama 3.2's llama3 RoPE scaling). Random weights: speed does not depend
on the values, and no checkpoint needs to reach a machine without internet.

- W1: 64 requests of 256 random prompt tokens and 128 output tokens (EOS ignored), 16 at a time: lmserve with
  `max_num_seqs` 16 (a closed loop: a finished request's place goes to the next), transformers in 4 batches of 16.
  Output tokens/s.
- W4: one request at a time, 128 prompt tokens and 256 output tokens: 1/TPOT (decode tokens/s after the first)
  and, for lmserve, TTFT.

Writes a JSON record (--out) and prints a markdown table for docs/benchmarks.md. Without CUDA it prints that it
skipped, unless `--device cpu --shape tiny` asks for the small run that checks the script itself.

    python benchmarks/gpu_w1_w4.py --out gpu_w1_w4.json
    python benchmarks/gpu_w1_w4.py --device cpu --shape tiny --num-requests 8 --w1-output 8 --w4-output 16
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

from lmserve import LLM, SamplingParams
from lmserve.bench.result import machine_info

LLAMA3_2_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}
SHAPES = {
    "llama-3.2-1b": {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "intermediate_size": 8192, "vocab_size": 128256},
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 128, "vocab_size": 49152},
}
MAX_MODEL_LEN = 1024
FIRST_PROMPT_ID = 1000  # byte-level and special tokens make odd prompts


def load_bench_tokenizer(path: str | None) -> transformers.PreTrainedTokenizerBase:
    """The default model's tokenizer: from a directory (a GPU machine lacks the model's package), else the package."""
    if path:
        return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    from lmserve.model_tokenizer import load_tokenizer
    from lmserve.models import DEFAULT_MODEL, resolve_model

    return load_tokenizer(resolve_model(DEFAULT_MODEL))


def write_random_model(directory: Path, shape: str, tokenizer, device: torch.device) -> Path:
    """An HF directory (config, bfloat16 safetensors, tokenizer) with transformers' random initialisation."""
    config = transformers.LlamaConfig(
        **SHAPES[shape], max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=LLAMA3_2_ROPE, tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    with torch.device(device):  # on the GPU: initialising 1.2 B parameters on the CPU takes minutes
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    del model
    return directory


def random_prompts(count: int, length: int, top: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(FIRST_PROMPT_ID, top, (count, length), generator=g).tolist()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_lmserve(model_dir: Path, device: torch.device, args, w1: list[list[int]], w4: list[int]) -> dict:
    llm = LLM(str(model_dir), device=device.type, dtype="bfloat16", max_model_len=MAX_MODEL_LEN,
              max_num_seqs=args.concurrency, enable_prefix_caching=False,
              gpu_memory_utilization=args.gpu_memory_utilization)
    llm.generate(w1[:4], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))  # warm-up
    started = time.perf_counter()
    outs = llm.generate(w1, SamplingParams(max_tokens=args.w1_output, temperature=0, ignore_eos=True))
    elapsed = time.perf_counter() - started
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    assert generated == len(w1) * args.w1_output, generated
    stamps: list[float] = []
    count = 0
    started = time.perf_counter()
    for delta in llm.stream(w4, SamplingParams(max_tokens=args.w4_output, temperature=0, ignore_eos=True)):
        n = sum(len(o.token_ids) for o in delta.outputs)
        if n:
            stamps.append(time.perf_counter())
            count += n
    assert count == args.w4_output, count
    record = {
        "w1_output_tok_s": generated / elapsed,
        "w1_seconds": elapsed,
        "w4_ttft_s": stamps[0] - started,
        "w4_decode_tok_s": (count - 1) / (stamps[-1] - stamps[0]),
        "kv_cache_blocks": llm.engine.runner.num_blocks,
    }
    del llm, outs
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return record


@torch.inference_mode()
def bench_transformers(model_dir: Path, device: torch.device, args, w1: list[list[int]], w4: list[int]) -> dict:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
    fixed = {"do_sample": False, "pad_token_id": 0}

    def generate(prompts: list[list[int]], tokens: int) -> float:
        ids = torch.tensor(prompts, device=device)
        synchronize(device)
        started = time.perf_counter()
        out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, **fixed)
        synchronize(device)
        assert out.shape[1] == ids.shape[1] + tokens
        return time.perf_counter() - started

    generate(w1[: args.concurrency], 8)  # warm-up
    elapsed = sum(generate(w1[i : i + args.concurrency], args.w1_output) for i in range(0, len(w1), args.concurrency))
    # Decode rate without the prefill: the time of 1 + N tokens minus that of 1.
    one = generate([w4], 1)
    more = generate([w4], args.w4_output + 1)
    return {"w1_output_tok_s": len(w1) * args.w1_output / elapsed, "w1_seconds": elapsed,
            "w4_decode_tok_s": args.w4_output / (more - one)}


def markdown(record: dict) -> str:
    lm, hf = record["lmserve"], record["transformers"]
    w = record["workloads"]
    lines = [
        (f"{record['machine'].get('gpu') or record['device']}, torch {record['torch']}, transformers "
         f"{record['transformers_version']}; random {record['shape']} weights, bfloat16"),
        (f"| engine | W1 ({w['num_requests']}×{w['w1_input']} in / {w['w1_output']} out, {w['concurrency']} at a "
         f"time) output tok/s | W4 ({w['w4_input']} in / {w['w4_output']} out) 1/TPOT tok/s | W4 TTFT ms |"),
        "|---|---|---|---|",
        (f"| lmserve (offline engine) | {lm['w1_output_tok_s']:.0f} | {lm['w4_decode_tok_s']:.0f} | "
         f"{lm['w4_ttft_s'] * 1000:.0f} |"),
        f"| transformers generate | {hf['w1_output_tok_s']:.0f} | {hf['w4_decode_tok_s']:.0f} | - |",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--shape", default="llama-3.2-1b", choices=tuple(SHAPES))
    parser.add_argument("--tokenizer", default=os.environ.get("LMSERVE_TEST_TOKENIZER"),
                        help="a directory holding the default model's tokenizer (default: the model's package)")
    parser.add_argument("--model-dir", help="reuse (or write) the random model here instead of a temporary directory")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--w1-input", type=int, default=256)
    parser.add_argument("--w1-output", type=int, default=128)
    parser.add_argument("--w4-input", type=int, default=128)
    parser.add_argument("--w4-output", type=int, default=256)
    # Leaves room for transformers' run in the same process after lmserve's is released.
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--out", help="write the JSON record here")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_w1_w4: CUDA is not available here; skipped (--device cpu --shape tiny checks the script)")
        return 0
    device = torch.device(args.device)
    tokenizer = load_bench_tokenizer(args.tokenizer)
    top = len(tokenizer)
    w1 = random_prompts(args.num_requests, args.w1_input, top, seed=0)
    w4 = random_prompts(1, args.w4_input, top, seed=1)[0]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model_dir or tmp)
        if not (model_dir / "config.json").is_file():
            started = time.perf_counter()
            write_random_model(model_dir, args.shape, tokenizer, device)
            print(f"wrote a random {args.shape} model to {model_dir} in {time.perf_counter() - started:.1f} s",
                  file=sys.stderr)
        lm = bench_lmserve(model_dir, device, args, w1, w4)
        hf = bench_transformers(model_dir, device, args, w1, w4)
    record = {
        "benchmark": "gpu_w1_w4", "device": args.device, "shape": args.shape, "machine": machine_info(),
        "torch": torch.__version__, "transformers_version": transformers.__version__,
        "python": platform.python_version(),
        "workloads": {k: getattr(args, k) for k in ("num_requests", "concurrency", "w1_input", "w1_output",
                                                     "w4_input", "w4_output")},
        "lmserve": lm, "transformers": hf,
    }
    record["markdown"] = markdown(record)
    print(record["markdown"])
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
