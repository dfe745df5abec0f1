"""Paged attention behind one interface: write new K/V into the block cache, attend causally over each request's blocks.

The portable PyTorch version batches every decode (query length 1) into one padded SDPA call and runs one SDPA call
per prefill chunk; there is no Python loop over the tokens of a sequence. Faster kernels plug in behind `PagedAttention`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Where each new position's K/V goes and which cached positions each query may see.

    The batch is ordered decodes first, then prefill chunks, so decode queries are rows [0, num_decodes).
    """

    slot_mapping: torch.Tensor  # [num_tokens] long: flat slot (block * block_size + offset) of each new position
    num_decodes: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int64, padded with block 0
    decode_mask: torch.Tensor  # [num_decodes, 1, 1, max_blocks * block_size] additive: 0 where key < context, -inf past
    # One entry per prefill chunk: (first query row, query length, start position, block ids tensor, mask). The mask
    # is None for a first chunk (plain causal); a later chunk's is additive, [query length, start + query length].
    prefills: list[tuple[int, int, int, torch.Tensor, torch.Tensor | None]]


class PagedAttention:
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,  # [T, KVH, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
        v_cache: torch.Tensor,
        md: AttentionMetadata,
    ) -> torch.Tensor:
        kvh, d = self.num_kv_heads, self.head_dim
        k_cache.view(-1, kvh, d).index_copy_(0, md.slot_mapping, k)
        v_cache.view(-1, kvh, d).index_copy_(0, md.slot_mapping, v)
        out = torch.empty_like(q)
        if md.num_decodes:
            out[: md.num_decodes] = self._decode(q[: md.num_decodes], k_cache, v_cache, md)
        for row, q_len, start, block_ids, mask in md.prefills:
            qs = q[row : row + q_len]
            if start == 0:
                # A first chunk sees only itself: no gather from the cache needed.
                keys, values, causal = k[row : row + q_len], v[row : row + q_len], True
            else:
                ctx = start + q_len
                keys = k_cache.index_select(0, block_ids).view(-1, kvh, d)[:ctx]
                values = v_cache.index_select(0, block_ids).view(-1, kvh, d)[:ctx]
                causal = False
            # 4-D inputs ([1, heads, len, dim]): with 3-D ones torch's CPU SDPA falls back to its unfused math path,
            # which made a 1,500-token prefill 5x slower (benchmarks/prefill_attention.py).
            o = F.scaled_dot_product_attention(
                qs.transpose(0, 1).unsqueeze(0),
                keys.transpose(0, 1).unsqueeze(0),
                values.transpose(0, 1).unsqueeze(0),
                attn_mask=mask,
                is_causal=causal,
                scale=self.scale,
                enable_gqa=self.num_heads != kvh,
            )
            out[row : row + q_len] = o[0].transpose(0, 1)
        return out

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: AttentionMetadata):
        n, (kvh, d) = q.shape[0], (self.num_kv_heads, self.head_dim)
        # index_select copies whole blocks; advanced indexing with a 2-D index was 5-10x slower here.
        flat = md.decode_block_tables.view(-1)
        keys = k_cache.index_select(0, flat).view(n, -1, kvh, d).transpose(1, 2)  # [n, KVH, L, D]
        values = v_cache.index_select(0, flat).view(n, -1, kvh, d).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # [n, H, 1, D]
            keys,
            values,
            attn_mask=md.decode_mask,
            scale=self.scale,
            enable_gqa=self.num_heads != kvh,
        )
        return o.squeeze(2)
