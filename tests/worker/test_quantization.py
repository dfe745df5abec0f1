"""`--quantization`: which method runs where, and the fp16-weight layer on both of its paths."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lmserve.worker.quantization import (
    FP16_KERNEL_MAX_ROWS,
    Float16WeightLinear,
    check_quantization,
    quantize_linears,
)

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_auto_picks_fp16_only_where_it_runs() -> None:
    assert check_quantization("auto", CPU, torch.float32) == "fp16"
    assert check_quantization(None, CPU, torch.float32) == "fp16"
    assert check_quantization("auto", CPU, torch.bfloat16) == "none"
    assert check_quantization("auto", CUDA, torch.float32) == "none"
    assert check_quantization("none", CPU, torch.float32) == "none"
    assert check_quantization("fp16", CPU, torch.float32) == "fp16"


@pytest.mark.parametrize(("method", "device", "dtype", "message"), [
    ("fp16", CPU, torch.bfloat16, "float32 activations only"),
    ("fp16", CUDA, torch.float32, "runs on CPU"),
    ("int4", CPU, torch.float32, "unknown quantization 'int4'"),
])
def test_a_method_that_cannot_run_is_refused(method: str, device: torch.device, dtype: torch.dtype, message: str):
    with pytest.raises(ValueError, match=message):
        check_quantization(method, device, dtype)


@pytest.mark.parametrize("rows", [1, 7, FP16_KERNEL_MAX_ROWS, FP16_KERNEL_MAX_ROWS + 1, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp16_layer_computes_the_rounded_weights_in_float32(rows: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=gen) * 0.1
    bias = torch.randn(96, generator=gen) if with_bias else None
    x = torch.randn(rows, 64, generator=gen)
    layer = Float16WeightLinear(weight, bias)
    assert layer.weight.dtype == torch.float16
    got = layer(x)
    rounded = nn.functional.linear(x.double(), weight.half().double(), None if bias is None else bias.double())
    exact = nn.functional.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert got.dtype == torch.float32 and got.shape == (rows, 96)
    error = (got.double() - rounded).abs().max().item()
    assert error < 1e-5
    # The test can tell the rounded weights from the originals: rounding moves outputs by far more than the bound.
    assert (exact - rounded).abs().max().item() > 10 * max(error, 1e-6)


def test_quantize_linears_replaces_every_linear_and_nothing_else() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 4, bias=False), nn.LayerNorm(4)))
    x = torch.randn(3, 8)
    before = model(x)
    assert quantize_linears(model, "fp16") == 2
    assert isinstance(model[0], Float16WeightLinear) and isinstance(model[2][0], Float16WeightLinear)
    assert isinstance(model[1], nn.ReLU) and isinstance(model[2][1], nn.LayerNorm)
    assert torch.allclose(model(x), before, atol=1e-2)
