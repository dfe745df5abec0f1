"""Engine steps of two commits side by side: the working tree against `--base REV`, on the default model.

Each side runs in its own process, from its own checkout (a temporary git worktree for the base) and with its own
kernel build folder, so the two never share code. Both hold the same `--batch` requests of 256 random tokens, decoding
with greedy sampling; the driver lets each side take 6 steps in turn, the two taking the first turn by rounds, so
that both see the same machine state through this VM's drift. It reports the median step and the median time inside
the paged attention op. With --prompts, a "step" is instead the whole prefill of --batch new 256-token prompts (one
output token each, so the prompt path: first chunks, under the default token budget).

    .venv/bin/python benchmarks/step_ab.py --base c01cb4e [--batch 16] [--rounds 30] [--prompts]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STEPS_PER_TURN = 6


def worker(source: str, batch: int, prompts_only: bool) -> None:
    """Serve the driver: for each line "N" on stdin, take N engine steps, print their (step, attention) seconds."""
    sys.path.insert(0, source)
    import torch

    from lmserve import LLM, SamplingParams
    from lmserve.worker import attention

    inside = [0.0]
    kernel = attention.paged_attention_op

    def timed_kernel():
        op = kernel()

        def call(*args) -> None:
            started = time.perf_counter()
            op(*args)
            inside[0] += time.perf_counter() - started

        return call

    attention.paged_attention_op = timed_kernel
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(1000, 49000, (batch, 256), generator=gen).tolist()
    llm = LLM(max_num_seqs=batch, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=130, temperature=0, ignore_eos=True)

    def fill() -> None:
        for prompt in prompts:
            llm._add(prompt, params, 0)
        while not (len(llm.engine.scheduler.running) == batch
                   and all(r.output_token_ids for r in llm.engine.scheduler.running)):
            llm._step()

    def prefill() -> None:
        for prompt in torch.randint(1000, 49000, (batch, 256), generator=gen).tolist():
            llm._add(prompt, SamplingParams(max_tokens=1, temperature=0), 0)
        while llm.engine.has_unfinished_requests():
            llm._step()

    if not prompts_only:
        fill()
    print("ready", flush=True)
    for line in sys.stdin:
        found = []
        for _ in range(int(line)):
            if not prompts_only and not llm.engine.has_unfinished_requests():
                fill()
            inside[0] = 0.0
            started = time.perf_counter()
            prefill() if prompts_only else llm._step()
            found.append(f"{time.perf_counter() - started:.6f},{inside[0]:.6f}")
        print(" ".join(found), flush=True)


def start(source: Path, batch: int, cache: Path, prompts_only: bool) -> subprocess.Popen:
    env = dict(os.environ, LMSERVE_CACHE=str(cache))
    flags = ["--prompts"] if prompts_only else []
    proc = subprocess.Popen([sys.executable, __file__, "--worker", str(source), "--batch", str(batch), *flags],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    while (line := proc.stdout.readline()) and line.strip() != "ready":
        pass
    if proc.poll() is not None:
        raise RuntimeError(f"the worker for {source} failed to start")
    return proc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", help="the commit to compare the working tree with")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--prompts", action="store_true", help="time the prefill of --batch new prompts instead")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.batch, args.prompts)
    if not args.base:
        parser.error("--base REV is required")
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(base), args.base], cwd=REPO, check=True,
                       capture_output=True)
        try:
            sides = {f"base ({args.base})": start(base / "src", args.batch, Path(tmp) / "cache-base", args.prompts),
                     "working tree": start(REPO / "src", args.batch, Path(tmp) / "cache-tree", args.prompts)}
            steps: dict[str, list[float]] = {name: [] for name in sides}
            kernel: dict[str, list[float]] = {name: [] for name in sides}
            turn_steps = 3 if args.prompts else STEPS_PER_TURN
            for turn in range(args.rounds):
                order = list(sides.items())
                for name, proc in order if turn % 2 else order[::-1]:  # each side goes first every other round
                    proc.stdin.write(f"{turn_steps}\n")
                    proc.stdin.flush()
                    pairs = [p.split(",") for p in proc.stdout.readline().split()]
                    steps[name] += [float(s) for s, _ in pairs[1:]]  # the first step of a turn wakes the process
                    kernel[name] += [float(a) for _, a in pairs[1:]]
            for proc in sides.values():
                proc.stdin.close()
                proc.wait()
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=REPO, check=False)
    (base_name, tree_name) = sides
    what = f"prefills of {args.batch} 256-token prompts" if args.prompts else f"steps of {args.batch} requests decoding"
    print(f"{len(steps[base_name])} {what} each, turns of {turn_steps}\n")
    print(f"| median, ms | {base_name} | {tree_name} | ratio |\n|---|---|---|---|")
    for label, found in (("prefill" if args.prompts else "engine step", steps), ("inside paged attention", kernel)):
        a, b = (statistics.median(found[n]) * 1e3 for n in (base_name, tree_name))
        print(f"| {label} | {a:.1f} | {b:.1f} | {a / b:.2f}x |")


if __name__ == "__main__":
    main()
