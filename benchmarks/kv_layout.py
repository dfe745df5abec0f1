"""The paged kernel against an earlier commit's, on the layouts each reads, side by side in one process.

The tree's kernel for AVX-512 reads K blocks transposed ([block, kv head, dim, key]: a query's scores against 16 keys
are one chain of multiply-adds along a vector of keys), its kernel for other builds (paged_attention_avx2.cpp) reads
them as V's, [block, kv head, key, dim]; each says which (`paged_keys_transposed`). `--base` (default 83b999f, the last
commit with one kernel on [block, kv head, key, dim] K blocks, which summed each key's dot product across a vector's
lanes) is built from git under another op namespace. Both get 30 layers' caches of the same values, each in its own
layout (so K/V stream from memory, as in a real step), must agree, and are timed over the 30 layers in turns.

Cases: decodes (W1's 16 streams, W4's one, and 16 at a longer context), a short chunk beside decodes, and a step of
eight 256-token prompts as first chunks: paged-cpu computes every chunk with this kernel (attention.build_metadata).

`--march haswell` builds both kernels from source for another -march (both then under their own namespaces): on an
AVX-512 machine, the kernel that AVX2-only machines build.

    .venv/bin/python benchmarks/kv_layout.py [--base 83b999f] [--repeats 15] [--march haswell]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

from lmserve.worker.kernels import BUILD_FLAGS, HEADERS, cpu_flags, paged_attention_op, paged_keys_transposed

REPO = Path(__file__).resolve().parent.parent
HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30
CASES = {  # label: [(query length, context length)], decodes first as the runner orders them
    "16 decodes at 300-375 (W1)": [(1, 300 + 5 * i) for i in range(16)],
    "1 decode at 400 (W4)": [(1, 400)],
    "16 decodes at 1000-1075": [(1, 1000 + 5 * i) for i in range(16)],
    "4 decodes at 330 + 16-token chunk at 1484": [(1, 330)] * 4 + [(16, 1484)],
    "8 prompts of 256, first chunks": [(256, 256)] * 8,
}


def built_kernel(sources: dict[str, str], name: str, build: Path, flags: list[str]):
    """The ops of these kernel sources (file name: text; headers beside them), as torch.ops.<name>."""
    paths = []
    for file, source in sources.items():
        source = source.replace("TORCH_LIBRARY(lmserve,", f"TORCH_LIBRARY({name},")
        source = source.replace("TORCH_LIBRARY_IMPL(lmserve,", f"TORCH_LIBRARY_IMPL({name},")
        (build / f"{name}_{file}").write_text(source)
        paths.append(str(build / f"{name}_{file}"))
    cpp_extension.load(name=name, sources=[p for p in paths if p.endswith(".cpp")], extra_cflags=flags,
                       extra_ldflags=["-fopenmp"], build_directory=str(build), is_python_module=False)
    return getattr(torch.ops, name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="83b999f")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--march", help="build both kernels for this -march (default: the library's native build)")
    args = parser.parse_args()
    flags = [f"-march={args.march}" if f == "-march=native" else f for f in BUILD_FLAGS] if args.march else BUILD_FLAGS
    base_source = subprocess.run(["git", "show", f"{args.base}:src/lmserve/worker/kernels/paged_attention.cpp"],
                                 cwd=REPO, check=True, capture_output=True, text=True).stdout
    tag = (args.march or "native").replace("-", "_")
    kernels = REPO / "src/lmserve/worker/kernels"
    with tempfile.TemporaryDirectory() as tmp:
        base_op = built_kernel({"paged_attention.cpp": base_source}, f"lmserve_base_{tag}", Path(tmp),
                               flags).paged_attention
        if args.march:
            # The headers keep their names, so that the sources' #include finds them.
            for header in HEADERS:
                (Path(tmp) / header).write_text((kernels / header).read_text())
            tree = built_kernel({f: (kernels / f).read_text() for f in ("paged_attention.cpp", "paged_attention_avx2.cpp")},
                                f"lmserve_tree_{tag}", Path(tmp), flags)
            new_op, transposed = tree.paged_attention, bool(tree.paged_keys_transposed())
        else:
            new_op, transposed = paged_attention_op(), paged_keys_transposed()
    gen = torch.Generator().manual_seed(0)
    isa = f"-march={args.march}" if args.march else "AVX-512" if "avx512f" in cpu_flags() else "AVX2"
    print(f"{platform.processor() or platform.machine()} ({isa}), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {LAYERS} layers' caches, each request's blocks scattered\n")
    tree = "tree (keys transposed)" if transposed else "tree (keys as V's)"
    print(f"| case | cache | {args.base}, ms | {tree}, ms | ratio |\n|---|---|---|---|---|")
    for dtype in (torch.float16, torch.float32):
        for label, requests in CASES.items():
            num_blocks = sum(-(-ctx // BLOCK) for _, ctx in requests) + 64
            base_layout = [tuple(torch.randn(num_blocks, KV_HEADS, BLOCK, HEAD_DIM, generator=gen).to(dtype)
                                 for _ in "kv") for _ in range(LAYERS)]
            new_layout = [(k.transpose(2, 3).contiguous() if transposed else k, v) for k, v in base_layout]
            order = torch.randperm(num_blocks, generator=gen)
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
            out_base, out_new = torch.empty_like(q), torch.empty_like(q)
            base_op(out_base, q, *base_layout[0], table, info_t, HEAD_DIM**-0.5)
            new_op(out_new, q, *new_layout[0], table, info_t, HEAD_DIM**-0.5)
            torch.testing.assert_close(out_base, out_new, rtol=1e-5, atol=1e-5)
            times: dict[str, list[float]] = {"base": [], "new": []}
            repeats = args.repeats if row < 64 else max(3, args.repeats // 3)
            for _ in range(repeats):
                for name, op, caches, out in (("base", base_op, base_layout, out_base),
                                              ("new", new_op, new_layout, out_new)):
                    started = time.perf_counter()
                    for k_cache, v_cache in caches:
                        op(out, q, k_cache, v_cache, table, info_t, HEAD_DIM**-0.5)
                    times[name].append(time.perf_counter() - started)
            base, new = (statistics.median(times[n]) * 1e3 for n in ("base", "new"))
            cache = str(dtype).removeprefix("torch.")
            print(f"| {label} | {cache} | {base:.1f} | {new:.1f} | {base / new:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
