"""The paged kernel on head-major cache blocks against the token-major kernel it replaced, side by side in one process.

Commit 4e75515 laid blocks out [block, key, kv head, dim] and prefetched the whole next block in one burst at the
start of each block; the current kernel reads [block, kv head, key, dim] blocks and spreads the next block's
prefetch over the keys it computes (kernels/paged_attention.cpp). This script builds that commit's kernel from git
under another op namespace, fills 30 layers' caches with the same values in each layout (so K/V stream from memory,
as in a real step), checks that both give the same output, and times 30 layers of each, interleaved, for a float32
and a float16 cache.

    .venv/bin/python benchmarks/kv_layout.py [--repeats 15]
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

from lmserve.worker.kernels import BUILD_FLAGS, paged_attention_op

REPO = Path(__file__).resolve().parent.parent
OLD_COMMIT = "4e75515"
HEADS, KV_HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS, LAYERS = 9, 3, 64, 16, 1024, 30
CASES = {  # label: [(query length, context length)], decodes first as the runner orders them
    "16 decodes at 300-375 (W1)": [(1, 300 + 5 * i) for i in range(16)],
    "4 decodes at 330 + 16-token chunk at 1484 (W3, threshold 16)": [(1, 330)] * 4 + [(16, 1484)],
    "1 decode at 400 (W4)": [(1, 400)],
}


def old_kernel(build: Path):
    """The old commit's paged_attention op, as torch.ops.lmserve_token_major."""
    source = subprocess.run(["git", "show", f"{OLD_COMMIT}:src/lmserve/worker/kernels/paged_attention.cpp"],
                            cwd=REPO, check=True, capture_output=True, text=True).stdout
    source = source.replace("TORCH_LIBRARY(lmserve,", "TORCH_LIBRARY(lmserve_token_major,")
    source = source.replace("TORCH_LIBRARY_IMPL(lmserve,", "TORCH_LIBRARY_IMPL(lmserve_token_major,")
    (build / "token_major.cpp").write_text(source)
    cpp_extension.load(name="lmserve_token_major", sources=[str(build / "token_major.cpp")], extra_cflags=BUILD_FLAGS,
                       extra_ldflags=["-fopenmp"], build_directory=str(build), is_python_module=False)
    return torch.ops.lmserve_token_major.paged_attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    new_op = paged_attention_op()
    with tempfile.TemporaryDirectory() as tmp:
        old_op = old_kernel(Path(tmp))
    gen = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {LAYERS} layers' caches of {NUM_BLOCKS} "
          f"blocks, each request's blocks scattered\n")
    print("| case | cache | token-major (4e75515), ms | head-major, ms | ratio |\n|---|---|---|---|---|")
    for dtype in (torch.float32, torch.float16):
        token_major = [tuple(torch.randn(NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
                             for _ in "kv") for _ in range(LAYERS)]
        head_major = [tuple(c.transpose(1, 2).contiguous() for c in layer) for layer in token_major]
        for label, requests in CASES.items():
            order = torch.randperm(NUM_BLOCKS, generator=gen)
            max_blocks = max(-(-ctx // BLOCK) for _, ctx in requests)
            table = torch.zeros(len(requests), max_blocks, dtype=torch.int32)
            info, used, row = [], 0, 0
            for i, (q_len, ctx) in enumerate(requests):
                n = -(-ctx // BLOCK)
                table[i, :n] = order[used : used + n].int()
                info.append([row, q_len, ctx])
                used, row = used + n, row + q_len
            info_t = torch.tensor(info)
            q = torch.randn(row, HEADS, HEAD_DIM, generator=gen)
            out_old, out_new = torch.empty_like(q), torch.empty_like(q)
            old_op(out_old, q, *token_major[0], table, info_t, HEAD_DIM**-0.5)
            new_op(out_new, q, *head_major[0], table, info_t, HEAD_DIM**-0.5)
            torch.testing.assert_close(out_old, out_new, rtol=1e-5, atol=1e-5)
            times: dict[str, list[float]] = {"old": [], "new": []}
            for _ in range(args.repeats):
                for name, op, caches, out in (("old", old_op, token_major, out_old),
                                              ("new", new_op, head_major, out_new)):
                    started = time.perf_counter()
                    for k_cache, v_cache in caches:
                        op(out, q, k_cache, v_cache, table, info_t, HEAD_DIM**-0.5)
                    times[name].append(time.perf_counter() - started)
            old, new = (statistics.median(times[n]) * 1e3 for n in ("old", "new"))
            cache = str(dtype).removeprefix("torch.")
            print(f"| {label} | {cache} | {old:.1f} | {new:.1f} | {old / new:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
