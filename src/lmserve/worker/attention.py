"""Paged attention behind one interface: write new K/V into the block cache, attend causally over each request's blocks.

Two backends (`--attention-backend`):
- `sdpa`, portable: every decode (query length 1) goes into one SDPA call over K/V gathered from the blocks and padded
  to the longest context in the batch; each prefill chunk is one SDPA call. No Python loop over a sequence's tokens.
- `paged-cpu`: every row (decodes and prompt chunks alike) goes through a C++ kernel (worker/kernels/) that reads
  the blocks in place and computes each query row alone, in the same order, over its own context: no gather, no
  padding, and a row's attention the same bits however its prompt was chunked and whatever shared its step. SDPA's
  flash kernel sums in an order that depends on the chunk's length: a 4-token prompt computed as one chunk and as 3 + 1
  beside other requests differed by 1e-7 after the first layer, and on an AVX-512 CPU without AMX that changed a seeded
  request's first token (issue 32). A 1,810-token prompt's prefill takes 0.97x SDPA's time on the AVX-512 build
  and 1.07x on the AVX2 build (benchmarks/prefill_paged_vs_sdpa.py, docs/benchmarks.md).
`auto` picks paged-cpu on CPU with float32 when the kernel builds, sdpa otherwise.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from lmserve.worker.kernels import (
    cpu_flags,
    cpu_kernels_load,
    paged_attention_op,
    paged_keys_transposed,
    write_kv_cache_op,
)
from lmserve.worker.kv_int8 import dequantize_kv, int8_row_bytes, quantize_kv

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("auto", "sdpa", "paged-cpu")
PAGED_CPU_HEAD_DIMS = (8, 16, 32, 64, 128, 256)  # the sizes the kernel is compiled for


def check_attention_backend(name: str | None, device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """The backend to use; auto falls back to sdpa (with a warning if the kernel failed to build), an explicit choice
    that cannot run raises."""
    name = name or "auto"
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}: use one of {', '.join(ATTENTION_BACKENDS)}")
    if name == "sdpa":
        return name
    fits = device.type == "cpu" and dtype == torch.float32 and head_dim in PAGED_CPU_HEAD_DIMS
    if not fits:
        if name == "auto":
            return "sdpa"
        raise ValueError(
            f"--attention-backend paged-cpu runs on CPU with float32 and a head size in {PAGED_CPU_HEAD_DIMS} "
            f"(here: {device.type}, {dtype}, head size {head_dim})"
        )
    return "paged-cpu" if cpu_kernels_load(name != "auto", "attention falls back to sdpa") else "sdpa"


# int8: each position's K and V row of a kv head as int8 values with a float16 scale per 32 (worker/kv_int8.py).
KV_CACHE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "int8": torch.int8}
# vLLM's 8-bit cache names. CPUs have no fp8 arithmetic (vLLM's CPU backend converts fp8 too), and an int8 value
# with a scale per 32 keeps 7 bits of a group's range where e4m3 keeps 3 of each value's: they store as int8.
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")


def kv_cache_shapes(
    backend: str, num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int,
    dtype: torch.dtype = torch.float32,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The K and V caches' shapes. Blocks are head-major: one kv head's part of a block is contiguous. paged-cpu's
    kernel for AVX-512 stores each such part of K transposed, [head dim, block size], so that its scores for a vector
    of keys are one chain of multiply-adds along K's rows (worker/kernels/paged_attention.h). An int8 cache's rows
    hold their scales after their values (int8_row_bytes), K's as V's in every backend."""
    if dtype == torch.int8:
        shape = (num_blocks, num_kv_heads, block_size, int8_row_bytes(head_dim))
        return shape, shape
    v_shape = (num_blocks, num_kv_heads, block_size, head_dim)
    if keys_transposed(backend, dtype):
        return (num_blocks, num_kv_heads, head_dim, block_size), v_shape
    return v_shape, v_shape


def keys_transposed(backend: str, dtype: torch.dtype = torch.float32) -> bool:
    """Whether `backend` stores K blocks transposed (kv_cache_shapes)."""
    return backend == "paged-cpu" and dtype != torch.int8 and paged_keys_transposed()


