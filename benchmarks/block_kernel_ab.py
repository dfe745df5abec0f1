"""The block kernel of two commits side by side: `torch.ops.lmserve.q4_1_linear` of the working tree against the
same op built from `--base REV`'s kernels/quantized_linear.cpp (renamed to another op namespace, so that both load
in one process). Both multiply the default model's linear layers (qkv, o, gate_up, down; 30 layers of distinct random
q4_1 weights, 66 MB, so that the weights come from memory as in a real decode step) by the same inputs; passes
alternate between the two, and the report gives median ms per pass and the weight bytes read per second.

    .venv/bin/python benchmarks/block_kernel_ab.py --base HEAD [--rows 1 2 4] [--threads 2 1] [--passes 40]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

from lmserve.worker.kernels import BUILD_FLAGS, LINK_FLAGS, cpu_flags, cpu_kernels
from lmserve.worker.weights.block_linear import Q4_1Linear
from lmserve.worker.weights.kernel_choice import BLOCK_KERNEL_MAX_ROWS, BatchedPath

REPO = Path(__file__).resolve().parent.parent
SOURCE = "src/lmserve/worker/kernels/quantized_linear.cpp"
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in)
BASE_NAMESPACE = "lmserve_base"


def load_base(rev: str, directory: Path):
    source = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:{SOURCE}"], capture_output=True, text=True,
                            check=True).stdout
    source = source.replace("TORCH_LIBRARY_FRAGMENT(lmserve,", f"TORCH_LIBRARY_FRAGMENT({BASE_NAMESPACE},")
    source = source.replace("TORCH_LIBRARY_IMPL(lmserve,", f"TORCH_LIBRARY_IMPL({BASE_NAMESPACE},")
    path = directory / "base_quantized_linear.cpp"
    path.write_text(source)
    cpp_extension.load(name="lmserve_base_kernel", sources=[str(path)], extra_cflags=BUILD_FLAGS,
                       extra_ldflags=LINK_FLAGS, build_directory=str(directory), is_python_module=False)
    return getattr(torch.ops, BASE_NAMESPACE).q4_1_linear


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    parser.add_argument("--passes", type=int, default=40)
    args = parser.parse_args()
    ops = {"working tree": cpu_kernels().q4_1_linear}
    with tempfile.TemporaryDirectory(prefix="lmserve-kernel-ab-") as directory:
        ops = {f"base ({args.base})": load_base(args.base, Path(directory)), **ops}
        gen = torch.Generator().manual_seed(0)
        path = BatchedPath("fp16", BLOCK_KERNEL_MAX_ROWS)
        layers = [[Q4_1Linear(torch.randn(n, k, generator=gen) * 0.05, None, path) for n, k in SHAPES]
                  for _ in range(30)]
        weight_bytes = sum(linear.blocks.numel() for layer in layers for linear in layer)
        flags = ", ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in cpu_flags())
        print(f"torch {torch.__version__}, CPU flags: {flags}; 30 layers x 4 q4_1 linears "
              f"({weight_bytes / 1e6:.0f} MB), median ms per pass of {args.passes}\n")
        names = list(ops)
        print(f"| rows | threads | {' | '.join(names)} | ratio | GB/s (working tree) |")
        print("|---|---|---|---|---|---|")
        for rows in args.rows:
            inputs = {k: torch.randn(rows, k, generator=gen) for k in (576, 1536)}
            for threads in args.threads:
                torch.set_num_threads(threads)
                times: dict[str, list[float]] = {name: [] for name in names}
                for i in range(args.passes):
                    for name in names if i % 2 else reversed(names):
                        op = ops[name]
                        started = time.perf_counter()
                        for layer in layers:
                            for linear, (n, k) in zip(layer, SHAPES, strict=True):
                                op(inputs[k], linear.blocks, n, None)
                        times[name].append(time.perf_counter() - started)
                medians = [statistics.median(times[name]) for name in names]
                print(f"| {rows} | {threads} | " + " | ".join(f"{m * 1e3:.2f}" for m in medians)
                      + f" | {medians[0] / medians[1]:.2f}x | {weight_bytes / medians[1] / 1e9:.1f} |")


if __name__ == "__main__":
    main()
