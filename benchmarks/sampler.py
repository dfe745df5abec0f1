"""The sampler's cost per step (issue 22): the sampler before issue 22 (read from git) against the current one.

One Sampler call over float32 logits of 1 and 16 rows x 49,152 tokens (SmolLM2's vocabulary), for each setting;
medians over many calls, SamplingMetadata built once outside the timing (its cost is the same for both). The logits
are synthetic, token ranks drawn from a Zipf law in a random order: s=1.5 is "model-like" (the 0.95 nucleus holds
~200 tokens), s=2 "peaked" (~12) and s=1 "flat" (~28,000, so top_p needs the full sort).

    PYTHONPATH=src .venv/bin/python benchmarks/sampler.py [--old 60d1a3f] [--repeats 100] [--threads N]
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import torch
from timing import median_ms

from lmserve.sampling_params import SamplingParams
from lmserve.worker import sampler as new_sampler

V = 49152
PROMPT_LEN, OUTPUT_LEN = 1000, 200
ZIPF = {"model-like": 1.5, "peaked": 2.0, "flat": 1.0}
SETTINGS: dict[str, SamplingParams] = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature 1": SamplingParams(temperature=1.0),
    "top_k 40": SamplingParams(temperature=1.0, top_k=40),
    "top_p 0.95": SamplingParams(temperature=1.0, top_p=0.95),
    "top_k 40 + top_p 0.95": SamplingParams(temperature=0.7, top_k=40, top_p=0.95),
    "min_p 0.05": SamplingParams(temperature=1.0, min_p=0.05),
    "penalties": SamplingParams(temperature=1.0, repetition_penalty=1.1, frequency_penalty=0.3, presence_penalty=0.3),
    "seed": SamplingParams(temperature=1.0, seed=1),
}


def load_old(rev: str) -> ModuleType:
    """sampler.py at `rev`, imported as its own module so that both versions run side by side."""
    root = Path(__file__).resolve().parents[1]
    source = subprocess.run(
        ["git", "show", f"{rev}:src/lmserve/worker/sampler.py"], cwd=root, check=True, capture_output=True, text=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / "lmserve_old_sampler.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("lmserve_old_sampler", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def zipf_logits(rows: int, s: float) -> torch.Tensor:
    """log p = -s log(rank) + noise, ranks in a random order per row."""
    ranks = torch.stack([torch.randperm(V) for _ in range(rows)]).float() + 1
    return -s * ranks.log() + 0.1 * torch.randn(rows, V)


def time_step(module: ModuleType, logits: torch.Tensor, params: SamplingParams, repeats: int) -> float:
    n = logits.shape[0]
    gens = [torch.Generator().manual_seed(params.seed) if params.seed is not None else None for _ in range(n)]
    md = module.SamplingMetadata.build(
        [params] * n,
        [torch.randint(0, V, (PROMPT_LEN,)).tolist() for _ in range(n)],
        [torch.randint(0, V, (OUTPUT_LEN,)).tolist() for _ in range(n)],
        gens,
        eos_token_ids=[[2]] * n,
        vocab_size=V,
        device=torch.device("cpu"),
    )
    sampler = module.Sampler()
    return median_ms(lambda: sampler(logits, md), repeats=repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", default="60d1a3f", help="git revision of the old sampler (default: before issue 22)")
    ap.add_argument("--repeats", type=int, default=100)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    old = load_old(args.old)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, vocab {V}, medians of {args.repeats} calls")
    print("| rows | setting | logits | old ms | new ms | old / new |\n|---|---|---|---|---|---|")
    for rows in (1, 16):
        cases = [(name, params, "model-like") for name, params in SETTINGS.items()]
        cases += [("top_p 0.95", SETTINGS["top_p 0.95"], shape) for shape in ("peaked", "flat")]
        for name, params, shape in cases:
            logits = zipf_logits(rows, ZIPF[shape])
            t_old = time_step(old, logits, params, args.repeats)
            t_new = time_step(new_sampler, logits, params, args.repeats)
            print(f"| {rows} | {name} | {shape} | {t_old:.3f} | {t_new:.3f} | {t_old / t_new:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
