"""The int8 KV cache (`--kv-cache-dtype int8`): its rows (worker/kv_int8.py), the paged-cpu kernel's int8 write and
reads against the float32 kernel over the dequantized cache (the same bits) and against float64 attention over the
unquantized K/V (within the bound int8's rounding allows), a row's bits whatever shares its step, and the sdpa
backend's int8 path against the kernel's. Run under a forced build (LMSERVE_KERNEL_MARCH) these cover that build's
kernel too."""

from __future__ import annotations

import math

import pytest
import torch
from test_paged_attention import reference

from lmserve.kv_sizing import kv_bytes_per_token, kv_row_bytes
from lmserve.worker import attention, kernels
from lmserve.worker.attention import (
    PagedAttention,
    ScheduledChunk,
    build_metadata,
    check_kv_cache_dtype,
    keys_transposed,
    kv_cache_shapes,
)
from lmserve.worker.kernels import paged_attention_op
from lmserve.worker.kv_int8 import dequantize_kv, int8_row_bytes, quantize_kv

CPU = torch.device("cpu")
SHAPES = [(9, 3, 64, 16), (4, 4, 16, 16), (8, 2, 128, 32), (2, 1, 8, 4), (6, 3, 32, 16), (4, 1, 256, 16)]


def int8_cache(num_blocks: int, kv_heads: int, block_size: int, head_dim: int, gen: torch.Generator,
               outlier: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(unquantized float values, their int8 rows) of a cache; `outlier` adds a channel of that magnitude (as
    Qwen2's K holds)."""
    values = torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=gen)
    values[..., 3] += outlier
    return values, quantize_kv(values)


def test_rows_hold_values_and_float16_scales_within_half_a_step() -> None:
    gen = torch.Generator().manual_seed(0)
    # Magnitudes whose scales are normal float16 numbers (a scale below 6e-5 is subnormal, and coarser)
    x = torch.randn(50, 3, 64, generator=gen) * torch.logspace(-2, 3, 50)[:, None, None]
    x[0, 0] = 0.0  # a row of zeros: scale 0, values 0
    x[1, 0, :32] = 1e-30  # a group below float16's range: stored as zeros
    rows = quantize_kv(x)
    assert rows.dtype == torch.int8 and rows.shape == (50, 3, 64 + 4) == (50, 3, int8_row_bytes(64))
    scales = rows[..., 64:].contiguous().view(torch.float16).float()  # one per 32 values, after them
    groups = x.reshape(50, 3, 2, 32)
    torch.testing.assert_close(scales, (groups.abs().amax(-1) * (1 / 127)).half().float(), rtol=0, atol=0)
    back = dequantize_kv(rows, 64)
    error = (back - x).reshape(50, 3, 2, 32).abs().amax(-1)
    assert (error <= scales / 2 * (1 + 1e-6) + 1e-30).all()
    assert back[0, 0].abs().max() == 0 and back[1, 0, :32].abs().max() == 0
    assert (rows[..., :64].abs() <= 127).all() and (rows[..., :64].abs() == 127).any()
    # A head size that is not a multiple of 32 has one scale for its row.
    assert quantize_kv(torch.randn(2, 16)).shape == (2, 18) and int8_row_bytes(80) == 82
    # 34 bytes per 32 values, as llama.cpp's q8_0: 0.53x a float16 cache.
    assert kv_bytes_per_token(24, 2, 64, "int8") == 2 * 24 * 2 * 68 and kv_row_bytes(128, 2) == 256


@pytest.mark.parametrize("tokens", [1, 300])  # a decode, and enough rows to split over the threads
@pytest.mark.parametrize("head_dim", [64, 16, 256])
def test_the_kernels_write_is_quantize_kv_bit_for_bit(tokens: int, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(7)
    kv_heads, bs = 3, 16
    fused = torch.randn(tokens, 9 + 2 * kv_heads, head_dim, generator=gen) * 30
    fused[0, 9, :5] = torch.tensor([1e-6, -1e-7, 65519.0, 7e4, 1.0 + 2**-11])
    k, v = fused[:, 9 : 9 + kv_heads], fused[:, 9 + kv_heads :]  # strided, as the qkv split hands them over
    slots = torch.randperm(40 * bs, generator=gen)[:tokens]
    chunks = [ScheduledChunk(int(s) % bs, 1, [int(s) // bs]) for s in slots]
    rows = build_metadata(chunks, bs, "paged-cpu", CPU, torch.float32).cache_rows(kv_heads)
    k_shape, v_shape = kv_cache_shapes("paged-cpu", 40, kv_heads, bs, head_dim, torch.int8)
    assert k_shape == v_shape == (40, kv_heads, bs, int8_row_bytes(head_dim))  # K as V's in every build
    k_op, v_op = torch.zeros(k_shape, dtype=torch.int8), torch.zeros(v_shape, dtype=torch.int8)
    k_ref, v_ref = k_op.clone(), v_op.clone()
    kernels.write_kv_cache_op()(k_op, v_op, k, v, rows)
    width = k_shape[-1]
    k_ref.view(-1, width).index_copy_(0, rows, quantize_kv(k).reshape(-1, width))
    v_ref.view(-1, width).index_copy_(0, rows, quantize_kv(v).reshape(-1, width))
    assert torch.equal(k_op, k_ref) and torch.equal(v_op, v_ref)
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernels.write_kv_cache_op()(k_op, v_op, k, v, rows + 40 * kv_heads * bs)
    with pytest.raises(RuntimeError, match="V cache must be"):  # a float-shaped int8 cache
        kernels.write_kv_cache_op()(k_op[..., :head_dim].contiguous(), v_op[..., :head_dim].contiguous(), k, v, rows)


def int8_error_bound(q: torch.Tensor, values: torch.Tensor, rows: torch.Tensor, keys_rows: torch.Tensor,
                     head_dim: int, scale: float) -> float:
    """What int8 rounding can move an attention output by, at most: each K value moves by at most half its group's
    step, so a score moves by at most Δ = scale × Σ|q| × max half step of K, the softmax weights by a factor within
    e^±2Δ, and each V value by at most half its step: |Δout| <= (e^2Δ - 1) max|v| + max half step of V."""
    def half_step(r: torch.Tensor) -> float:
        return r[..., head_dim:].contiguous().view(torch.float16).float().max().item() / 2

    delta = scale * q.abs().sum(-1).max().item() * half_step(keys_rows)
    return math.expm1(2 * delta) * values.abs().max().item() + half_step(rows)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"), SHAPES)
@pytest.mark.parametrize("window", [0, 19])
def test_int8_kernel_is_the_float_kernel_over_the_dequantized_cache(num_heads: int, num_kv_heads: int, head_dim: int,
                                                                     block_size: int, window: int) -> None:
    """Decodes at block edges, first chunks, chunks after cached prefixes that cross the 16-query tiles: the int8
    cache's output is the float32 kernel's over its dequantized values bit for bit (the kernel dequantizes a block,
    then runs its float32 path), float64 attention over those values to rounding, and float64 attention over the
    unquantized values within int8's error bound (and not closer than float32 rounding: the int8 path really ran)."""
    gen = torch.Generator().manual_seed(3)
    num_blocks = 96
    k_values, k_rows = int8_cache(num_blocks, num_kv_heads, block_size, head_dim, gen, outlier=8.0)
    v_values, v_rows = int8_cache(num_blocks, num_kv_heads, block_size, head_dim, gen)
    k_dequant, v_dequant = dequantize_kv(k_rows, head_dim), dequantize_kv(v_rows, head_dim)
    requests = [(1, 1), (1, block_size), (1, block_size + 1), (5, 5), (17, 3 * block_size + 21), (40, 130), (1, 77)]
    tables = torch.randperm(num_blocks, generator=gen)
    max_blocks = max(-(-ctx // block_size) for _, ctx in requests)
    block_tables = torch.zeros(len(requests), max_blocks, dtype=torch.int32)
    rows, used, first_rows = 1, 0, []
    for i, (q_len, ctx) in enumerate(requests):
        n = -(-ctx // block_size)
        block_tables[i, :n] = tables[used : used + n].int()
        used += n
        first_rows.append(rows)
        rows += q_len
    q = torch.randn(rows + 2, num_heads, head_dim, generator=gen)[:rows]
    info = torch.tensor([(r, q_len, ctx) for r, (q_len, ctx) in zip(first_rows, requests, strict=True)])
    scale = head_dim**-0.5
    out_int8, out_float = torch.full_like(q, 7.0), torch.full_like(q, 7.0)
    paged_attention_op()(out_int8, q, k_rows, v_rows, block_tables, info, scale, window)
    float_keys = k_dequant.transpose(2, 3).contiguous() if keys_transposed("paged-cpu") else k_dequant
    paged_attention_op()(out_float, q, float_keys, v_dequant, block_tables, info, scale, window)
    assert (out_int8[0] == 7.0).all()
    assert torch.equal(out_int8, out_float)
    largest_error = 0.0
    for i, (q_len, ctx) in enumerate(requests):
        r, table = first_rows[i], block_tables[i].long().tolist()
        rows_out = out_int8[r : r + q_len].double()
        torch.testing.assert_close(rows_out, reference(q[r : r + q_len], k_dequant, v_dequant, table, ctx, window),
                                   atol=2e-6, rtol=1e-5)
        exact = reference(q[r : r + q_len], k_values, v_values, table, ctx, window)
        blocks = block_tables[i, : -(-ctx // block_size)].long()
        bound = int8_error_bound(q[r : r + q_len], v_values[blocks], v_rows[blocks], k_rows[blocks], head_dim, scale)
        error = (rows_out - exact).abs().max().item()
        assert error <= bound, (i, error, bound)
        largest_error = max(largest_error, error)
    assert largest_error > 1e-4  # int8's rounding, far above float32's


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"), SHAPES[:5])
def test_an_int8_row_is_the_same_bits_whatever_shares_its_step(num_heads: int, num_kv_heads: int, head_dim: int,
                                                                block_size: int) -> None:
    """Batch invariance over an int8 cache: a 70-token prompt's rows as one chunk, token by token, and in chunks beside
    other requests' decodes give the same bits."""
    gen = torch.Generator().manual_seed(11)
    context = 70
    blocks = -(-context // block_size)
    _, k_rows = int8_cache(blocks + 8, num_kv_heads, block_size, head_dim, gen)
    _, v_rows = int8_cache(blocks + 8, num_kv_heads, block_size, head_dim, gen)
    table = torch.randperm(blocks + 8, generator=gen)[:blocks].int()
    q = torch.randn(context, num_heads, head_dim, generator=gen)
    other = torch.randn(3, num_heads, head_dim, generator=gen)

    def attend(pieces: list[tuple[int, int]], with_others: bool) -> torch.Tensor:
        out = torch.empty_like(q)
        for first, count in pieces:
            rows = torch.cat([other, q[first : first + count]]) if with_others else q[first : first + count]
            info = ([[i, 1, 20 + i] for i in range(3)] if with_others else []) + [[len(rows) - count, count,
                                                                                    first + count]]
            tables = table[None].expand(len(info), -1).contiguous()
            result = torch.empty_like(rows)
            paged_attention_op()(result, rows.contiguous(), k_rows, v_rows, tables, torch.tensor(info),
                                 head_dim**-0.5)
            out[first : first + count] = result[len(rows) - count :]
        return out

    whole = attend([(0, context)], with_others=False)
    assert torch.equal(attend([(i, 1) for i in range(context)], with_others=False), whole)
    assert torch.equal(attend([(0, 5), (5, 16), (21, 49)], with_others=True), whole)
    assert torch.equal(attend([(0, 33), (33, 37)], with_others=True), whole)


def test_both_backends_write_and_attend_alike_over_an_int8_cache() -> None:
    """Decodes, a short chunk after cached positions, a long one and a first chunk: paged-cpu (the kernel's write and
    reads) and sdpa (quantize_kv and dequantize_kv around SDPA) store the same rows and attend to the same values."""
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, bs = 9, 3, 64, 16
    _, k_rows = int8_cache(40, kv_heads, bs, dim, gen)
    _, v_rows = int8_cache(40, kv_heads, bs, dim, gen)
    chunks = [ScheduledChunk(37, 1, [0, 1, 2]), ScheduledChunk(5, 1, [3]), ScheduledChunk(40, 12, [4, 5, 6, 7]),
              ScheduledChunk(33, 23, [8, 9, 10, 11]), ScheduledChunk(0, 9, [12])]
    rows = sum(c.num_tokens for c in chunks)
    q = torch.randn(rows, heads, dim, generator=gen)
    k, v = torch.randn(rows, kv_heads, dim, generator=gen), torch.randn(rows, kv_heads, dim, generator=gen)
    layer = PagedAttention(heads, kv_heads, dim, dim**-0.5)
    outs, written = {}, {}
    for backend in ("paged-cpu", "sdpa"):
        md = build_metadata(chunks, bs, backend, CPU, torch.float32)
        written[backend] = (k_rows.clone(), v_rows.clone())
        outs[backend] = layer.forward(q, k, v, *written[backend], md)
    assert torch.equal(written["paged-cpu"][0], written["sdpa"][0])
    assert torch.equal(written["paged-cpu"][1], written["sdpa"][1])
    assert not torch.equal(written["sdpa"][0], k_rows)
    torch.testing.assert_close(outs["paged-cpu"], outs["sdpa"], atol=1e-5, rtol=1e-5)
    k_full, v_full = (dequantize_kv(t, dim) for t in written["paged-cpu"])
    torch.testing.assert_close(outs["sdpa"][:1].double(), reference(q[:1], k_full, v_full, [0, 1, 2], 38),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs["sdpa"][2:14].double(), reference(q[2:14], k_full, v_full, [4, 5, 6, 7], 52),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs["sdpa"][-9:].double(), reference(q[-9:], k_full, v_full, [12], 9),
                               atol=1e-5, rtol=1e-5)


def test_int8_and_vllms_fp8_names_and_a_bad_name(monkeypatch, caplog) -> None:
    monkeypatch.setattr(attention, "cpu_flags", lambda: frozenset({"avx2"}))  # int8 needs no F16C
    for backend in ("paged-cpu", "sdpa"):
        assert check_kv_cache_dtype("int8", torch.float32, backend) == torch.int8
        for name in ("fp8", "fp8_e4m3", "fp8_e5m2"):
            with caplog.at_level("INFO"):
                assert check_kv_cache_dtype(name, torch.float32, backend) == torch.int8
            assert f"--kv-cache-dtype {name}: stored as int8" in caplog.text
    with pytest.raises(ValueError, match=r"unknown KV cache dtype 'fp8_inc': use one of auto, float32, float16, int8 "
                                         r"\(or vLLM's fp8, fp8_e4m3, fp8_e5m2, stored as int8\)"):
        check_kv_cache_dtype("fp8_inc", torch.float32, "paged-cpu")
