"""The fused CPU ops (kernels/fused_ops.cpp) compute what the PyTorch ops they replace compute, and are chosen only
where they run."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from lmserve.worker import kernels
from lmserve.worker.kernels import check_fused_ops, cpu_kernels
from lmserve.worker.models.rotary import apply_rotary

CPU = torch.device("cpu")


# 1 row and 3 rows stay on the calling thread; 300 rows are split over the threads.
@pytest.mark.parametrize("rows", [1, 3, 300])
def test_fused_add_rms_norm(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    x, residual = torch.randn(2, rows, 576, generator=gen)
    weight = torch.rand(576, generator=gen) + 0.5
    expected_residual = x + residual
    expected = F.rms_norm(expected_residual, (576,), weight, 1e-5)
    cpu_kernels().fused_add_rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(residual, expected_residual, atol=0, rtol=0)
    torch.testing.assert_close(x, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 300])
def test_rms_norm_of_rows_and_of_each_head_in_place(rows: int) -> None:
    """Gemma's norms after attention and the MLP (rows of [T, D], out of place) and its q/k norms (each head of a
    strided [T, H, D] view of the qkv output, in place): F.rms_norm's values, nothing else touched."""
    gen = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, 640, generator=gen) * 3, torch.rand(640, generator=gen) + 0.5
    out = torch.full_like(x, float("nan"))
    before = x.clone()
    cpu_kernels().rms_norm(out, x, weight, 1e-6)
    torch.testing.assert_close(out, F.rms_norm(x, (640,), weight, 1e-6), atol=1e-5, rtol=1e-5)
    assert torch.equal(x, before)

    qkv = torch.randn(rows, 4 + 2, 256, generator=gen)  # 4 query heads, then k and v (one head each)
    head_weight = torch.rand(256, generator=gen) + 0.5
    expected = qkv.clone()
    expected[:, :4] = F.rms_norm(qkv[:, :4], (256,), head_weight, 1e-6)
    q = qkv[:, :4]
    cpu_kernels().rms_norm(q, q, head_weight, 1e-6)
    torch.testing.assert_close(qkv, expected, atol=1e-5, rtol=1e-5)  # k and v untouched, bit for bit
    assert torch.equal(qkv[:, 4:], expected[:, 4:])


def test_rms_norm_gives_a_row_the_same_bits_wherever_it_starts() -> None:
    """The rows may come from NumPy (16-byte aligned): the same row at any float offset gives the same bits."""
    gen = torch.Generator().manual_seed(3)
    row, weight = torch.randn(576, generator=gen) * 5, torch.rand(576, generator=gen) + 0.5
    results = []
    for offset in range(16):
        buffer = torch.zeros(576 + 16)
        x = buffer[offset : offset + 576].view(1, 576)
        x.copy_(row)
        out = torch.empty(1, 576)
        cpu_kernels().rms_norm(out, x, weight, 1e-5)
        results.append(out)
    assert all(torch.equal(r, results[0]) for r in results)


@pytest.mark.parametrize("rows", [1, 300])
def test_silu_and_mul(rows: int) -> None:
    gate_up = torch.randn(rows, 2 * 1536, generator=torch.Generator().manual_seed(rows)) * 4
    out = torch.full((rows, 1536), float("nan"))
    cpu_kernels().silu_and_mul(out, gate_up)
    gate, up = gate_up.split(1536, dim=-1)
    torch.testing.assert_close(out, F.silu(gate) * up, atol=1e-5, rtol=1e-5)


def test_silu_of_a_very_negative_gate_is_zero_not_nan() -> None:
    """e^-g overflows float past g = -88.7; the product must still be silu's 0 (an outlier in one layer's gate would
    otherwise turn the whole forward pass into NaN)."""
    gate = torch.tensor([[-1e4, -200.0, -100.0, -89.7, -88.0, -50.0, 0.0, 50.0, 100.0, 1e4] * 16])
    up = torch.full_like(gate, 3.0)
    out = torch.full((1, gate.shape[1]), float("nan"))
    cpu_kernels().silu_and_mul(out, torch.cat([gate, up], dim=1))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, F.silu(gate) * up, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 200])
