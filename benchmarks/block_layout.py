"""The q4_1 kernel's weight layout against the one it replaced, side by side in one process.

Commit 28919bd stored each row's GGUF blocks in order ({d, m, 16 bytes} per 32 weights) and widened every row's
scales one by one; the current kernel reads panels of 8 rows (kernels/quantized_linear.cpp). This script builds that
commit's kernel and packer from git under another op namespace, checks that both give the same products, and times
a decode step's linear layers (30 layers of qkv, o, gate_up and down at SmolLM2-135M's shapes, distinct random
weights, a small op in between as in the model) with each, interleaved, for 1, 2, 4 and 8 input rows.

    .venv/bin/python benchmarks/block_layout.py [--repeats 40]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

from lmserve.worker.kernels import BUILD_FLAGS, cpu_kernels
from lmserve.worker.weights.block_packing import pack_q4_1

REPO = Path(__file__).resolve().parent.parent
OLD_COMMIT = "28919bd"
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down: (out, in)


def git_show(path: str) -> str:
    return subprocess.run(["git", "show", f"{OLD_COMMIT}:{path}"], cwd=REPO, check=True, capture_output=True,
                          text=True).stdout


def old_kernel(build: Path):
    """The old commit's q4_1 op (as torch.ops.lmserve_old) and packer."""
    source = git_show("src/lmserve/worker/kernels/quantized_linear.cpp")
    source = source.replace("TORCH_LIBRARY_FRAGMENT(lmserve,", "TORCH_LIBRARY_FRAGMENT(lmserve_old,")
    source = source.replace("TORCH_LIBRARY_IMPL(lmserve,", "TORCH_LIBRARY_IMPL(lmserve_old,")
    (build / "old_quantized_linear.cpp").write_text(source)
    cpp_extension.load(name="lmserve_old_blocks", sources=[str(build / "old_quantized_linear.cpp")],
                       extra_cflags=BUILD_FLAGS, extra_ldflags=["-fopenmp"], build_directory=str(build),
                       is_python_module=False)
    (build / "old_quantization.py").write_text(git_show("src/lmserve/worker/quantization.py"))
    spec = importlib.util.spec_from_file_location("old_quantization", build / "old_quantization.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return torch.ops.lmserve_old.q4_1_linear, module.pack_q4_1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args()
    cpu_kernels()
    with tempfile.TemporaryDirectory() as tmp:
        old_op, old_pack = old_kernel(Path(tmp))
        new_op = torch.ops.lmserve.q4_1_linear
        gen = torch.Generator().manual_seed(0)
        layers = [[torch.randn(n, k, generator=gen) * 0.05 for n, k in SHAPES] for _ in range(30)]
        weights = {"rows (28919bd)": (old_op, [[old_pack(w) for w in layer] for layer in layers]),
                   "panels of 8 rows": (new_op, [[pack_q4_1(w) for w in layer] for layer in layers])}
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
        print("| input rows | " + " | ".join(f"{name}, ms per step" for name in weights) + " | ratio |")
        print("|---|---|---|---|")
        for rows in (1, 2, 4, 8):
            inputs = {k: torch.randn(rows, k, generator=gen) for k in (576, 1536)}
            (op_a, w_a), (op_b, w_b) = weights.values()
            for (n, k), a, b in zip(SHAPES, w_a[0], w_b[0], strict=True):
                torch.testing.assert_close(op_a(inputs[k], a, n, None), op_b(inputs[k], b, n, None), rtol=1e-4,
                                           atol=1e-4)

            def step(op, packed, inputs=inputs) -> None:
                for layer in packed:
                    for (n, k), w in zip(SHAPES, layer, strict=True):
                        op(inputs[k], w, n, None).add_(1.0)

            times: dict[str, list[float]] = {name: [] for name in weights}
            for _ in range(args.repeats):  # interleaved, so that both see the same state of the machine
                for name, (op, packed) in weights.items():
                    started = time.perf_counter()
                    step(op, packed)
                    times[name].append(time.perf_counter() - started)
            medians = [1000 * statistics.median(t) for t in times.values()]
            print(f"| {rows} | {medians[0]:.2f} | {medians[1]:.2f} | {medians[0] / medians[1]:.2f}x |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
