"""KV cache held by one long conversation on a model with sliding-window layers (issue 35): lmserve's KV-cache groups
(local layers hold their window) against one block table for every layer (--disable-hybrid-kv-cache-manager), and the
decode speed of both.

    .venv/bin/python benchmarks/sliding_window_kv.py MODEL.gguf [--tokens 16384] [--decode 64]

One request of --tokens prompt tokens (Debian's GPL-3 text, repeated) is prefilled, then decodes --decode tokens
(greedy, EOS ignored); "blocks held" is the most it holds while it decodes (read from the engine after each step),
each setting in a fresh process.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

TEXT = Path("/usr/share/common-licenses/GPL-3")


def measure(model: str, tokens: int, decode: int, hybrid: bool) -> dict:
    from lmserve import LLM, SamplingParams
    from lmserve.engine.request import Request

    llm = LLM(model=model, max_model_len=tokens + decode + 16, disable_hybrid_kv_cache_manager=not hybrid)
    ids = llm.tokenizer.encode(TEXT.read_text() * (1 + tokens // 7000), add_special_tokens=True)[:tokens]
    engine = llm.engine
    engine.add_request(Request("long", ids, SamplingParams(max_tokens=decode, temperature=0, ignore_eos=True)))
    started = time.perf_counter()
    request = engine.scheduler.requests["long"]
    while request.num_output_tokens == 0:
        engine.step()
    prefilled = time.perf_counter()
    held = 0
    while engine.has_unfinished_requests():
        engine.step()  # each decode step's allocation gives back what fell out of the windows
        if engine.has_unfinished_requests():
            held = max(held, engine.scheduler.kv_cache_manager.num_used_blocks)
    decoded = time.perf_counter()
    kv = engine.scheduler.kv_cache_manager
    block_bytes = engine.executor.info.kv_bytes_per_block
    return {"setting": "KV-cache groups (default)" if hybrid else "--disable-hybrid-kv-cache-manager",
            "groups": kv.num_groups, "blocks_held": held, "block_bytes": block_bytes,
            "kv_mib": held * block_bytes / 2**20, "prefill_s": prefilled - started,
            "decode_tok_s": (decode - 1) / (decoded - prefilled)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--child", choices=["hybrid", "one-table"])
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.model, args.tokens, args.decode, args.child == "hybrid")))
        return
    rows = []
    for child in ("hybrid", "one-table"):
        out = subprocess.run([sys.executable, __file__, args.model, "--tokens", str(args.tokens), "--decode",
                              str(args.decode), "--child", child], capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{args.model}: one request of {args.tokens} prompt tokens, {args.decode} decoded")
    print("| setting | groups | blocks held | bytes a block | KV held (MiB) | prefill (s) | decode (tok/s) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['setting']} | {r['groups']} | {r['blocks_held']} | {r['block_bytes']:,} | {r['kv_mib']:.1f} | "
              f"{r['prefill_s']:.1f} | {r['decode_tok_s']:.1f} |")


if __name__ == "__main__":
    main()
