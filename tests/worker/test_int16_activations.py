"""The q4_1 kernel with 16-bit integer activations (kernels/int16_activations.cpp, `--block-activations int16`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from lmserve.worker.kernels import cpu_kernels
from lmserve.worker.prompt_rows import PromptRows, prompt_rows
from lmserve.worker.weights import kernel_choice
from lmserve.worker.weights.batched_copies import AmxBfloat16Linear
from lmserve.worker.weights.block_linear import Q4_1Linear, Q8_0Linear, use_block_activations
from lmserve.worker.weights.block_packing import pack_blocks, quantize_blocks, unpack_blocks
from lmserve.worker.weights.kernel_choice import BatchedPath, block_activations

needs_vnni = pytest.mark.skipif(not kernel_choice.int16_kernel_loads(), reason="the int16 kernels did not build (no AVX2)")


def block_weight(method: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    """Float weights already on the format's grid, so its blocks hold them exactly: float16 d (and m), q in 0..15
    (q4_1, each block spanning 0..15) or -127..127 (q8_0, each block reaching 127), as a quantizer's output does."""
    gen = torch.Generator().manual_seed(seed)
    shape = (rows, cols // 32, 1)
    d = (torch.rand(shape, generator=gen) * 0.01 + 1e-3).half().float()
    if method == "q8_0":
        q = torch.randint(-127, 128, (rows, cols // 32, 32), generator=gen)
        q[..., 0] = 127
        return (q * d).reshape(rows, cols)
    m = (-torch.rand(shape, generator=gen) * 0.1).half().float()
    q = torch.randint(0, 16, (rows, cols // 32, 32), generator=gen)
    q[..., 0], q[..., 1] = 0, 15
    return (q * d + m).reshape(rows, cols)


def q4_1_weight(rows: int, cols: int, seed: int) -> torch.Tensor:
    return block_weight("q4_1", rows, cols, seed)


def split(x: torch.Tensor) -> torch.Tensor:
    """The activations the kernel multiplies, in float64: per row and block of 32, s = max|x| / 127,
    high = round(x / s), low = round((x - s high) 256 / s) clamped to int8 (-127..127 on the AVX2 build), x = s (high
    + low / 256); each step rounded to float32 as the kernel rounds it (x - s high is one FMA)."""
    blocks = x.float().reshape(*x.shape[:-1], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    s = amax / 127
    inverse = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    high = torch.round(blocks * inverse)
    rest = (blocks.double() - high.double() * s.double()).float()
    lowest = -128 if cpu_kernels().int16_uses_vnni() else -127
    low = torch.round(rest * (inverse * 256)).clamp(lowest, 127)
    return ((s.double() / 256) * (256 * high.double() + low.double())).reshape(x.shape)


LAYERS = {"q4_1": Q4_1Linear, "q8_0": Q8_0Linear}


def kernel_layer(weight: torch.Tensor, bias: torch.Tensor | None, method: str = "q4_1") -> Q4_1Linear | Q8_0Linear:
    """A layer that runs the int16 kernel at every batch size (no float16 copy for large batches)."""
    layer = LAYERS[method](weight, bias, BatchedPath("fp16", 1 << 30))
    assert layer.use_integer_activations()
    return layer


@needs_vnni
@pytest.mark.parametrize("method", ["q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 17, 64])
@pytest.mark.parametrize(("out_features", "in_features"), [(16, 32), (48, 576), (160, 1536)])
def test_kernel_multiplies_the_split_activations_exactly_in_float32(
    method: str, rows: int, out_features: int, in_features: int
) -> None:
    gen = torch.Generator().manual_seed(rows + out_features)
    weight = block_weight(method, out_features, in_features, seed=rows)
    bias = torch.randn(out_features, generator=gen)
    layer = kernel_layer(weight, bias, method)
    x = torch.randn(rows, in_features, generator=gen) * torch.logspace(-2, 2, in_features)[torch.randperm(in_features)]
    got = layer(x).double()
    assert torch.equal(layer.dequantized(), weight)
    # Against the same split in float64, with the minimums m of w = d q + m taking the float inputs' block sums as the
    # kernel does: float32 rounding of the sums apart, and now and then a low half that the kernel's float32
    # reciprocal rounded the other way (one step of s / 256 on one input).
    split_x = split(x)
    expected = split_x @ weight.double().T + bias
    if method == "q4_1":
        minimums = weight.double().reshape(out_features, -1, 32).amin(-1)  # each block spans q = 0..15
        expected += (x.double() - split_x).reshape(rows, -1, 32).sum(-1) @ minimums.T
    magnitude = x.double().abs() @ weight.double().abs().T
    assert ((got - expected).abs() <= 5e-6 * magnitude + 1e-5).all()
    # Against the float activations: within the split's error, s / 512 per input, times the weights.
    bound = (x.abs().reshape(rows, -1, 32).amax(-1) / 127 / 512).repeat_interleave(32, -1).double() @ weight.double().abs().T
    assert ((got - (x.double() @ weight.double().T + bias)).abs() <= bound + 1e-5).all()


@needs_vnni
@pytest.mark.parametrize("method", ["q4_1", "q8_0"])
def test_a_row_gets_the_same_bits_whatever_rows_share_its_call(method: str) -> None:
    gen = torch.Generator().manual_seed(5)
    layer = kernel_layer(block_weight(method, 960, 576, seed=5), torch.randn(960, generator=gen), method)
    x = torch.randn(100, 576, generator=gen) * 3
    whole = layer(x)
    for start, count in [(0, 1), (1, 2), (3, 3), (7, 5), (12, 40), (99, 1)]:
        assert torch.equal(layer(x[start : start + count]), whole[start : start + count])
    shuffled = torch.randperm(100, generator=gen)
    assert torch.equal(layer(x[shuffled]), whole[shuffled])


@needs_vnni
@pytest.mark.parametrize("method", ["q4_1", "q8_0"])
def test_non_finite_inputs_give_nan_only_in_their_row_and_zero_inputs_give_the_bias(method: str) -> None:
    layer = kernel_layer(block_weight(method, 32, 64, seed=6), torch.arange(32.0), method)
    x = torch.randn(4, 64)
    x[1, 3], x[2, 40] = float("nan"), float("inf")
    x[3] = 0.0
    y = layer(x)
    assert y[0].isfinite().all() and y[1].isnan().all() and y[2].isnan().all()
    assert torch.equal(y[3], torch.arange(32.0))


@needs_vnni
@pytest.mark.parametrize("method", ["q4_1", "q8_0"])
def test_the_repacked_blocks_hold_the_same_weights(method: str) -> None:
    weight = torch.randn(48, 96)
    float32 = LAYERS[method](weight, None)
    int16 = LAYERS[method](weight, None)
    assert int16.use_integer_activations() and int16.blocks.numel() == float32.blocks.numel()
    assert torch.equal(int16.dequantized(), float32.dequantized())  # the prompt copy is built from these
    assert "int16 activations" in repr(int16)


@pytest.mark.parametrize("rows", [1, 7, 8, 9, 33])
def test_unpack_blocks_undoes_pack_blocks(rows: int) -> None:
    for method in ("q4_1", "q8_0"):
        blocks = quantize_blocks(method, torch.randn(rows, 96))
        assert torch.equal(unpack_blocks(method, pack_blocks(method, blocks), rows), blocks)


@needs_vnni
def test_kernel_refuses_what_it_cannot_tile() -> None:
    ops = cpu_kernels()
    packed = ops.q4_1_int16_pack([quantize_blocks("q4_1", torch.randn(32, 64))])
    with pytest.raises(RuntimeError, match="multiple of 16"):
        ops.q4_1_int16_linear(torch.zeros(1, 64), packed, 24, None)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.q4_1_int16_linear(torch.zeros(1, 48), packed, 32, None)
    with pytest.raises(RuntimeError, match="expected"):
        ops.q4_1_int16_linear(torch.zeros(1, 96), packed, 32, None)
    with pytest.raises(RuntimeError, match="float32"):
        ops.q4_1_int16_linear(torch.zeros(1, 64).double(), packed, 32, None)
    with pytest.raises(RuntimeError, match="bias"):
        ops.q4_1_int16_linear(torch.zeros(1, 64), packed, 32, torch.zeros(31))
    assert ops.q4_1_int16_linear(torch.zeros(0, 64), packed, 32, None).shape == (0, 32)
    # A layer the kernel cannot tile keeps the float32 kernel.
    assert not Q4_1Linear(torch.randn(40, 64), None).use_integer_activations()
    assert not Q8_0Linear(torch.randn(24, 64), None).use_integer_activations()


@needs_vnni
def test_use_block_activations_moves_every_layer_it_can_tile() -> None:
    model = nn.Sequential(Q4_1Linear(torch.randn(32, 64), None), Q8_0Linear(torch.randn(32, 64), None),
                          Q4_1Linear(torch.randn(40, 64), None))
    assert use_block_activations(model, "float32") == 0 and model[0].activations == "float32"
    assert use_block_activations(model, "int16") == 2
    assert [m.activations for m in model] == ["int16", "int16", "float32"]


def test_auto_picks_integer_activations_where_the_kernel_runs_and_int8_for_large_models(monkeypatch) -> None:
    assert block_activations("float32") == "float32"
    monkeypatch.setattr(kernel_choice, "int16_kernel_loads", lambda: False)
    assert block_activations("auto") == "float32"
    with pytest.raises(ValueError, match="AVX-512 VNNI"):
        block_activations("int16")
    with pytest.raises(ValueError, match="unknown block activations"):
        block_activations("int4")
    monkeypatch.setattr(kernel_choice, "int16_kernel_loads", lambda: True)
    assert block_activations("int16") == "int16"
    # auto: integer activations wherever the kernels run, the AVX2 build too (its float32 kernel is faster for q4_1
    # and q8_0 above a few rows, but sums a row in an order set by its batch's size): exact int16 for small models,
    # int8 from INT8_ACTIVATIONS_FROM_WEIGHTS decoder weights, where a batch's integer products bound the step.
    assert block_activations("auto") == "int16"
    threshold = kernel_choice.INT8_ACTIVATIONS_FROM_WEIGHTS
    assert block_activations("auto", threshold - 1) == "int16"
    assert block_activations("auto", threshold) == "int8"
    # What is asked for is kept whatever the size.
    assert block_activations("int16", 10 * threshold) == "int16" and block_activations("int8", 0) == "int8"
    monkeypatch.setattr(kernel_choice, "int16_kernel_loads", lambda: False)
    assert block_activations("auto", threshold) == "float32"


@needs_vnni
@pytest.mark.skipif(not kernel_choice.amx_kernel_loads(), reason="needs a CPU with AMX")
def test_prompt_rows_keep_the_amx_copy_and_generated_rows_take_the_int16_kernel() -> None:
    gen = torch.Generator().manual_seed(9)
    weight, bias = q4_1_weight(64, 96, seed=9), torch.randn(64, generator=gen)
    layer = Q4_1Linear(weight, bias, BatchedPath("fp16", kernel_choice.BLOCK_KERNEL_MAX_ROWS, prompt_copies=True))
    layer.prompt_copies = True
    assert layer.use_integer_activations()
    x = torch.randn(50, 96, generator=gen)
    mask = np.arange(50) % 4 == 0
    with prompt_rows(PromptRows.from_mask(mask)):
        got = layer(x)
    torch.testing.assert_close(got[mask], AmxBfloat16Linear(weight, bias)(x)[mask], atol=0, rtol=0)
    torch.testing.assert_close(got[~mask], cpu_kernels().q4_1_int16_linear(x[~mask], layer.blocks, 64, bias),
                               atol=0, rtol=0)


@pytest.mark.parametrize("setting", ["float32", "auto"])
def test_the_runner_gives_the_block_layers_the_activations_asked_for(setting: str) -> None:
    from lmserve.config import CacheConfig, ModelConfig
    from lmserve.worker.model_runner import ModelRunner

    runner = ModelRunner(ModelConfig(block_activations=setting), CacheConfig(num_blocks=16))
    layers = [m for m in runner.model.modules() if isinstance(m, (Q4_1Linear, Q8_0Linear))]
    assert len(layers) == 30 * 4 + 1  # and the q8_0 output layer
    expected = block_activations(setting)
    assert runner.block_activations == expected
    assert {m.activations for m in layers} == {expected}


@pytest.mark.skipif(not kernel_choice.int16_kernel_loads(), reason="needs the integer-activation kernels")
def test_the_runner_takes_int8_activations_under_auto_for_a_model_past_the_line(monkeypatch) -> None:
    from lmserve.config import CacheConfig, ModelConfig
    from lmserve.worker.model_runner import ModelRunner

    # The default model (106 M decoder weights) with the line moved below it: the runner passes the model's count.
    monkeypatch.setattr(kernel_choice, "INT8_ACTIVATIONS_FROM_WEIGHTS", 100_000_000)
    runner = ModelRunner(ModelConfig(), CacheConfig(num_blocks=16))
    layers = [m for m in runner.model.modules() if isinstance(m, (Q4_1Linear, Q8_0Linear))]
    assert runner.block_activations == "int8" and {m.activations for m in layers} == {"int8"}
    # On the AVX2 kind too, and there without the float16 prompt copies int16 activations would take.
    monkeypatch.setattr(kernel_choice, "int16_vnni_kernel_runs", lambda: False)
    monkeypatch.setattr(kernel_choice, "amx_kernel_loads", lambda: False)
    runner = ModelRunner(ModelConfig(), CacheConfig(num_blocks=16))
    assert runner.block_activations == "int8" and runner.batched_path == kernel_choice.batched_path("none")
    assert not runner.prompt_copies
    monkeypatch.setattr(kernel_choice, "INT8_ACTIVATIONS_FROM_WEIGHTS", 110_000_000)
    runner = ModelRunner(ModelConfig(), CacheConfig(num_blocks=16))
    assert runner.block_activations == "int16"
