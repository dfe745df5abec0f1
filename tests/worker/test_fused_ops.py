"""The fused CPU ops (kernels/fused_ops.cpp) compute what the PyTorch ops they replace compute, and are chosen only
where they run."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from lmserve.worker import kernels
from lmserve.worker.kernels import check_fused_ops, cpu_kernels
from lmserve.worker.models.llama import apply_rotary

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
def test_silu_and_mul(rows: int) -> None:
    gate_up = torch.randn(rows, 2 * 1536, generator=torch.Generator().manual_seed(rows)) * 4
    out = torch.full((rows, 1536), float("nan"))
    cpu_kernels().silu_and_mul(out, gate_up)
    gate, up = gate_up.split(1536, dim=-1)
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


def test_ops_refuse_other_dtypes_and_shapes() -> None:
    ops = cpu_kernels()
    with pytest.raises(RuntimeError, match="float32 only"):
        ops.fused_add_rms_norm(torch.zeros(2, 8).double(), torch.zeros(2, 8).double(), torch.ones(8).double(), 1e-5)
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
