"""Speculative decoding by prompt lookup (issue 38): one stream, the same server build with and without
`--speculative-config`, and llama.cpp's server with and without its own n-gram speculation (`--spec-type
ngram-simple`) on the same file; one server at a time, alternating rounds.

Workloads (streamed, temperature 0, one request at a time):
  editing: a chat request holding a source file of this repository and asking for it back with one rename (the
    answer repeats the prompt: what prompt lookup is for); --max-tokens output tokens;
  random: random token-id prompts of 128 tokens, 64 output tokens with ignore_eos, greedy (what vLLM's random
    dataset does; a small model's greedy continuation of noise falls into loops, which lookup does find);
  sampled: the same prompts at temperature 1 (seeded): little to look up and drafts that mostly fail, the case the
    acceptance gate is for (target: >= 0.95x plain decoding).
Reported per setting, medians over rounds: decode tokens/s of one stream ((completion tokens - 1) / time from the
first to the last token) and time to first token.

    .venv/bin/python benchmarks/speculative.py MODEL.gguf [--rounds 2] [--spec '{"method": "ngram", ...}']
        [--servers lmserve,llama]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import time
from pathlib import Path

import httpx
from gguf_peers import LLAMA_SERVER, free_port, start, wait_ready

ROOT = Path(__file__).resolve().parent.parent
EDITS = [
    ("src/lmserve/spec_decode/ngram.py", "NgramProposer", "PromptLookupProposer"),
    ("src/lmserve/engine/request.py", "RequestStatus", "RequestState"),
    ("src/lmserve/engine/dp_router.py", "replica", "engine"),
]
DEFAULT_SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}'
# llama.cpp's closest method: the last size_n tokens looked up, size_m drafted (its defaults are 12 and 48).
LLAMA_NGRAM = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "8",
               "--spec-draft-n-max", "8"]


def stream(url: str, body: dict) -> tuple[float, float, int]:
    """(time to first token, decode tokens/s, completion tokens) of one streamed request."""
    started = time.perf_counter()
    first = last = None
    tokens = 0
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url, json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk.get("timings"):  # llama-server's own count
                tokens = chunk["timings"]["predicted_n"]
            if chunk.get("choices"):
                now = time.perf_counter()
                first = first or now
                last = now
    assert first is not None and last is not None and tokens > 1
    return first - started, (tokens - 1) / (last - first), tokens


def editing_requests(max_tokens: int) -> list[dict]:
    requests = []
    for path, old, new in EDITS:
        code = (ROOT / path).read_text()[:3000]
        prompt = (f"Here is a Python file:\n\n```python\n{code}\n```\n\nRename `{old}` to `{new}` everywhere and "
                  "return the complete file, unchanged otherwise.")
        requests.append({"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                         "temperature": 0})
    return requests


def random_requests(vocab: int, count: int = 4, temperature: float = 0.0) -> list[dict]:
    rng = random.Random(0)
    return [{"prompt": [rng.randrange(100, vocab) for _ in range(128)], "max_tokens": 64, "temperature": temperature,
             "seed": i, "ignore_eos": True} for i in range(count)]


def start_llama(model: str, port: int, extra: list[str]):
    import subprocess

    command = [str(LLAMA_SERVER), "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t", "2", "-c", "8192",
               "--parallel", "1", *extra]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def run_once(server: str, model: str, extra: list[str], max_tokens: int) -> dict:
    port = free_port()
    if server == "lmserve-baseline":  # the same command on another source tree (--baseline-src)
        proc = start("lmserve", model, port, extra)
    else:
        proc = start("lmserve", model, port, extra) if server == "lmserve" else start_llama(model, port, extra)
    try:
        wait_ready(port, proc, time.perf_counter())
        base = f"http://127.0.0.1:{port}/v1"
        served = httpx.get(f"{base}/models").json()["data"][0]
        vocab = 32000  # ids below it are tokens of every vocabulary here (SmolLM2 49k, Qwen2.5 151k, Gemma 262k)
        stream(f"{base}/completions", {"model": served["id"], "prompt": "Hello", "max_tokens": 4})  # warm-up
        result: dict = {}
        for name, url, bodies in (("editing", f"{base}/chat/completions", editing_requests(max_tokens)),
                                  ("random", f"{base}/completions", random_requests(vocab)),
                                  ("sampled", f"{base}/completions", random_requests(vocab, temperature=1.0))):
            runs = [stream(url, {"model": served["id"], **body}) for body in bodies]
            result[f"{name}_ttft_s"] = statistics.median(r[0] for r in runs)
            result[f"{name}_tok_s"] = statistics.median(r[1] for r in runs)
            result[f"{name}_tokens"] = sum(r[2] for r in runs)
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        for line in metrics.splitlines():
            for counter in ("spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total"):
                if line.startswith(f"lmserve:{counter}{{"):
                    result[counter] = float(line.split()[-1])
        return result
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--spec", default=DEFAULT_SPEC)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--servers", default="lmserve")
    parser.add_argument("--baseline-src", type=Path,
                        help="another tree's src/: its lookup runs too, alternating with this tree's (an A/B)")
    parser.add_argument("--activations", default="auto",
                        help="lmserve's --block-activations, comma-separated: each is run plain and with lookup")
    args = parser.parse_args()
    settings = {}
    kinds = args.activations.split(",")
    for kind in kinds:
        suffix = f" {kind}" if len(kinds) > 1 else ""
        flags = ["--block-activations", kind]
        settings |= {f"plain{suffix}": ("lmserve", flags), f"ngram{suffix}": ("lmserve", flags + ["--speculative-config", args.spec])}
        if args.baseline_src:
            settings[f"ngram baseline{suffix}"] = ("lmserve-baseline", flags + ["--speculative-config", args.spec])
    if "llama" in args.servers.split(","):
        settings |= {"llama plain": ("llama", []), "llama ngram": ("llama", LLAMA_NGRAM)}
    results: dict[str, list[dict]] = {name: [] for name in settings}
    for _ in range(args.rounds):
        for name, (server, extra) in settings.items():
            pythonpath = os.environ.get("PYTHONPATH")
            if server == "lmserve-baseline":
                os.environ["PYTHONPATH"] = str(args.baseline_src.resolve())
            try:
                results[name].append(run_once(server, args.model, extra, args.max_tokens))
            finally:
                if pythonpath is None:
                    os.environ.pop("PYTHONPATH", None)
                else:
                    os.environ["PYTHONPATH"] = pythonpath
            print(name, json.dumps(results[name][-1]), flush=True)
    keys = ["editing_tok_s", "editing_ttft_s", "random_tok_s", "sampled_tok_s"]
    print(f"\n{'':26}" + "".join(f"{k:>16}" for k in keys))
    medians = {name: {k: statistics.median(r[k] for r in rs) for k in keys} for name, rs in results.items()}
    for name, m in medians.items():
        print(f"{name:26}" + "".join(f"{m[k]:>16.3f}" for k in keys))
    first = f" {kinds[0]}" if len(kinds) > 1 else ""
    pairs = [(f"ngram{s}", f"plain{s}") for s in ([f" {k}" for k in kinds] if len(kinds) > 1 else [""])]
    pairs += [(f"plain{first}", f"plain {k}") for k in kinds[1:]]
    if args.baseline_src:
        pairs += [(f"ngram baseline{s}", f"plain{s}") for s in ([f" {k}" for k in kinds] if len(kinds) > 1 else [""])]
    if "llama ngram" in medians:
        pairs += [("llama ngram", "llama plain"), (f"ngram{first}", "llama ngram")]
    for a, b in pairs:
        print(f"{a + ' / ' + b:26}" + "".join(f"{medians[a][k] / medians[b][k]:>16.2f}" for k in keys))
    spec = results[f"ngram{first}"][-1]
    if spec.get("spec_decode_num_draft_tokens_total"):
        print(f"acceptance (last round): {spec['spec_decode_num_accepted_tokens_total']:.0f} of "
              f"{spec['spec_decode_num_draft_tokens_total']:.0f} draft tokens")


if __name__ == "__main__":
    main()