def check_kv_cache_dtype(name: str | None, model_dtype: torch.dtype, backend: str) -> torch.dtype:
    """The KV cache's element type. float16 halves the bytes that attention streams per step and the memory per token,
    at float16's rounding of K and V; the paged-cpu kernel widens it with F16C. auto is float16 for a float32 model
    under paged-cpu on a CPU with F16C (as llama.cpp's f16 cache): a decode step of 16 requests ran 1.12x faster,
    and the default model's next-token distributions moved by a mean KL of 4e-7, six times less than a float32 model
    moves between chunked and one-pass prefill (benchmarks/kv_cache_dtype.py). Otherwise auto is the model's dtype.
    float32 keeps a float32 model's K and V exact. int8 (and vLLM's fp8 names, stored as int8) takes 34 bytes per 32
    values, 0.53x float16's, at a rounding of at most half a scale: docs/benchmarks.md measures what it costs."""
    name = name or "auto"
    if name == "auto":
        if backend == "paged-cpu" and model_dtype == torch.float32 and "f16c" in cpu_flags():
            return torch.float16
        return model_dtype
    if name in FP8_KV_CACHE_DTYPES:
        logger.info("--kv-cache-dtype %s: stored as int8 with a float16 scale per 32 values (CPUs have no fp8)", name)
        name = "int8"
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown KV cache dtype {name!r}: use one of auto, {', '.join(KV_CACHE_DTYPES)} "
                         f"(or vLLM's {', '.join(FP8_KV_CACHE_DTYPES)}, stored as int8)")
    dtype = KV_CACHE_DTYPES[name]
    if dtype == torch.float16 and backend == "paged-cpu" and "f16c" not in cpu_flags():
        raise ValueError("--kv-cache-dtype float16 with paged-cpu attention needs a CPU with F16C")
    return dtype


@dataclass(frozen=True)
class ScheduledChunk:
    """One request's share of the batch: `num_tokens` new positions from `start_position`, stored in `block_ids`."""

    start_position: int
    num_tokens: int
    block_ids: Sequence[int]


@dataclass
class AttentionMetadata:
    """Where each new position's K/V goes and which cached positions each query may see.

    The batch is ordered decodes first, then prefill chunks, so decode queries are rows [0, num_decodes).
    """

    slot_mapping: torch.Tensor  # [num_tokens] long: flat slot (block * block_size + offset) of each new position
    num_decodes: int
    # sdpa: int64 [num_decodes, max_blocks] padded with block 0. paged-cpu: int32, one row per entry of
    # decode_requests.
    decode_block_tables: torch.Tensor
    # sdpa only: additive [num_decodes, 1, 1, max_blocks * block_size], 0 where key < context, -inf past it.
    decode_mask: torch.Tensor | None
    # paged-cpu only: int64 [entries, 3] of (first query row, query length, context length): the decodes, then the
    # short chunks that follow cached positions.
    decode_requests: torch.Tensor | None
    # One entry per prefill chunk: (first query row, query length, start position, block ids tensor, mask). The mask
    # is None for a first chunk (plain causal); a later chunk's is additive, [query length, start + query length].
    prefills: list[tuple[int, int, int, torch.Tensor, torch.Tensor | None]]
    block_size: int  # positions per cache block
    backend: str  # the attention backend this metadata was built for
    # sdpa only: int64 [num_decodes], each decode's context length (its position + 1), for sliding-window masks.
    decode_context: torch.Tensor | None = None
    # With sliding layers in KV-cache groups of their own: every group's metadata (this one is group 0's).
    groups: list[AttentionMetadata] | None = field(default=None, repr=False)
    _cache_rows: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    _window_masks: dict[tuple[int, int], torch.Tensor | None] = field(default_factory=dict, repr=False)

    def window_decode_mask(self, window: int) -> torch.Tensor | None:
        """sdpa: decode_mask with the keys before each decode's sliding window masked out too. Built once a step."""
        key = (window, -1)
        if key not in self._window_masks:
            assert self.decode_mask is not None and self.decode_context is not None
            keys = torch.arange(self.decode_mask.shape[-1], device=self.decode_mask.device)
            outside = keys[None, :] <= (self.decode_context[:, None] - 1 - window)
            self._window_masks[key] = self.decode_mask.masked_fill(outside.view(self.decode_mask.shape), float("-inf"))
        return self._window_masks[key]

    def window_chunk_mask(self, window: int, start: int, num_tokens: int, dtype: torch.dtype) -> torch.Tensor | None:
        """sdpa: the additive mask of a prefill chunk at positions [start, start + num_tokens) over keys [0, start +
        num_tokens) under a sliding window; None where the window hides nothing the causal mask shows."""
        key = (window, start * (1 << 32) + num_tokens)
        if key not in self._window_masks:
            mask = None
            if start + num_tokens > window:
                positions = np.arange(start, start + num_tokens)[:, None]
                keys = np.arange(start + num_tokens)[None, :]
                visible = (keys <= positions) & (keys > positions - window)
                mask = torch.as_tensor(np.where(visible, 0.0, -np.inf), dtype=dtype, device=self.slot_mapping.device)
            self._window_masks[key] = mask
        return self._window_masks[key]

    def cache_rows(self, num_kv_heads: int) -> torch.Tensor:
        """[num_tokens * num_kv_heads] long: the row of a [blocks * kv heads * block size, head dim] view of the
        cache where each new position's K (or V) of each kv head goes. Built by the first layer, reused by the rest."""
        rows = self._cache_rows.get(num_kv_heads)
        if rows is None:
            block, offset = self.slot_mapping // self.block_size, self.slot_mapping % self.block_size
            heads = torch.arange(num_kv_heads, device=self.slot_mapping.device)
            rows = ((block[:, None] * num_kv_heads + heads) * self.block_size + offset[:, None]).reshape(-1)
            self._cache_rows[num_kv_heads] = rows
        return rows


