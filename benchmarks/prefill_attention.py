"""Why prefill attention passes 4-D tensors to SDPA: torch's CPU kernel choice, timed on SmolLM2's shapes.

    .venv/bin/python benchmarks/prefill_attention.py [--tokens 1500] [--threads 1]

3-D inputs ([heads, len, dim]) take torch's unfused math path; 4-D ones ([1, heads, len, dim]) take the fused
(flash) CPU kernel. The engine runs torch on one thread when OpenBLAS does the matmuls, so that is the default here.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from timing import median_ms

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1500)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    n, scale = args.tokens, HEAD_DIM**-0.5
    q = torch.randn(HEADS, n, HEAD_DIM)
    k, v = torch.randn(KV_HEADS, n, HEAD_DIM), torch.randn(KV_HEADS, n, HEAD_DIM)

    def three_d() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)

    def four_d() -> torch.Tensor:
        return F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=scale,
                                              enable_gqa=True)[0]

    assert torch.allclose(three_d(), four_d(), atol=1e-5)
    slow, fast = median_ms(three_d, args.repeats), median_ms(four_d, args.repeats)
    print(f"causal SDPA, {n} tokens, {HEADS} heads / {KV_HEADS} KV heads, {args.threads} thread(s): "
          f"3-D {slow:.1f} ms, 4-D {fast:.1f} ms ({slow / fast:.1f}x); x30 layers: {30 * slow / 1e3:.2f} s vs "
          f"{30 * fast / 1e3:.2f} s per prefill")


if __name__ == "__main__":
    main()
