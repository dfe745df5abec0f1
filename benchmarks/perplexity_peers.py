"""Perplexity of a fixed text: lmserve on a GGUF (its stored size, and the file's values in float32) against llama.cpp's
`llama-perplexity` on the same file, scored the way llama-perplexity scores it (issue 34).

llama-perplexity cuts the text's tokens into chunks of `--ctx` (512), evaluates each chunk on its own and scores the
second half of it: the logits at positions ctx/2 .. ctx-2 predicting the next token (255 tokens a chunk of 512).
Here lmserve evaluates the same chunks (its own tokenization of the same text, the same cut) as prompts with
`prompt_logprobs` and scores the same positions. The default text is Debian's GPL-3 (/usr/share/common-licenses/GPL-3,
the same bytes on every machine here; ~8,000 tokens).

    .venv/bin/python benchmarks/perplexity_peers.py MODEL.gguf [--text FILE] [--ctx 512] [--chunks 15]
        [--settings stored float32 transformers] [--llama-perplexity PATH]

`transformers` runs transformers' own model on the file (dequantized to float32) over the same token ids; its GGUF
loader needs `accelerate`, which lmserve does not depend on: `pip install --target /tmp/acc --no-deps accelerate` and
run with PYTHONPATH=/tmp/acc.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
from pathlib import Path

SETTINGS = {
    "stored": {},  # --quantization auto: each layer at the file's stored size, prompt rows as auto sends them
    "stored, no copies": {"batched_weights": "none"},  # every row on the block kernels
    "stored, 8-bit prompt rows": {"batched_weights": "prompt-int8"},  # llama.cpp's activations for prompt rows
    "stored, 8-bit activations": {"block_activations": "int8"},  # every row on 8-bit activations, as llama.cpp
    "stored, 16-bit activations": {"block_activations": "int16"},  # auto's choice below 250 M decoder weights
    "float32": {"quantization": "none"},  # the file's values dequantized to float32: the reference
}
LLAMA_PERPLEXITY = Path.home() / ".cache/lmserve-peers/llama.cpp/bin/llama-perplexity"


def chunk_nll(logprobs: list[float | None], ctx: int) -> list[float]:
    """The negative logprobs llama-perplexity sums for one chunk: tokens ctx/2 + 1 .. ctx - 1."""
    return [-lp for lp in logprobs[ctx // 2 + 1 : ctx] if lp is not None]


def text_chunks(tokenizer, text: str, ctx: int, chunks: int) -> tuple[list[list[int]], int]:
    """The text's tokens cut into `chunks` chunks of `ctx`, and the text's token count. Where the tokenizer adds BOS,
    each chunk starts with it in place of its first token, as llama-perplexity does (Gemma without its BOS is another
    model: 13.9 against 17.0 on the GPL-3 text)."""
    ids = tokenizer.encode(text, add_special_tokens=True)
    bos = tokenizer.bos_token_id if ids and ids[0] == tokenizer.bos_token_id else None
    cut = [ids[c * ctx : (c + 1) * ctx] for c in range(min(chunks, len(ids) // ctx))]
    return [[bos, *chunk[1:]] if bos is not None else chunk for chunk in cut], len(ids)


def lmserve_perplexity(model: str, setting: str, text: str, ctx: int, chunks: int) -> dict:
    from lmserve import LLM, SamplingParams

    llm = LLM(model=model, max_model_len=max(ctx + 16, 1024), **SETTINGS[setting])
    cut, text_tokens = text_chunks(llm.tokenizer, text, ctx, chunks)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    nll: list[float] = []
    for chunk in cut:
        out = llm.generate([chunk], params)[0]
        nll += chunk_nll([None if e is None else e.logprob for e in out.prompt_logprobs], ctx)
    return {"setting": f"lmserve {setting}", "perplexity": math.exp(sum(nll) / len(nll)), "tokens": len(nll),
            "chunks": len(cut), "text_tokens": text_tokens}


def transformers_perplexity(model: str, text: str, ctx: int, chunks: int) -> dict:
    """transformers on the same file (its GGUF loader dequantizes every tensor to float32) over the same token ids
    (lmserve's tokenization, so both score the same sequence) and the same positions: issue 35's reference."""
    import torch
    import transformers

    from lmserve.model_tokenizer import load_tokenizer
    from lmserve.models import resolve_model

    path = Path(model).expanduser()
    cut, text_tokens = text_chunks(load_tokenizer(resolve_model(str(path))), text, ctx, chunks)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                  dtype=torch.float32).eval()
    nll: list[float] = []
    with torch.no_grad():
        for ids in cut:
            chunk = torch.tensor([ids])
            logprobs = reference(chunk).logits[0].float().log_softmax(-1)
            # logprobs[i] predicts token i + 1: the prompt logprob of position i + 1 (position 0 has none).
            per_position = [None] + logprobs[:-1].gather(-1, chunk[0, 1:, None])[:, 0].tolist()
            nll += chunk_nll(per_position, ctx)
    return {"setting": "transformers float32", "perplexity": math.exp(sum(nll) / len(nll)), "tokens": len(nll),
            "chunks": len(cut), "text_tokens": text_tokens}


def llama_perplexity(binary: Path, model: str, text: Path, ctx: int, chunks: int) -> dict:
    command = [str(binary), "-m", model, "-f", str(text), "-c", str(ctx), "--chunks", str(chunks), "-t", "2",
               "-b", str(ctx)]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    log = result.stdout + result.stderr
    final = re.search(r"Final estimate: PPL = ([0-9.]+)", log)
    tokens = re.search(r"tokenization took .*?\n.*?calculating perplexity over (\d+) chunks", log, re.DOTALL)
    if final is None:
        raise RuntimeError(f"no final estimate in llama-perplexity's output:\n{log[-3000:]}")
    return {"setting": "llama.cpp llama-perplexity", "perplexity": float(final.group(1)),
            "chunks": int(tokens.group(1)) if tokens else None, "tokens": None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--text", type=Path, default=Path("/usr/share/common-licenses/GPL-3"))
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=15)
    parser.add_argument("--settings", nargs="+", default=["stored", "float32"], choices=[*SETTINGS, "transformers"])
    parser.add_argument("--llama-perplexity", type=Path, default=LLAMA_PERPLEXITY)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    text = args.text.read_text()
    if args.child == "transformers":
        print(json.dumps(transformers_perplexity(args.model, text, args.ctx, args.chunks)))
        return
    if args.child:  # each lmserve setting in a fresh process
        print(json.dumps(lmserve_perplexity(args.model, args.child, text, args.ctx, args.chunks)))
        return
    rows = []
    for setting in args.settings:
        out = subprocess.run([sys.executable, __file__, args.model, "--text", str(args.text), "--ctx", str(args.ctx),
                              "--chunks", str(args.chunks), "--child", setting],
                             capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    if args.llama_perplexity.is_file():
        rows.append(llama_perplexity(args.llama_perplexity, args.model, args.text, args.ctx, args.chunks))
    reference = next((r["perplexity"] for r in rows if r["setting"] == "lmserve float32"), None)
    print(f"{args.model}; text {args.text} ({args.chunks} chunks of {args.ctx}, second halves scored)")
    print("| who | perplexity | vs lmserve float32 | scored tokens |")
    print("|---|---|---|---|")
    for r in rows:
        delta = f"{(r['perplexity'] / reference - 1) * 100:+.3f}%" if reference else "-"
        print(f"| {r['setting']} | {r['perplexity']:.4f} | {delta} | {r.get('tokens') or '-'} |")


if __name__ == "__main__":
    main()