def test_rotary_embedding_rotates_q_and_k_in_place_and_leaves_v(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    heads, kv_heads, dim = 9, 3, 64
    qkv = torch.randn(rows, heads + 2 * kv_heads, dim, generator=gen)  # as the qkv projection lays it out
    angles = torch.rand(rows, 1, dim // 2, generator=gen) * 6.28
    cos, sin = angles.cos(), angles.sin()
    expected_qk = apply_rotary(qkv[:, : heads + kv_heads], cos, sin)
    v_before = qkv[:, heads + kv_heads :].clone()
    cpu_kernels().rotary_embedding(qkv, cos, sin, heads + kv_heads)
    torch.testing.assert_close(qkv[:, : heads + kv_heads], expected_qk, atol=1e-6, rtol=1e-6)
    assert torch.equal(qkv[:, heads + kv_heads :], v_before)


def heavy_tailed(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """Values spread over several orders of magnitude, as hidden states with outliers are."""
    return torch.randn(*shape, generator=gen) * torch.rand(*shape, generator=gen).pow(8) * 30


def test_a_row_gives_the_same_bits_alone_and_in_a_batch_split_over_the_threads() -> None:
    """160 rows are split over the threads, one row runs on the calling thread: the same bits for the row either way.
    (With the row code inlined into both of at::parallel_for's paths, GCC compiled the sum of squares two ways and
    some 20 of these 160 norms moved by an ulp between the two: a seeded token drew differently in a batch.)"""
    gen = torch.Generator().manual_seed(0)
    ops = cpu_kernels()
    x, residual, weight = heavy_tailed(gen, 160, 576), torch.randn(160, 576, generator=gen) * 0.02, torch.randn(576)
    gate_up = heavy_tailed(gen, 160, 2 * 1536)
    qkv = heavy_tailed(gen, 160, 15, 64)
    angles = torch.rand(160, 1, 32, generator=gen) * 6.28
    cos, sin = angles.cos().contiguous(), angles.sin().contiguous()

    def norm(rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        xs, rs = x[rows].clone(), residual[rows].clone()
        ops.fused_add_rms_norm(xs, rs, weight, 1e-5)
        return xs, rs

    def plain_norm(rows: slice) -> torch.Tensor:
        out = torch.empty_like(x[rows])
        ops.rms_norm(out, x[rows], weight, 1e-5)
        return out

    def silu(rows: slice) -> torch.Tensor:
        out = torch.empty(gate_up[rows].shape[0], 1536)
        ops.silu_and_mul(out, gate_up[rows])
        return out

    def rope(rows: slice) -> torch.Tensor:
        out = qkv[rows].clone()
        ops.rotary_embedding(out, cos[rows], sin[rows], 12)
        return out

    for op in (norm, plain_norm, silu, rope):
        batch = op(slice(0, 160))
        for row in range(160):
            alone = op(slice(row, row + 1))
            if isinstance(batch, tuple):
                assert all(torch.equal(a, b[row : row + 1]) for a, b in zip(alone, batch, strict=True)), (op, row)
            else:
                assert torch.equal(alone, batch[row : row + 1]), (op, row)


def test_ops_refuse_other_dtypes_and_shapes() -> None:
    ops = cpu_kernels()
    with pytest.raises(RuntimeError, match="float32 only"):
        ops.fused_add_rms_norm(torch.zeros(2, 8).double(), torch.zeros(2, 8).double(), torch.ones(8).double(), 1e-5)
    with pytest.raises(RuntimeError, match="rms_norm: x and out of one shape"):
        ops.rms_norm(torch.zeros(2, 8), torch.zeros(2, 4), torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="rms_norm: weight"):
        ops.rms_norm(torch.zeros(2, 8), torch.zeros(2, 8), torch.ones(4), 1e-5)
    with pytest.raises(RuntimeError, match="2 \\* out width"):
        ops.silu_and_mul(torch.zeros(2, 5), torch.zeros(2, 8))
    with pytest.raises(RuntimeError, match="cos and sin"):
        ops.rotary_embedding(torch.zeros(2, 3, 8), torch.zeros(2, 3), torch.zeros(2, 4), 3)


def test_auto_uses_them_only_where_they_run(monkeypatch, caplog) -> None:
    assert check_fused_ops("auto", CPU, torch.float32) == "cpu"
    assert check_fused_ops("auto", CPU, torch.bfloat16) == "none"
    assert check_fused_ops("auto", torch.device("cuda"), torch.float32) == "none"
    assert check_fused_ops("none", CPU, torch.float32) == "none"
    with pytest.raises(ValueError, match="float32"):
        check_fused_ops("cpu", CPU, torch.bfloat16)
    with pytest.raises(ValueError, match="unknown fused ops"):
        check_fused_ops("triton", CPU, torch.float32)

    def no_compiler():
        raise RuntimeError("could not build lmserve's CPU kernels: no c++ compiler")

    monkeypatch.setattr(kernels, "cpu_kernels", no_compiler)
    with caplog.at_level(logging.WARNING):
        assert check_fused_ops("auto", CPU, torch.float32) == "none"
    assert "PyTorch's ops instead" in caplog.text
    with pytest.raises(RuntimeError, match="no c\\+\\+ compiler"):
        check_fused_ops("cpu", CPU, torch.float32)
