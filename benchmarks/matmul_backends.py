"""Which BLAS should CPU float32 matmuls use? torch's (MKL) against NumPy's (OpenBLAS), side by side in one run.

Part 1 times the default model's matrix shapes at the row counts of decoding (1, 16) and prefill (64, 256).
Part 2 times whole engine decode steps with each backend (LMSERVE_BLAS=torch|numpy, one subprocess each).

    .venv/bin/python benchmarks/matmul_backends.py
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import torch
from timing import median_ms

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}

STEP_SCRIPT = """
import sys, time, statistics
from lmserve import LLM, SamplingParams
llm = LLM(dtype="float32", enable_prefix_caching=False)
for batch in (1, 16):
    for i in range(batch):
        llm._add(list(range(1000 + i, 1128 + i)), SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), 0)
    llm.engine.step()
    times = []
    while llm.engine.has_unfinished_requests():
        t = time.perf_counter(); llm.engine.step(); times.append(time.perf_counter() - t)
    llm.output_processor.parents.clear(); llm.output_processor.children.clear()
    print(batch, statistics.median(times))
"""


def main() -> None:
    print(f"torch {torch.__version__}, numpy {np.__version__}, {os.cpu_count()} cores, "
          f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print("| matrix | rows | torch F.linear ms | numpy (OpenBLAS) ms | ratio |")
    print("|---|---|---|---|---|")
    for name, (out_f, in_f) in SHAPES.items():
        w = torch.randn(out_f, in_f)
        for rows in (1, 16, 64, 256):
            x = torch.randn(rows, in_f)
            a = median_ms(lambda x=x, w=w: torch.nn.functional.linear(x, w))
            b = median_ms(lambda x=x, w=w: x.numpy() @ w.numpy().T)
            print(f"| {name} {out_f}x{in_f} | {rows} | {a:.3f} | {b:.3f} | {a / b:.2f}x |")
    print("\n| backend | decode step ms, batch 1 | decode step ms, batch 16 |")
    print("|---|---|---|")
    for backend in ("torch", "numpy"):
        env = {**os.environ, "LMSERVE_BLAS": backend}
        out = subprocess.run([sys.executable, "-c", STEP_SCRIPT], env=env, capture_output=True, text=True, check=True)
        steps = dict(line.split() for line in out.stdout.splitlines())
        print(f"| {backend} | {float(steps['1']) * 1e3:.1f} | {float(steps['16']) * 1e3:.1f} |")


if __name__ == "__main__":
    main()
