"""The paged-cpu attention kernel against float64 math, and how a backend is chosen and its metadata built."""

from __future__ import annotations

import logging

import pytest
import torch

from lmserve.worker import attention, kernels
from lmserve.worker.attention import (
    PagedAttention,
    ScheduledChunk,
    build_metadata,
    check_attention_backend,
    check_kv_cache_dtype,
    kv_cache_shapes,
)
from lmserve.worker.kernels import paged_attention_op, paged_keys_transposed

CPU = torch.device("cpu")


def in_kernel_layout(k_cache: torch.Tensor) -> torch.Tensor:
    """A [blocks, kv heads, block size, head dim] K cache in the built kernel's layout: [blocks, kv heads, head dim,
    block size] where it reads K transposed (attention.kv_cache_shapes)."""
    return k_cache.transpose(2, 3).contiguous() if paged_keys_transposed() else k_cache.clone()


def from_kernel_layout(k_cache: torch.Tensor) -> torch.Tensor:
    """in_kernel_layout's inverse."""
    return k_cache.transpose(2, 3) if paged_keys_transposed() else k_cache


def reference(q: torch.Tensor, k_cache, v_cache, block_ids: list[int], context: int, window: int = 0,
              softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention in float64 for queries at the last q.shape[0] positions of a `context`-long sequence; under a
    sliding `window` a query sees its last `window` positions only (transformers' key > query - window),
    softcap > 0 caps the scores as Gemma 2 does, and sinks ([heads]) join each head's softmax as one more score
    whose probability is dropped (gpt-oss, transformers' eager_attention_forward)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    # The cache is [blocks, kv heads, block size, head dim]: positions in order are each block's rows, block by block.
    keys = k_cache[block_ids].transpose(1, 2).reshape(-1, k_cache.shape[1], head_dim)[:context].double()
    values = v_cache[block_ids].transpose(1, 2).reshape(-1, v_cache.shape[1], head_dim)[:context].double()
    group = num_heads // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * head_dim**-0.5
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    positions = torch.arange(context - q.shape[0], context)[:, None]
    key_positions = torch.arange(context)[None, :]
    hidden = (key_positions > positions) | ((key_positions <= positions - window) if window else False)
    scores = scores.masked_fill(hidden, float("-inf"))
    if sinks is not None:
        sink = sinks.double().view(-1, 1, 1).expand(*scores.shape[:2], 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        return torch.einsum("hqk,khd->qhd", probs, values)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size", "window", "softcap", "with_sinks"),
    [(9, 3, 64, 16, 0, 0.0, False), (4, 4, 16, 16, 0, 0.0, False), (8, 2, 128, 32, 0, 0.0, False),
     (2, 1, 8, 4, 0, 0.0, False), (6, 3, 32, 16, 0, 0.0, False),
     # Sliding windows shorter than a block, of a block and a bit, longer than most contexts; Gemma 2's cap.
     (4, 1, 256, 16, 5, 0.0, False), (9, 3, 64, 16, 19, 0.0, False), (8, 2, 128, 32, 64, 0.0, False),
     (4, 2, 64, 16, 0, 2.0, False), (6, 3, 32, 16, 37, 1.5, False),
     # gpt-oss's sinks, alone and with its sliding window (8 of 16 positions a block).
     (8, 2, 64, 16, 0, 0.0, True), (4, 4, 16, 16, 8, 0.0, True), (9, 3, 64, 16, 19, 0.0, True)],
)
def test_kernel_matches_float64_attention(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                                          window: int, softcap: float, with_sinks: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    # Sinks from far below to far above the scores (|score| ~ 1): each branch of the kernel's final scale.
    sinks = torch.randn(num_heads, generator=gen) * 4 if with_sinks else None
    num_blocks = 96
    k_cache = torch.randn(num_blocks, num_kv_heads, block_size, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, num_kv_heads, block_size, head_dim, generator=gen)
    # (query length, context): one-token decodes at block edges, a whole first chunk, chunks over a cached prefix
    # that cross the kernel's 16-query tiles and start mid-block.
    requests = [(1, 1), (1, block_size), (1, block_size + 1), (5, 5), (17, 3 * block_size + 21), (40, 130), (1, 77)]
    tables = torch.randperm(num_blocks, generator=gen)
    max_blocks = max(-(-ctx // block_size) for _, ctx in requests)
    block_tables = torch.zeros(len(requests), max_blocks, dtype=torch.int32)
    rows, used, first_rows = 1, 0, []  # row 0 belongs to no request: the kernel must leave it alone
    for i, (q_len, ctx) in enumerate(requests):
        n = -(-ctx // block_size)
        block_tables[i, :n] = tables[used : used + n].int()
        used += n
        first_rows.append(rows)
        rows += q_len
    # q as the rotary code hands it over: a view into a wider fused tensor, rows not contiguous.
    fused = torch.randn(rows, num_heads + 2 * num_kv_heads, head_dim, generator=gen)
    q = fused[:, :num_heads]
    out = torch.full((rows, num_heads, head_dim), 7.0)
    info = torch.tensor([(r, q_len, ctx) for r, (q_len, ctx) in zip(first_rows, requests, strict=True)])
    paged_attention_op()(out, q, in_kernel_layout(k_cache), v_cache, block_tables, info, head_dim**-0.5, window,
                         softcap, sinks)

    assert (out[0] == 7.0).all()
    for i, (q_len, ctx) in enumerate(requests):
        r = first_rows[i]
        expected = reference(q[r : r + q_len], k_cache, v_cache, block_tables[i].long().tolist(), ctx, window,
                             softcap, sinks)
        torch.testing.assert_close(out[r : r + q_len].double(), expected, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("context", [1, 33, 300])
def test_kernel_splits_a_single_stream_by_kv_head_with_the_same_result(context: int) -> None:
    # One decode is too few work items for every thread, so the kernel gives each kv head its own item.
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache = torch.randn(2, 20, 3, 16, 64, generator=gen)
    blocks = torch.randperm(20, generator=gen)[: -(-context // 16)]
    q = torch.randn(1, 9, 64, generator=gen)
    out = torch.empty_like(q)
    table = blocks.int()[None]
    paged_attention_op()(out, q, in_kernel_layout(k_cache), v_cache, table, torch.tensor([[0, 1, context]]), 64**-0.5)
    expected = reference(q, k_cache, v_cache, blocks.tolist(), context)
    torch.testing.assert_close(out.double(), expected, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(9, 3, 64, 16), (4, 4, 16, 16), (8, 2, 128, 32), (2, 1, 8, 4), (6, 3, 32, 16)],
)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_a_row_is_the_same_bits_however_its_prompt_is_chunked(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, kv_dtype: torch.dtype
) -> None:
    """Prompt rows in bfloat16 need a row's attention to be one function of its query and the cache: the kernel
    computes each row alone whatever shares its work item (a decode, runs of rows that share a kv head, tiles of 16
    or 8 queries, items split by kv head). A 70-token prompt as one chunk, as chunks of 5, 16 and 49 beside other
    requests, and token by token as decodes: the same bits."""
    gen = torch.Generator().manual_seed(11)
    context = 70
    blocks = -(-context // block_size)
    k_cache = torch.randn(blocks + 8, num_kv_heads, block_size, head_dim, generator=gen).to(kv_dtype)
    v_cache = torch.randn(blocks + 8, num_kv_heads, block_size, head_dim, generator=gen).to(kv_dtype)
    keys = in_kernel_layout(k_cache)
    table = torch.randperm(blocks + 8, generator=gen)[:blocks].int()
    q = torch.randn(context, num_heads, head_dim, generator=gen)
    other = torch.randn(3, num_heads, head_dim, generator=gen)  # decodes of another request over the same blocks

    def attend(pieces: list[tuple[int, int]], with_others: bool) -> torch.Tensor:
        """The prompt's rows, computed in pieces of (first query, count): each piece one call, alone or after
        three single-query requests."""
        out = torch.empty_like(q)
        for first, count in pieces:
            rows = torch.cat([other, q[first : first + count]]) if with_others else q[first : first + count]
            info = ([[i, 1, 20 + i] for i in range(3)] if with_others else []) + [[len(rows) - count, count,
                                                                                    first + count]]
            tables = table[None].expand(len(info), -1).contiguous()
            result = torch.empty_like(rows)
            paged_attention_op()(result, rows.contiguous(), keys, v_cache, tables, torch.tensor(info),
                                 head_dim**-0.5)
            out[first : first + count] = result[len(rows) - count :]
        return out

    whole = attend([(0, context)], with_others=False)
    assert torch.equal(attend([(i, 1) for i in range(context)], with_others=False), whole)
    assert torch.equal(attend([(0, 5), (5, 16), (21, 49)], with_others=True), whole)
    assert torch.equal(attend([(0, 33), (33, 37)], with_others=True), whole)
    expected = reference(q, k_cache.float(), v_cache.float(), table.tolist(), context)
    torch.testing.assert_close(whole.double(), expected, atol=2e-6, rtol=1e-5)


def test_kernel_shares_torchs_openmp_runtime() -> None:
    """A second OpenMP runtime would start its own threads and fight torch's for the cores."""
    paged_attention_op()
    with open("/proc/self/maps") as maps:
        runtimes = {line.split()[-1] for line in maps if "libgomp" in line}
    assert len(runtimes) == 1, runtimes


def test_kernel_refuses_what_it_cannot_compute() -> None:
    op = paged_attention_op()
    cache = torch.zeros(4, 1, 16, 64)
    keys = in_kernel_layout(cache)
    other_layout = cache if paged_keys_transposed() else cache.transpose(2, 3).contiguous()
    q, out = torch.zeros(1, 1, 64), torch.zeros(1, 1, 64)
    tables = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="float32 queries"):
        op(out, q.double(), keys, cache, tables, torch.tensor([[0, 1, 5]]), 1.0)
    with pytest.raises(RuntimeError, match="float32, float16 or int8 caches"):
        op(out, q, keys.bfloat16(), cache.bfloat16(), tables, torch.tensor([[0, 1, 5]]), 1.0)
    with pytest.raises(RuntimeError, match="float32, float16 or int8 caches"):  # K and V of different types
        op(out, q, keys, cache.half(), tables, torch.tensor([[0, 1, 5]]), 1.0)
    with pytest.raises(RuntimeError, match="context 40"):  # longer than its two blocks of 16
        op(out, q, keys, cache, tables, torch.tensor([[0, 1, 40]]), 1.0)
    with pytest.raises(RuntimeError, match=r"caches must be K .*\[blocks, kv heads, "):  # K in the other layout
        op(out, q, other_layout, cache, tables, torch.tensor([[0, 1, 5]]), 1.0)
    with pytest.raises(RuntimeError, match="head_dim 24"):
        op(torch.zeros(1, 1, 24), torch.zeros(1, 1, 24), in_kernel_layout(torch.zeros(4, 1, 16, 24)),
           torch.zeros(4, 1, 16, 24), tables, torch.tensor([[0, 1, 5]]), 1.0)
    with pytest.raises(RuntimeError, match=r"sinks must be float32 \[1\]"):  # one logit per query head
        op(out, q, keys, cache, tables, torch.tensor([[0, 1, 5]]), 1.0, 0, 0.0, torch.zeros(2))


def test_the_key_layout_follows_the_build() -> None:
    """Transposed keys where the kernel is built for AVX-512 (with F16C), V's layout everywhere else; the caches the
    runner allocates follow the kernel."""
    if kernels.kernel_march() == "native":
        assert paged_keys_transposed() == ({"avx512f", "f16c"} <= kernels.cpu_flags())
    k_shape, v_shape = kv_cache_shapes("paged-cpu", 5, 3, 16, 64)
    assert v_shape == (5, 3, 16, 64)
    assert k_shape == ((5, 3, 64, 16) if paged_keys_transposed() else v_shape)
    assert kv_cache_shapes("sdpa", 5, 3, 16, 64) == (v_shape, v_shape)


def test_auto_picks_the_kernel_only_where_it_runs() -> None:
    assert check_attention_backend("auto", CPU, torch.float32, 64) == "paged-cpu"
    assert check_attention_backend(None, CPU, torch.float32, 64) == "paged-cpu"
    assert check_attention_backend("auto", CPU, torch.bfloat16, 64) == "sdpa"
    assert check_attention_backend("auto", CPU, torch.float32, 80) == "sdpa"
    assert check_attention_backend("auto", torch.device("cuda"), torch.float32, 64) == "sdpa"
    assert check_attention_backend("sdpa", CPU, torch.float32, 64) == "sdpa"


@pytest.mark.parametrize(
    ("name", "dtype", "head_dim", "message"),
    [("paged-cpu", torch.bfloat16, 64, "float32"), ("paged-cpu", torch.float32, 80, "head size 80"),
     ("flash", torch.float32, 64, "unknown attention backend")],
)
def test_a_backend_that_cannot_run_is_refused(name: str, dtype: torch.dtype, head_dim: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_attention_backend(name, CPU, dtype, head_dim)


def test_auto_falls_back_to_sdpa_when_the_kernel_does_not_build(monkeypatch, caplog) -> None:
    def no_compiler():
        raise RuntimeError("could not build lmserve's CPU kernels: no c++ compiler")

    monkeypatch.setattr(kernels, "cpu_kernels", no_compiler)
    with caplog.at_level(logging.WARNING):
        assert check_attention_backend("auto", CPU, torch.float32, 64) == "sdpa"
    assert "falls back to sdpa" in caplog.text
    with pytest.raises(RuntimeError, match="no c\\+\\+ compiler"):
        check_attention_backend("paged-cpu", CPU, torch.float32, 64)


def test_metadata_of_each_backend() -> None:
    chunks = [
        ScheduledChunk(start_position=20, num_tokens=1, block_ids=[5, 9]),
        ScheduledChunk(start_position=3, num_tokens=1, block_ids=[2]),
        ScheduledChunk(start_position=16, num_tokens=4, block_ids=[7, 1]),
    ]
    paged = build_metadata(chunks, 16, "paged-cpu", CPU, torch.float32)
    assert paged.num_decodes == 2 and paged.decode_mask is None
    assert paged.decode_block_tables.dtype == torch.int32
    # (row, query length, context) of the decodes, then of the short chunk after cached positions.
    assert paged.decode_requests.tolist() == [[0, 1, 21], [1, 1, 4], [2, 4, 20]]
    assert paged.decode_block_tables.tolist() == [[5, 9], [2, 0], [7, 1]]
    assert paged.slot_mapping.tolist() == [9 * 16 + 4, 2 * 16 + 3, 16, 17, 18, 19]
    assert paged.prefills == []

    sdpa = build_metadata(chunks, 16, "sdpa", CPU, torch.float32)
    (row, q_len, start, block_ids, mask), = sdpa.prefills
    assert (row, q_len, start, block_ids.tolist()) == (2, 4, 16, [7, 1])
    assert mask.shape == (4, 20) and mask[0, 16].item() == 0 and mask[0, 17].item() == float("-inf")
    # Under paged-cpu a first chunk and a long one run the kernel too, row by row (never SDPA: its sums follow the
    # chunk's length, so a prompt row's bits would depend on how the prompt was chunked).
    first_and_long = [ScheduledChunk(0, 5, [3]), ScheduledChunk(16, 40, [4, 6, 8, 9])]
    both = build_metadata(first_and_long, 16, "paged-cpu", CPU, torch.float32)
    assert both.prefills == [] and both.num_decodes == 0
    assert both.decode_requests.tolist() == [[0, 5, 5], [5, 40, 56]]
    assert [p[:3] for p in build_metadata(first_and_long, 16, "sdpa", CPU, torch.float32).prefills] == [
        (0, 5, 0), (5, 40, 16)]
    assert sdpa.decode_requests is None and sdpa.decode_block_tables.dtype == torch.int64
    assert sdpa.decode_mask.shape == (2, 1, 1, 32)
    visible = (sdpa.decode_mask == 0).view(2, 32).sum(-1).tolist()
    assert visible == [21, 4]

    with pytest.raises(AssertionError, match="decodes must come before"):
        build_metadata(chunks[2:] + chunks[:1], 16, "paged-cpu", CPU, torch.float32)


@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_both_backends_attend_alike_over_a_mixed_batch(kv_dtype: torch.dtype, with_sinks: bool) -> None:
    """Decodes, a short chunk after cached positions, a long one and a first chunk (all on the paged kernel under
    paged-cpu, SDPA calls under sdpa): the same output from either backend's metadata, with a float32 or a float16
    cache."""
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, bs = 9, 3, 64, 16
    k_cache = torch.randn(40, kv_heads, bs, dim, generator=gen).to(kv_dtype)
    v_cache = torch.randn(40, kv_heads, bs, dim, generator=gen).to(kv_dtype)
    chunks = [
        ScheduledChunk(37, 1, [0, 1, 2]),
        ScheduledChunk(5, 1, [3]),
        ScheduledChunk(40, 12, [4, 5, 6, 7]),  # short, after cached positions, crossing a block edge
        ScheduledChunk(33, 23, [8, 9, 10, 11]),
        ScheduledChunk(0, 9, [12]),
    ]
    rows = sum(c.num_tokens for c in chunks)
    q = torch.randn(rows, heads, dim, generator=gen)
    k, v = torch.randn(rows, kv_heads, dim, generator=gen), torch.randn(rows, kv_heads, dim, generator=gen)
    attention = PagedAttention(heads, kv_heads, dim, dim**-0.5)
    sinks = torch.randn(heads, generator=gen) * 4 if with_sinks else None
    outs, written = {}, {}
    for backend in ("paged-cpu", "sdpa"):
        md = build_metadata(chunks, bs, backend, CPU, torch.float32)
        keys = in_kernel_layout(k_cache) if backend == "paged-cpu" else k_cache.clone()
        assert keys.shape == kv_cache_shapes(backend, 40, kv_heads, bs, dim)[0]
        written[backend] = (keys, v_cache.clone())
        outs[backend] = attention.forward(q, k, v, *written[backend], md, sinks)
    written["paged-cpu"] = (from_kernel_layout(written["paged-cpu"][0]), written["paged-cpu"][1])
    assert len(build_metadata(chunks, bs, "paged-cpu", CPU, torch.float32).decode_requests) == 5
    torch.testing.assert_close(outs["paged-cpu"], outs["sdpa"], atol=1e-5, rtol=1e-5)
    # Each new position's K and V landed in its block's row for every kv head, and nothing else changed.
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    row = 0
    for c in chunks:
        for pos in range(c.start_position, c.start_position + c.num_tokens):
            k_expected[c.block_ids[pos // bs], :, pos % bs] = k[row].to(kv_dtype)
            v_expected[c.block_ids[pos // bs], :, pos % bs] = v[row].to(kv_dtype)
            row += 1
    for k_written, v_written in written.values():
        assert torch.equal(k_written, k_expected) and torch.equal(v_written, v_expected)
    # Against float64 math over what was written, for the decode and the short chunk after cached positions.
    k_full, v_full = (t.float() for t in written["paged-cpu"])
    torch.testing.assert_close(outs["paged-cpu"][:1].double(),
                               reference(q[:1], k_full, v_full, [0, 1, 2], 38, sinks=sinks), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs["sdpa"][2:14].double(),
                               reference(q[2:14], k_full, v_full, [4, 5, 6, 7], 52, sinks=sinks), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens", [1, 300])  # a decode, and enough rows to split over the threads
def test_write_kv_cache_matches_index_copy(kv_dtype: torch.dtype, tokens: int) -> None:
    """The kernel's K/V write stores what PyTorch's conversion and index_copy_ store, bit for bit, from a strided view
    (K and V as the qkv split hands them over)."""
    gen = torch.Generator().manual_seed(7)
    kv_heads, dim, bs = 3, 64, 16
    fused = torch.randn(tokens, 9 + 2 * kv_heads, dim, generator=gen) * 300
    # float16 subnormals, the largest value that rounds to 65504, one that overflows to inf, a tie that rounds to even
    fused[0, 9, :5] = torch.tensor([1e-6, -1e-7, 65519.0, 7e4, 1.0 + 2**-11])
    k, v = fused[:, 9 : 9 + kv_heads], fused[:, 9 + kv_heads :]
    slots = torch.randperm(40 * bs, generator=gen)[:tokens]
    chunks = [ScheduledChunk(int(s) % bs, 1, [int(s) // bs]) for s in slots]
    rows = build_metadata(chunks, bs, "paged-cpu", CPU, torch.float32).cache_rows(kv_heads)
    k_shape, v_shape = kv_cache_shapes("paged-cpu", 40, kv_heads, bs, dim)
    k_op, v_op = torch.zeros(k_shape, dtype=kv_dtype), torch.zeros(v_shape, dtype=kv_dtype)
    k_ref, v_ref = v_op.clone(), v_op.clone()
    kernels.write_kv_cache_op()(k_op, v_op, k, v, rows)
    k_ref.view(-1, dim).index_copy_(0, rows, k.reshape(-1, dim).to(kv_dtype))
    v_ref.view(-1, dim).index_copy_(0, rows, v.reshape(-1, dim).to(kv_dtype))
    assert torch.equal(from_kernel_layout(k_op), k_ref) and torch.equal(v_op, v_ref)
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernels.write_kv_cache_op()(k_op, v_op, k, v, rows + 40 * kv_heads * bs)
    with pytest.raises(RuntimeError, match="float32 K and V"):
        kernels.write_kv_cache_op()(k_op, v_op, k.double(), v.double(), rows)


def test_kernel_widens_a_float16_cache_to_the_same_result() -> None:
    """A float16 cache gives what the float32 kernel gives on the same (float16-rounded) values, bit for bit."""
    gen = torch.Generator().manual_seed(6)
    k_half = torch.randn(32, 3, 16, 64, generator=gen).half()
    v_half = torch.randn(32, 3, 16, 64, generator=gen).half()
    requests = torch.tensor([[0, 1, 37], [1, 1, 5], [2, 12, 60]])  # two decodes and a chunk after cached positions
    tables = torch.tensor([[3, 7, 1, 0], [9, 0, 0, 0], [4, 5, 6, 8]], dtype=torch.int32)
    q = torch.randn(14, 9, 64, generator=gen)
    out_half, out_float = torch.empty_like(q), torch.empty_like(q)
    paged_attention_op()(out_half, q, in_kernel_layout(k_half), v_half, tables, requests, 0.125)
    paged_attention_op()(out_float, q, in_kernel_layout(k_half.float()), v_half.float(), tables, requests, 0.125)
    assert torch.equal(out_half, out_float)  # float16 widens to float32 exactly
    expected = reference(q[2:], k_half.float(), v_half.float(), [4, 5, 6, 8], 60).float()
    torch.testing.assert_close(out_half[2:], expected, atol=1e-5, rtol=1e-5)


def test_kv_cache_dtype_choice(monkeypatch) -> None:
    monkeypatch.setattr(attention, "cpu_flags", lambda: frozenset({"avx2", "f16c"}))
    assert check_kv_cache_dtype("auto", torch.float32, "paged-cpu") == torch.float16  # as llama.cpp's f16 cache
    assert check_kv_cache_dtype("float32", torch.float32, "paged-cpu") == torch.float32
    assert check_kv_cache_dtype("auto", torch.float32, "sdpa") == torch.float32  # the model's, as in vLLM
    assert check_kv_cache_dtype("auto", torch.bfloat16, "sdpa") == torch.bfloat16
    assert check_kv_cache_dtype("float16", torch.float32, "sdpa") == torch.float16
    with pytest.raises(ValueError, match="unknown KV cache dtype 'int4'"):
        check_kv_cache_dtype("int4", torch.float32, "sdpa")
    monkeypatch.setattr(attention, "cpu_flags", lambda: frozenset({"avx2"}))
    assert check_kv_cache_dtype("auto", torch.float32, "paged-cpu") == torch.float32  # no F16C: the model's dtype
    with pytest.raises(ValueError, match="needs a CPU with F16C"):
        check_kv_cache_dtype("float16", torch.float32, "paged-cpu")
    assert check_kv_cache_dtype("float16", torch.float32, "sdpa") == torch.float16  # SDPA widens in PyTorch