@dataclass
class WholeSequences:
    """A batch of whole sequences attended without a KV cache (a decoder run as a pooling model: Qwen3-Embedding,
    EmbeddingGemma): each sequence's rows attend over its own rows only, causally or (`causal` False, EmbeddingGemma's
    use_bidirectional_attention) both ways, and nothing is written anywhere (no decode follows: worker/
    pooling_runner.py). Passed where the layers take their AttentionMetadata; their KV caches are (None, None)."""

    seq_lens: list[int]
    causal: bool
    # (length, window) -> additive mask, built by the first layer that needs it and reused by the rest.
    _masks: dict[tuple[int, int], torch.Tensor | None] = field(default_factory=dict, repr=False)

    def window_mask(self, length: int, window: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """A sliding window's additive mask over one sequence: causal, a key within `window` positions before the
        query (kv > q - window, as transformers' sliding_window_overlay); both ways, a key within window - 1 of it on
        either side (|q - kv| < window, as Gemma 3's _bidirectional_window_overlay). None where nothing is cut."""
        key = (length, window)
        if key not in self._masks:
            position = np.arange(length)
            distance = position[None, :] - position[:, None]  # key - query
            visible = ((distance <= 0) & (distance > -window)) if self.causal else (np.abs(distance) < window)
            if not self.causal and visible.all():
                self._masks[key] = None
            else:
                self._masks[key] = torch.as_tensor(np.where(visible, 0.0, -np.inf), dtype=dtype, device=device)
        return self._masks[key]


def build_metadata(
    chunks: list[ScheduledChunk], block_size: int, backend: str, device: torch.device, dtype: torch.dtype
) -> AttentionMetadata:
    """Metadata for a batch whose rows are `chunks` in order; decodes (num_tokens == 1) must come first. Under
    paged-cpu every chunk runs the paged kernel (row by row, so a row's attention does not depend on its chunking);
    under sdpa each decode joins one padded SDPA call and each longer chunk is an SDPA call of its own."""
    bs = block_size
    slots: list[np.ndarray] = []
    prefills: list[tuple[int, int, int, torch.Tensor, torch.Tensor | None]] = []
    paged: list[tuple[int, ScheduledChunk]] = []  # (first query row, chunk): the decodes, then (paged-cpu) the rest
    num_decodes = row = 0
    for c in chunks:
        pos = np.arange(c.start_position, c.start_position + c.num_tokens)
        table = np.asarray(c.block_ids, dtype=np.int64)
        slots.append(table[pos // bs] * bs + pos % bs)
        if c.num_tokens == 1:
            assert not prefills and num_decodes == len(paged), "decodes must come before prefill chunks"
            paged.append((row, c))
            num_decodes += 1
        elif backend == "paged-cpu":
            paged.append((row, c))
        else:
            nblocks = -(-(c.start_position + c.num_tokens) // bs)
            block_ids = torch.as_tensor(table[:nblocks], device=device)
            prefills.append((row, c.num_tokens, c.start_position, block_ids, _chunk_mask(pos, dtype, device)))
        row += c.num_tokens
    context = np.array([c.start_position + c.num_tokens for _, c in paged], dtype=np.int64)
    max_blocks = int(-(-context.max() // bs)) if paged else 0
    tables = np.zeros((len(paged), max_blocks), dtype=np.int32 if backend == "paged-cpu" else np.int64)
    for i, (_, c) in enumerate(paged):
        n = -(-int(context[i]) // bs)
        tables[i, :n] = c.block_ids[:n]
    mask = requests = decode_context = None
    if backend == "paged-cpu":
        rows = np.array([[first, c.num_tokens] for first, c in paged], dtype=np.int64).reshape(-1, 2)
        requests = torch.as_tensor(np.concatenate([rows, context[:, None]], axis=1))
    else:
        # Additive (0 / -inf) rather than boolean: SDPA would convert a boolean mask again in every layer.
        visible = np.arange(max_blocks * bs)[None, :] < context[:, None]
        mask = torch.as_tensor(np.where(visible, 0.0, -np.inf), dtype=dtype, device=device)
        mask = mask.view(len(paged), 1, 1, max_blocks * bs)
        decode_context = torch.as_tensor(context, device=device)
    return AttentionMetadata(
        slot_mapping=torch.as_tensor(np.concatenate(slots), device=device),
        num_decodes=num_decodes,
        decode_block_tables=torch.as_tensor(tables, device=device),
        decode_mask=mask,
        decode_requests=requests,
        prefills=prefills,
        block_size=bs,
        backend=backend,
        decode_context=decode_context,
    )


def _gather(
    cache: torch.Tensor, block_ids: torch.Tensor, context: int, dtype: torch.dtype, head_dim: int,
    transposed: bool = False,
) -> torch.Tensor:
    """[KVH, context, D]: a sequence's first `context` cached positions, copied out of its blocks ([blocks, KVH,
    block size, D], or [blocks, KVH, D, block size] where `transposed`: kv_cache_shapes; int8 rows dequantized)."""
    blocks = cache.index_select(0, block_ids)
    if cache.dtype == torch.int8:
        blocks = dequantize_kv(blocks, head_dim)
    if transposed:
        blocks = blocks.transpose(2, 3)
    return blocks.transpose(0, 1).reshape(cache.shape[1], -1, blocks.shape[3])[:, :context].to(dtype)


def _chunk_mask(positions: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """Additive causal mask of a prefill chunk that follows cached positions, built once for all layers."""
    if positions[0] == 0:
        return None
    visible = np.arange(positions[-1] + 1)[None, :] <= positions[:, None]
    return torch.as_tensor(np.where(visible, 0.0, -np.inf), dtype=dtype, device=device)


def _attend(q, k, v, mask: torch.Tensor | None, causal: bool, scale: float, softcap: float,
            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of [B, H, Q, D] queries over [B, KVH, K, D] keys and values. SDPA, unless softcap > 0 (Gemma 2's
    tanh cap on the scores) or sinks ([H], gpt-oss's logit per head that joins the softmax and takes no value),
    which SDPA cannot apply: then the same steps written out, in float32."""
    gqa = q.shape[1] != k.shape[1]
    if not softcap and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1).float(), v.repeat_interleave(group, 1).float()
    if softcap:
        scores = torch.tanh(q.float() @ k.transpose(-1, -2) * (scale / softcap)) * softcap
    else:
        scores = q.float() @ k.transpose(-1, -2) * scale
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    if mask is not None:
        scores = scores + mask
    if sinks is None:
        return (scores.softmax(-1) @ v).to(q.dtype)
    # The sink as one more column of every row's scores, dropped after the softmax (transformers' gpt-oss).
    sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    return (probs @ v).to(q.dtype)


class PagedAttention:
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, window: int = 0,
                 softcap: float = 0.0) -> None:
        """window: a sliding window of that many positions (0: none), as Gemma's local layers; softcap > 0: Gemma 2's
        cap on the attention scores, softcap * tanh(score / softcap)."""
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.window = window
        self.softcap = softcap

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,  # [T, KVH, D]
        k_cache: torch.Tensor,  # kv_cache_shapes(md.backend, ...)
        v_cache: torch.Tensor,
        md: AttentionMetadata | WholeSequences,
        sinks: torch.Tensor | None = None,  # [H] float32: gpt-oss's sink logit per head (not with WholeSequences)
    ) -> torch.Tensor:
        if isinstance(md, WholeSequences):
            return self._whole_sequences(q, k, v, md)
        kvh, d = self.num_kv_heads, self.head_dim
        rows = md.cache_rows(kvh)
        if md.backend == "paged-cpu":  # one op for both writes and the float16 conversion (benchmarks/step_ab.py)
            write_kv_cache_op()(k_cache, v_cache, k, v, rows)
        elif k_cache.dtype == torch.int8:
            width = k_cache.shape[-1]
            k_cache.view(-1, width).index_copy_(0, rows, quantize_kv(k).reshape(-1, width))
            v_cache.view(-1, width).index_copy_(0, rows, quantize_kv(v).reshape(-1, width))
        else:
            k_cache.view(-1, d).index_copy_(0, rows, k.reshape(-1, d).to(k_cache.dtype))
            v_cache.view(-1, d).index_copy_(0, rows, v.reshape(-1, d).to(v_cache.dtype))
        out = torch.empty_like(q)
        if md.decode_requests is not None:
            if len(md.decode_requests):
                paged_attention_op()(out, q, k_cache, v_cache, md.decode_block_tables, md.decode_requests, self.scale,
                                     self.window, self.softcap, sinks)
        elif md.num_decodes:
            out[: md.num_decodes] = self._decode(q[: md.num_decodes], k_cache, v_cache, md, sinks)
        for row, q_len, start, block_ids, mask in md.prefills:
            qs = q[row : row + q_len]
            if start == 0:
                # A first chunk sees only itself: no gather from the cache needed. Its K and V as the cache holds them
                # (rounded to a float16 cache's precision), so that a prompt attends to the same values whether it
                # runs in one chunk or in several, whose later ones read the cache.
                keys, values = k[row : row + q_len], v[row : row + q_len]
                if k_cache.dtype == torch.int8:
                    keys = dequantize_kv(quantize_kv(keys), d, keys.dtype)
                    values = dequantize_kv(quantize_kv(values), d, values.dtype)
                elif k_cache.dtype != keys.dtype:
                    keys, values = keys.to(k_cache.dtype).to(keys.dtype), values.to(v_cache.dtype).to(values.dtype)
                keys, values = keys.transpose(0, 1), values.transpose(0, 1)
                causal = True
                if self.window:
                    mask = md.window_chunk_mask(self.window, start, q_len, q.dtype)
                    causal = mask is None
            else:
                keys = _gather(k_cache, block_ids, start + q_len, q.dtype, d,
                               transposed=keys_transposed(md.backend, k_cache.dtype))
                values = _gather(v_cache, block_ids, start + q_len, q.dtype, d)
                causal = False
                windowed = md.window_chunk_mask(self.window, start, q_len, q.dtype) if self.window else None
                mask = mask if windowed is None else windowed
            # 4-D inputs ([1, heads, len, dim]): with 3-D ones torch's CPU SDPA falls back to its unfused math path,
            # which made a 1,500-token prefill 5x slower (benchmarks/prefill_attention.py).
            o = _attend(qs.transpose(0, 1).unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), mask, causal,
                        self.scale, self.softcap, sinks)
            out[row : row + q_len] = o[0].transpose(0, 1)
        return out

    def _whole_sequences(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: WholeSequences) -> torch.Tensor:
        """Each sequence's rows over its own rows, one SDPA call a sequence (4-D, as the prefill path, for torch's
        fused CPU kernel); a row's result does not depend on the other sequences of the batch."""
        out = torch.empty_like(q)
        row = 0
        for n in md.seq_lens:
            rows = slice(row, row + n)
            mask = md.window_mask(n, self.window, q.dtype, q.device) if self.window and n > 1 else None
            causal = md.causal and mask is None
            o = _attend(q[rows].transpose(0, 1).unsqueeze(0), k[rows].transpose(0, 1).unsqueeze(0),
                        v[rows].transpose(0, 1).unsqueeze(0), mask, causal, self.scale, self.softcap)
            out[rows] = o[0].transpose(0, 1)
            row += n
        return out

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: AttentionMetadata,
                sinks: torch.Tensor | None = None):
        n, (kvh, d) = q.shape[0], (self.num_kv_heads, self.head_dim)
        # index_select copies whole blocks; advanced indexing with a 2-D index was 5-10x slower here.
        flat = md.decode_block_tables.view(-1)
        keys, values = k_cache.index_select(0, flat), v_cache.index_select(0, flat)
        if k_cache.dtype == torch.int8:
            keys, values = dequantize_kv(keys, d, q.dtype), dequantize_kv(values, d, q.dtype)
        keys = keys.view(n, -1, kvh, md.block_size, d)  # [n, blocks, KVH, block, D]
        keys = keys.transpose(1, 2).reshape(n, kvh, -1, d).to(q.dtype)  # [n, KVH, L, D]
        values = values.view(n, -1, kvh, md.block_size, d)
        values = values.transpose(1, 2).reshape(n, kvh, -1, d).to(q.dtype)
        mask = md.window_decode_mask(self.window) if self.window else md.decode_mask
        o = _attend(q.unsqueeze(2), keys, values, mask, False, self.scale, self.softcap, sinks)  # q: [n, H, 1, D]
        return o.squeeze(2)
