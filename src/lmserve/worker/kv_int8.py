"""The int8 KV cache's rows in PyTorch (`--kv-cache-dtype int8`): what the sdpa backend writes and reads, and the
reference the paged-cpu kernels (worker/kernels/paged_attention.h, quantize_row) are tested against.

A row is one position's K (or V) of one kv head: head_dim int8 values, then one float16 scale per group of
lmserve.kv_sizing.int8_kv_group(head_dim) values (32: llama.cpp's q8_0 block), as the row's last bytes. A value is
q × scale; the scale is the group's largest magnitude / 127, rounded to float16, and q = round(x / scale) (ties to
even) within ±127. The scales live inside the cache's own rows, so that whatever moves a block (the prefix cache,
the KV connectors' gather and scatter) moves its scales with it.

Why per position and 32 values, not per block and head: a block fills one position at a time during decode, and
a scale shared by the block would have to grow (and every value before it be requantized) whenever a new position
held a larger value. Per 32 values the scale follows the channels of outlying magnitude that K holds (Qwen2's k
bias): one scale per position and head of 64 or 128 values lets one such channel coarsen all the others.
"""

from __future__ import annotations

import torch

from lmserve.kv_sizing import int8_kv_group, kv_row_bytes

FLOAT16_MAX = 65504.0
ONE_127TH = 1.0 / 127.0  # multiplied, as the kernel does (a division could round another way under -ffast-math)


def int8_row_bytes(head_dim: int) -> int:
    """The bytes of one int8 cache row of head_dim values (kv_sizing.kv_row_bytes)."""
    return kv_row_bytes(head_dim, "int8")


def quantize_kv(x: torch.Tensor) -> torch.Tensor:
    """[..., head_dim] float → [..., int8_row_bytes(head_dim)] int8 rows: the values, then their float16 scales."""
    head_dim = x.shape[-1]
    group = int8_kv_group(head_dim)
    grouped = x.float().reshape(*x.shape[:-1], head_dim // group, group)
    scale = (grouped.abs().amax(-1) * ONE_127TH).clamp(max=FLOAT16_MAX).to(torch.float16)
    wide = scale.float()
    inverse = torch.where(wide > 0, 1.0 / wide, torch.zeros_like(wide))
    values = torch.round(grouped * inverse[..., None]).clamp(-127, 127).to(torch.int8).reshape(x.shape)
    return torch.cat([values, scale.view(torch.int8)], dim=-1)


def dequantize_kv(rows: torch.Tensor, head_dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """quantize_kv's inverse: [..., int8_row_bytes(head_dim)] int8 rows → [..., head_dim] values (q × scale, which
    float32 holds exactly: 8 bits times float16's 11)."""
    group = int8_kv_group(head_dim)
    values = rows[..., :head_dim].float().reshape(*rows.shape[:-1], head_dim // group, group)
    scale = rows[..., head_dim:].contiguous().view(torch.float16).float()
    return (values * scale[..., None]).reshape(*rows.shape[:-1], head_dim).to(dtype)
