"""`--quantization`: which method runs where, the fp16-weight layer on both of its paths, and the block formats
(q4_1, q8_0): packing, the C++ kernel against float64 products of the same weights, and the layer's two paths."""

from __future__ import annotations

import logging
import sys
import threading

import numpy as np
import pytest
import torch
from torch import nn

from lmserve.models import DEFAULT_MODEL, resolve_model, stored_linear_format
from lmserve.worker import kernels
from lmserve.worker.kernels import cpu_kernels
from lmserve.worker.prompt_rows import PromptRows, prompt_rows
from lmserve.worker.weights import batched_copies, kernel_choice
from lmserve.worker.weights.batched_copies import AmxBfloat16Linear, Bfloat16WeightLinear, Float16WeightLinear
from lmserve.worker.weights.block_linear import (
    Q4_1Linear,
    Q8_0Linear,
    prepare_batched_copies,
    use_batched_path,
    use_prompt_copies,
)
from lmserve.worker.weights.block_packing import pack_q4_1, pack_q8_0
from lmserve.worker.weights.kernel_choice import (
    AMX_BLOCK_KERNEL_MAX_ROWS,
    BLOCK_KERNEL_MAX_ROWS,
    BatchedPath,
    batched_path,
    check_quantization,
)
from lmserve.worker.weights.loader import load_weights
from lmserve.worker.weights.pending import quantize_linears

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_auto_picks_fp16_only_where_it_runs() -> None:
    assert check_quantization("auto", CPU, torch.float32) == "fp16"
    assert check_quantization(None, CPU, torch.float32) == "fp16"
    assert check_quantization("auto", CPU, torch.bfloat16) == "none"
    assert check_quantization("auto", CUDA, torch.float32) == "none"
    assert check_quantization("none", CPU, torch.float32) == "none"
    assert check_quantization("fp16", CPU, torch.float32) == "fp16"


def test_auto_gives_k_quant_files_their_kernel_where_it_runs_else_fp16(tiny_kquant_gguf) -> None:
    """A Q4_K_M-like file (Q4_K and Q6_K layers, and Q2_K, Q3_K, Q5_K ones): its layers run at their stored size
    where the int16 kernels run (AVX-512 VNNI or AVX2); elsewhere float16."""
    from lmserve.worker.weights.kquants import kernel_formats
    from lmserve.worker.weights.loader import stored_matrix_types
    from lmserve.worker.weights.stored_formats import BLOCK_FORMATS, preferred_kernel_format

    assert stored_linear_format(resolve_model(str(tiny_kquant_gguf))) is None  # mixed types
    types = stored_matrix_types(resolve_model(str(tiny_kquant_gguf))).values()
    formats = kernel_formats()
    assert ("q4_k" in formats) == kernel_choice.int16_kernel_loads()
    stored_as = preferred_kernel_format(types, formats)
    assert stored_as == ("q4_k" if kernel_choice.int16_kernel_loads() else None)
    assert check_quantization("auto", CPU, torch.float32, stored_as) == (stored_as or "fp16")
    assert preferred_kernel_format(types, BLOCK_FORMATS) is None
    assert check_quantization("auto", CPU, torch.float32, None) == "fp16"


@pytest.mark.parametrize(("method", "device", "dtype", "message"), [
    ("fp16", CPU, torch.bfloat16, "float32 activations only"),
    ("fp16", CUDA, torch.float32, "runs on CPU"),
    ("int4", CPU, torch.float32, "unknown quantization 'int4'"),
    ("q4_1", CPU, torch.bfloat16, "float32 activations only"),
    ("q8_0", CUDA, torch.float32, "runs on CPU"),
])
def test_a_method_that_cannot_run_is_refused(method: str, device: torch.device, dtype: torch.dtype, message: str):
    with pytest.raises(ValueError, match=message):
        check_quantization(method, device, dtype)


@pytest.mark.parametrize("rows", [1, 7, 128, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp16_layer_computes_the_rounded_weights_in_float32(rows: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=gen) * 0.1
    bias = torch.randn(96, generator=gen) if with_bias else None
    x = torch.randn(rows, 64, generator=gen)
    layer = Float16WeightLinear(weight, bias)
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


# ------------------------------------------------------------------------------------------------ block formats

BLOCK_LAYERS = {"q4_1": Q4_1Linear, "q8_0": Q8_0Linear}


def test_auto_keeps_the_files_block_format() -> None:
    assert check_quantization("auto", CPU, torch.float32, "q4_1") == "q4_1"
    assert check_quantization("auto", CPU, torch.float32, "q8_0") == "q8_0"
    assert check_quantization("auto", CPU, torch.float32, "iq3_s") == "fp16"  # a format without a kernel here
    assert check_quantization("auto", CPU, torch.float32, "q5_k") == "q5_k"  # chosen where its kernel runs
    assert check_quantization("auto", CPU, torch.float32, "q3_k") == "q3_k"
    assert check_quantization("auto", CPU, torch.float32, None) == "fp16"
    assert check_quantization("auto", CUDA, torch.float32, "q4_1") == "none"
    assert check_quantization("q8_0", CPU, torch.float32, "q4_1") == "q8_0"


def test_auto_falls_back_to_fp16_without_the_kernels(monkeypatch, caplog) -> None:
    def no_compiler():
        raise RuntimeError("could not build lmserve's CPU kernels: no c++ compiler")

    monkeypatch.setattr(kernels, "cpu_kernels", no_compiler)
    with caplog.at_level(logging.WARNING):
        assert check_quantization("auto", CPU, torch.float32, "q4_1") == "fp16"
    assert "keep float16 weights" in caplog.text
    with pytest.raises(RuntimeError, match="no c\\+\\+ compiler"):
        check_quantization("q4_1", CPU, torch.float32)


def test_the_default_model_stores_its_linear_layers_in_q4_1(tiny_llama_dir) -> None:
    assert stored_linear_format(resolve_model(DEFAULT_MODEL)) == "q4_1"
    assert stored_linear_format(resolve_model(str(tiny_llama_dir))) is None  # safetensors: no block format


def random_blocks(method: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    """Weights that are exactly representable in `method`'s blocks: float16 scales (and minimums), integer q."""
    gen = torch.Generator().manual_seed(seed)
    shape = (rows, cols // 32, 1)
    scale = (torch.rand(shape, generator=gen) * 0.01 + 1e-3).half().float()
    if method == "q4_1":
        minimum = (-torch.rand(shape, generator=gen) * 0.1).half().float()
        q = torch.randint(0, 16, (rows, cols // 32, 32), generator=gen)
        q[..., 0], q[..., 1] = 0, 15  # each block spans its full range, as a quantizer's output does
        return (scale * q + minimum).reshape(rows, cols)
    q = torch.randint(-127, 128, (rows, cols // 32, 32), generator=gen)
    q[..., 0] = 127
    return (scale * q).reshape(rows, cols)


@pytest.mark.parametrize("method", ["q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [48, 45])
def test_weights_that_came_from_blocks_pack_back_to_the_same_blocks(method: str, rows: int) -> None:
    weight = random_blocks(method, rows, 96, seed=1)
    layer = BLOCK_LAYERS[method](weight, None)
    assert layer.blocks.dtype == torch.uint8
    # The format's bytes per block, for whole panels of 8 rows (45 rows are stored as 48, the last 3 zero).
    assert layer.blocks.shape == (48, 3 * {"q4_1": 20, "q8_0": 34}[method])
    torch.testing.assert_close(layer.dequantized(), weight, atol=0, rtol=0)


def test_the_default_models_weights_pack_back_exactly() -> None:
    """The default GGUF's layers are q4_1 and its (tied) embedding q8_0: packing what the loader dequantized gives
    back the file's own weights, so `auto` computes with exactly the model that shipped."""
    weights = dict(load_weights(resolve_model(DEFAULT_MODEL), torch.float32))
    for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.29.mlp.down_proj.weight"):
        torch.testing.assert_close(Q4_1Linear(weights[name], None).dequantized(), weights[name], atol=0, rtol=0)
    head = weights["model.embed_tokens.weight"][:4096]
    torch.testing.assert_close(Q8_0Linear(head, None).dequantized(), head, atol=0, rtol=0)


@pytest.mark.parametrize("method", ["q4_1", "q8_0"])
def test_any_weights_round_to_within_half_a_step(method: str) -> None:
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(2))
    error = (BLOCK_LAYERS[method](weight, None).dequantized() - weight).reshape(64, 4, 32).abs().amax(-1)
    blocks = weight.reshape(64, 4, 32)
    if method == "q4_1":
        step = (blocks.amax(-1) - blocks.amin(-1)) / 15
    else:
        step = blocks.abs().amax(-1) / 127
    # Half a step, plus the float16 rounding of the scale and minimum.
    assert (error <= step * 0.5 * 1.01 + 1e-3 * blocks.abs().amax(-1)).all()
    assert error.max() > 0  # random weights do get rounded


# rows: the panel path's tiles (1 to 8 rows) and the widened-weights path's (9 on: tiles of 4 rows, their remainders,
# and 100 rows, which cross a widening chunk of 96); out_features: odd, so the threads get uneven shares and the last
# group of 3 panels is short (200: several groups per thread, each prefetching the next).
@pytest.mark.parametrize("method", ["q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 15, 17, 23, 40, 100])
@pytest.mark.parametrize(("out_features", "in_features"), [(7, 32), (101, 576), (33, 1536), (200, 96)])
def test_block_kernel_matches_float64_on_the_same_weights(method: str, rows: int, out_features: int, in_features: int):
    gen = torch.Generator().manual_seed(rows * out_features)
    weight = random_blocks(method, out_features, in_features, seed=rows)
    blocks = {"q4_1": pack_q4_1, "q8_0": pack_q8_0}[method](weight)
    x = torch.randn(rows, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    op = getattr(cpu_kernels(), f"{method}_linear")
    expected = x.double() @ weight.double().T
    torch.testing.assert_close(op(x, blocks, out_features, None).double(), expected, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(op(x, blocks, out_features, bias).double(), expected + bias, atol=1e-4, rtol=1e-5)


def test_block_kernel_keeps_leading_dimensions_and_reads_strided_inputs() -> None:
    weight = random_blocks("q4_1", 16, 64, seed=3)
    blocks = pack_q4_1(weight)
    x = torch.randn(2, 3, 128)[..., ::2]  # not contiguous
    y = cpu_kernels().q4_1_linear(x, blocks, 16, None)
    assert y.shape == (2, 3, 16)
    torch.testing.assert_close(y.double(), x.double() @ weight.double().T, atol=1e-5, rtol=1e-5)
    assert cpu_kernels().q4_1_linear(torch.zeros(0, 64), blocks, 16, None).shape == (0, 16)


def test_block_kernel_refuses_inputs_that_do_not_fit() -> None:
    ops = cpu_kernels()
    blocks = pack_q4_1(torch.randn(8, 64))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.q4_1_linear(torch.zeros(1, 48), blocks, 8, None)
    with pytest.raises(RuntimeError, match="has 320 bytes, expected 480"):  # blocks for 64 features, not 96
        ops.q4_1_linear(torch.zeros(1, 96), blocks, 8, None)
    with pytest.raises(RuntimeError, match="float32"):
        ops.q4_1_linear(torch.zeros(1, 64, dtype=torch.bfloat16), blocks, 8, None)
    with pytest.raises(RuntimeError, match="uint8"):
        ops.q4_1_linear(torch.zeros(1, 64), blocks.float(), 8, None)
    with pytest.raises(RuntimeError, match="bias"):
        ops.q4_1_linear(torch.zeros(1, 64), blocks, 8, torch.zeros(7))
    with pytest.raises(ValueError, match="multiple of 32; a layer has 40"):
        Q4_1Linear(torch.randn(8, 40), None)


@pytest.mark.parametrize("method", ["q4_1", "q8_0"])
def test_block_layer_runs_the_kernel_up_to_its_row_limit_and_its_fp16_copy_above(method: str) -> None:
    gen = torch.Generator().manual_seed(4)
    weight = random_blocks(method, 40, 64, seed=4)
    bias = torch.randn(40, generator=gen)
    layer = BLOCK_LAYERS[method](weight, bias, BatchedPath("fp16", BLOCK_KERNEL_MAX_ROWS))
    op = getattr(cpu_kernels(), f"{method}_linear")
    few = torch.randn(BLOCK_KERNEL_MAX_ROWS, 64, generator=gen)
    torch.testing.assert_close(layer(few), op(few, layer.blocks, 40, layer.bias), atol=0, rtol=0)
    many = torch.randn(BLOCK_KERNEL_MAX_ROWS + 1, 64, generator=gen)
    torch.testing.assert_close(layer(many), layer.prepare_batched()(many), atol=0, rtol=0)
    rounded = Float16WeightLinear(weight, bias)  # the copy holds the blocks' weights rounded to float16
    torch.testing.assert_close(layer(many), rounded(many), atol=1e-5, rtol=1e-5)



@pytest.mark.parametrize("rows", [1, 9, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_layer_multiplies_bfloat16_rounded_inputs_and_weights_in_float32(rows: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(48, 96, generator=gen)
    bias = torch.randn(48, generator=gen) if with_bias else None
    x = torch.randn(rows, 96, generator=gen)
    got = Bfloat16WeightLinear(weight, bias)(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 48)
    products = x.bfloat16().double() @ weight.bfloat16().double().T
    # Products of the bfloat16 values summed in float32, the sum rounded once to bfloat16 (within one of its steps,
    # 2^-8 relative), then the bias added in float32.
    expected = products + (0 if bias is None else bias.double())
    torch.testing.assert_close(got.double(), expected, atol=1e-4 + 2**-8 * products.abs().max().item(), rtol=0)
    unrounded = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    assert (got.double() - unrounded).abs().max() > 1e-3  # the inputs really were rounded to bfloat16


@pytest.mark.parametrize("method", ["q4_1", "q8_0"])
def test_block_layer_hands_batches_above_its_rows_to_a_bf16_copy_of_the_same_weights(method: str) -> None:
    gen = torch.Generator().manual_seed(5)
    weight = random_blocks(method, 40, 64, seed=5)
    bias = torch.randn(40, generator=gen)
    layer = BLOCK_LAYERS[method](weight, bias, BatchedPath("bf16", 8))
    op = getattr(cpu_kernels(), f"{method}_linear")
    few = torch.randn(8, 64, generator=gen)
    torch.testing.assert_close(layer(few), op(few, layer.blocks, 40, layer.bias), atol=0, rtol=0)
    many = torch.randn(9, 64, generator=gen)
    assert isinstance(layer.prepare_batched(), Bfloat16WeightLinear)
    torch.testing.assert_close(layer(many), Bfloat16WeightLinear(weight, bias)(many), atol=0, rtol=0)
    # Within bfloat16's rounding of the float32 result on the same weights.
    torch.testing.assert_close(layer(many), many @ weight.T + bias, atol=0.05, rtol=0.02)


def test_switching_the_batched_path_drops_a_copy_of_the_other_kind() -> None:
    layer = Q4_1Linear(random_blocks("q4_1", 16, 64, seed=6), None, BatchedPath("fp16", BLOCK_KERNEL_MAX_ROWS))
    model = nn.Sequential(layer)
    x = torch.randn(65, 64)
    assert isinstance(layer.prepare_batched(), Float16WeightLinear)
    use_batched_path(model, BatchedPath("bf16", 4))
    assert layer.batched is None and layer.batched_path == BatchedPath("bf16", 4)
    torch.testing.assert_close(layer(x[:5]), layer.prepare_batched()(x[:5]), atol=0, rtol=0)  # 5 rows > 4: the copy
    assert isinstance(layer.batched, Bfloat16WeightLinear)
    use_batched_path(model, BatchedPath("bf16", 64))  # same weights, another row limit: the copy stays
    assert isinstance(layer.batched, Bfloat16WeightLinear)


@pytest.mark.parametrize(("avx512_bf16", "amx", "bf16_rows"), [
    (False, False, BLOCK_KERNEL_MAX_ROWS),
    (True, False, BLOCK_KERNEL_MAX_ROWS),
    (True, True, AMX_BLOCK_KERNEL_MAX_ROWS),
])
def test_batched_path_keeps_float32_activations_unless_bf16_is_asked_for(
    monkeypatch, avx512_bf16: bool, amx: bool, bf16_rows: int
) -> None:
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(kernel_choice, "amx_kernel_loads", lambda: False)
    monkeypatch.setattr(kernel_choice, "int16_vnni_kernel_runs", lambda: False)
    monkeypatch.delenv(kernels.DISABLED_FEATURES_VARIABLE, raising=False)  # the CPU is what the patches above say
    # Without lmserve's AMX kernel or the VNNI build of the int16 kernels, auto keeps float32 activations and fixes
    # each row's path by what the row is: prompt rows on the float16 copy, generated rows on the block kernel (a
    # request's tokens independent of its batch).
    prompt_fp16 = BatchedPath("fp16", BLOCK_KERNEL_MAX_ROWS, prompt_copies=True, prompt_weights="fp16")
    assert batched_path("auto") == batched_path(None) == batched_path("prompt-fp16") == prompt_fp16
    assert batched_path("fp16") == BatchedPath("fp16", BLOCK_KERNEL_MAX_ROWS)
    # bf16 goes below the usual row limit only where AMX tiles beat the block kernel there.
    assert batched_path("bf16") == BatchedPath("bf16", bf16_rows)
    with pytest.raises(ValueError, match="unknown batched weights 'int4'"):
        batched_path("int4")
    with pytest.raises(ValueError, match="prompt-bf16 needs a CPU with AMX"):
        batched_path("prompt-bf16")


def test_auto_keeps_every_row_on_the_blocks_where_the_vnni_int16_kernels_run(monkeypatch) -> None:
    """There the int16 kernels multiply prompts faster than fbgemm's float16 copy would: no copy is made (the file's
    size in memory), unless the layers were asked to take float32 activations, whose kernels are slower there."""
    monkeypatch.setattr(kernel_choice, "amx_kernel_loads", lambda: False)
    monkeypatch.setattr(kernel_choice, "int16_vnni_kernel_runs", lambda: True)
    assert batched_path("auto") == batched_path("auto", "int16") == batched_path("none")
    assert batched_path("none") == BatchedPath("none", sys.maxsize)
    prompt_fp16 = BatchedPath("fp16", BLOCK_KERNEL_MAX_ROWS, prompt_copies=True, prompt_weights="fp16")
    assert batched_path("auto", "float32") == prompt_fp16
    assert batched_path("prompt-fp16") == prompt_fp16  # still there when asked for
    monkeypatch.setattr(kernel_choice, "amx_kernel_loads", lambda: True)  # AMX's bfloat16 prompt kernel first
    assert batched_path("auto") == batched_path("prompt-bf16")


def test_auto_keeps_every_row_on_the_blocks_under_8_bit_activations_on_every_kind(monkeypatch) -> None:
    """int8 activations (auto for large models) prefill on the AVX2 build about as fast as fbgemm's copy, which would
    more than double the weights' memory: no copy there, nor on AMX (its bfloat16 copy is as large)."""
    monkeypatch.setattr(kernel_choice, "amx_kernel_loads", lambda: False)
    monkeypatch.setattr(kernel_choice, "int16_vnni_kernel_runs", lambda: False)  # the AVX2 build
    assert batched_path("auto", "int8") == batched_path("none")
    assert batched_path("auto", "int16").prompt_weights == "fp16"
    assert batched_path("prompt-fp16", "int8").prompt_weights == "fp16"  # still there when asked for
    monkeypatch.setattr(kernel_choice, "amx_kernel_loads", lambda: True)
    assert batched_path("auto", "int8") == batched_path("none")
    assert batched_path("auto", "int16") == batched_path("prompt-bf16")  # smaller models keep AMX's prompt kernel
    assert batched_path("prompt-bf16", "int8") == batched_path("prompt-bf16")  # asked for


def test_auto_sends_prompt_rows_to_the_amx_kernel_where_it_runs(monkeypatch) -> None:
    monkeypatch.setattr(kernel_choice, "amx_kernel_loads", lambda: True)
    expected = BatchedPath("fp16", BLOCK_KERNEL_MAX_ROWS, prompt_copies=True)
    assert batched_path("auto") == batched_path("prompt-bf16") == expected
    assert batched_path("fp16") == BatchedPath("fp16", BLOCK_KERNEL_MAX_ROWS)  # still there when asked for


def test_prompt_rows_are_slices_where_contiguous_and_indices_elsewhere() -> None:
    rows = PromptRows.from_mask(np.array([False, False, True, True, True]))
    assert (rows.num_rows, rows.generated, rows.prompt) == (5, slice(0, 2), slice(2, 5))
    assert PromptRows.from_mask(np.array([True, True])) == PromptRows(2, slice(0, 2), None)
    assert PromptRows.from_mask(np.array([False])) == PromptRows(1, None, slice(0, 1))
    mixed = PromptRows.from_mask(np.array([False, True, False, True]))
    assert mixed.generated.tolist() == [0, 2] and mixed.prompt.tolist() == [1, 3]


needs_amx = pytest.mark.skipif(not kernel_choice.amx_kernel_loads(), reason="needs a CPU with AMX")


@needs_amx
@pytest.mark.parametrize(("out_features", "in_features"), [(64, 96), (96, 1536), (3072, 576)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_amx_layer_multiplies_bfloat16_rounded_inputs_and_weights_in_float32(
    out_features: int, in_features: int, with_bias: bool
) -> None:
    gen = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    layer = AmxBfloat16Linear(weight, bias)
    x = torch.randn(77, in_features, generator=gen)  # not a whole number of 32-row passes
    got = layer(x)
    assert got.dtype == torch.float32 and got.shape == (77, out_features)
    expected = x.bfloat16().double() @ weight.bfloat16().double().T + (0 if bias is None else bias.double())
    # Exact products of the bfloat16 values summed in float32, not rounded to bfloat16 on the way out.
    torch.testing.assert_close(got.double(), expected, atol=1e-5 * expected.abs().max().item(), rtol=0)
    unrounded = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    assert (got.double() - unrounded).abs().max() > 1e-3  # the inputs really were rounded to bfloat16
    assert layer(x[:0]).shape == (0, out_features)


@needs_amx
def test_amx_layer_gives_a_row_the_same_bits_whatever_rows_share_its_call() -> None:
    gen = torch.Generator().manual_seed(7)
    layer = AmxBfloat16Linear(torch.randn(960, 576, generator=gen), torch.randn(960, generator=gen))
    x = torch.randn(300, 576, generator=gen)
    whole = layer(x)
    for start, count in [(0, 1), (5, 3), (17, 40), (100, 200), (299, 1)]:
        assert torch.equal(layer(x[start : start + count]), whole[start : start + count])
    shuffled = torch.randperm(300, generator=gen)
    assert torch.equal(layer(x[shuffled]), whole[shuffled])


@needs_amx
def test_amx_layer_refuses_shapes_and_inputs_it_cannot_tile() -> None:
    assert not AmxBfloat16Linear.fits(40, 64) and not AmxBfloat16Linear.fits(64, 48)
    op = cpu_kernels().amx_linear
    packed = cpu_kernels().amx_pack_weight(torch.randn(64, 96))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        op(torch.randn(2, 80), packed, 64, None)
    with pytest.raises(RuntimeError, match="float32"):
        op(torch.randn(2, 96).double(), packed, 64, None)
    with pytest.raises(RuntimeError, match="amx_pack_weight"):
        op(torch.randn(2, 96), torch.randn(64, 96).bfloat16()[:32], 64, None)


@needs_amx
@pytest.mark.parametrize("method", ["q4_1", "q8_0"])
def test_block_layer_with_prompt_copies_sends_prompt_rows_to_amx_and_generated_rows_to_the_kernel(
    method: str,
) -> None:
    gen = torch.Generator().manual_seed(8)
    weight = random_blocks(method, 64, 96, seed=8)
    bias = torch.randn(64, generator=gen)
    layer = BLOCK_LAYERS[method](weight, bias, BatchedPath("fp16", BLOCK_KERNEL_MAX_ROWS, prompt_copies=True))
    assert use_prompt_copies(nn.Sequential(layer)) == 1
    op = getattr(cpu_kernels(), f"{method}_linear")
    x = torch.randn(100, 96, generator=gen)
    kernel = op(x, layer.blocks, 64, layer.bias)
    # No prompt rows said, or none in the batch: the block kernel at every size (no float16 copy is made).
    torch.testing.assert_close(layer(x), kernel, atol=0, rtol=0)
    with prompt_rows(PromptRows.from_mask(np.zeros(100, dtype=bool))):
        torch.testing.assert_close(layer(x), kernel, atol=0, rtol=0)
    assert layer.batched is None and layer.prompt_copy is None
    amx = AmxBfloat16Linear(layer.dequantized(), bias)(x)
    for mask in (np.arange(100) >= 30, np.arange(100) % 3 == 0, np.ones(100, dtype=bool)):
        with prompt_rows(PromptRows.from_mask(mask)):
            got = layer(x)
        torch.testing.assert_close(got[mask], amx[mask], atol=0, rtol=0)
        torch.testing.assert_close(got[~mask], kernel[~mask], atol=0, rtol=0)
    with prompt_rows(PromptRows.from_mask(np.ones(7, dtype=bool))):  # rows of another batch (the output layer's)
        torch.testing.assert_close(layer(x[:5]), op(x[:5], layer.blocks, 64, layer.bias), atol=0, rtol=0)


@pytest.mark.parametrize("method", ["q4_1", "q8_0"])
def test_prompt_fp16_sends_prompt_rows_to_the_float16_copy_and_generated_rows_to_the_kernel(method: str) -> None:
    """prompt-fp16 (auto without AMX): a row's path is fixed by what it is, never by the batch's size: so a prompt row
    gives the same bits alone, among 100 prompt rows or beside generated ones, and so does a generated row."""
    gen = torch.Generator().manual_seed(9)
    weight = random_blocks(method, 64, 96, seed=9)
    bias = torch.randn(64, generator=gen)
    path = BatchedPath("fp16", BLOCK_KERNEL_MAX_ROWS, prompt_copies=True, prompt_weights="fp16")
    layer = BLOCK_LAYERS[method](weight, bias, path)
    assert use_prompt_copies(nn.Sequential(layer)) == 1
    op = getattr(cpu_kernels(), f"{method}_linear")
    x = torch.randn(100, 96, generator=gen)
    kernel = op(x, layer.blocks, 64, layer.bias)
    copy = Float16WeightLinear(layer.dequantized(), bias)
    fp16 = copy(x)
    assert not torch.equal(fp16, kernel)  # two paths indeed: without the split a row would depend on the batch
    for mask in (np.arange(100) >= 30, np.arange(100) % 3 == 0, np.ones(100, dtype=bool)):
        with prompt_rows(PromptRows.from_mask(mask)):
            got = layer(x)
        torch.testing.assert_close(got[mask], fp16[mask], atol=0, rtol=0)
        torch.testing.assert_close(got[~mask], kernel[~mask], atol=0, rtol=0)
    for rows in (slice(0, 1), slice(40, 47), slice(3, 70)):  # prompt rows alone or few: still the float16 copy
        n = rows.stop - rows.start
        with prompt_rows(PromptRows.from_mask(np.ones(n, dtype=bool))):
            torch.testing.assert_close(layer(x[rows]), fp16[rows], atol=0, rtol=0)
    assert isinstance(layer.prompt_copy, Float16WeightLinear) and layer.batched is None


@pytest.mark.parametrize("method", ["q4_1", "q8_0"])
def test_batched_weights_none_keeps_every_row_on_the_kernel_and_builds_no_copy(method: str) -> None:
    """--batched-weights none: the weights take the file's size in memory; every row, prompt or generated, of any
    batch runs the block kernel (so a row's bits do not depend on its batch either)."""
    path = batched_path("none")
    assert path == BatchedPath("none", path.block_kernel_max_rows) and not path.prompt_copies
    layer = BLOCK_LAYERS[method](random_blocks(method, 32, 64, seed=3), None, path)
    model = nn.Sequential(layer)
    prepare_batched_copies(model)
    assert layer.batched is None and layer.prompt_copy is None
    # With int16 activations a row's bits are its own; float32 ones sum in an order set by the
    # batch's size (1-2, 3-8, 9+ rows; issue 32's note).
    invariant = kernel_choice.int16_kernel_loads() and layer.use_integer_activations()
    x = torch.randn(300, 64, generator=torch.Generator().manual_seed(4))
    kernel = layer.linear_op(x, layer.blocks, 32, None)
    with prompt_rows(PromptRows.from_mask(np.arange(300) < 200)):
        assert torch.equal(layer(x), kernel)
    assert torch.equal(layer(x[7:8]), kernel[7:8]) or not invariant
    assert layer.batched is None and layer.prompt_copy is None


def test_copies_built_on_several_threads_are_built_once_each(monkeypatch) -> None:
    """prepare_batched_copies with threads: every layer's prompt copy exists afterwards, made once (a forward pass
    racing the builders waits for a layer's copy instead of making a second), and computes what a copy built alone
    computes."""
    layers = [Q8_0Linear(random_blocks("q8_0", 32, 64, seed=seed), None, batched_path("prompt-fp16"))
              for seed in range(6)]
    for layer in layers:
        layer.prompt_copies = True
    built: list[int] = []
    real = Float16WeightLinear.__init__

    def counting(self, weight, bias) -> None:
        built.append(weight.shape[0])
        real(self, weight, bias)

    monkeypatch.setattr(Float16WeightLinear, "__init__", counting)
    model = nn.Sequential(*layers)
    racer = threading.Thread(target=lambda: [layer.prepare_prompt_copy() for layer in reversed(layers)])
    racer.start()
    prepare_batched_copies(model, threads=3)
    racer.join()
    assert len(built) == len(layers)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(8))
    for layer in layers:
        assert isinstance(layer.prompt_copy, Float16WeightLinear) and layer.batched is None
        assert torch.equal(layer.prompt_copy(x), Float16WeightLinear(layer.dequantized(), None)(x))


def test_a_forward_pass_that_reads_a_copy_while_it_is_being_set_waits_for_it() -> None:
    """nn.Module.__setattr__ takes a module out of the layer's __dict__ before it puts it in _modules: a forward pass
    that asks for the prompt copy in between (the builders' background thread setting it) once raised AttributeError
    (a tensor-parallel rank failed its step under load). The registration hook runs in exactly that gap."""
    layer = Q8_0Linear(random_blocks("q8_0", 32, 64, seed=3), None, batched_path("prompt-fp16"))
    results: list[object] = []
    readers: list[threading.Thread] = []

    def read_copy() -> None:
        try:
            results.append(layer.prepare_prompt_copy())
        except AttributeError as error:
            results.append(error)

    def in_the_gap(module: nn.Module, name: str, submodule: nn.Module) -> None:
        if module is layer and name == "prompt_copy" and not readers:
            readers.append(threading.Thread(target=read_copy))
            readers[0].start()
            readers[0].join(timeout=2)  # the reader waits for the builder's lock (or, before, failed at once)

    handle = nn.modules.module.register_module_module_registration_hook(in_the_gap)
    try:
        built = layer.prepare_prompt_copy()
    finally:
        handle.remove()
    readers[0].join()
    assert results == [built]


@pytest.mark.parametrize("setting", ["bf16", "fp16", "prompt-fp16"])
def test_the_runner_gives_every_block_layer_the_batched_path_it_was_asked_for(setting: str) -> None:
    from lmserve.config import CacheConfig, ModelConfig
    from lmserve.worker.model_runner import ModelRunner

    runner = ModelRunner(ModelConfig(batched_weights=setting), CacheConfig(num_blocks=16))
    blocks = [m for m in runner.model.modules() if isinstance(m, (Q4_1Linear, Q8_0Linear))]
    assert len(blocks) == 30 * 4 + 1  # qkv, o, gate_up, down per layer, and the q8_0 output layer
    assert {m.batched_path for m in blocks} == {batched_path(setting)}


def test_a_float16_weight_rows_result_does_not_depend_on_its_batch(monkeypatch) -> None:
    """fbgemm's AVX2 kernels sum a remainder of 1 or 2 rows in another order than their 6-row tiles (a prompt row's
    bits moved with the chunk's length on an AVX2-only CPU); padded to whole tiles, every row gets its own bits."""
    gen = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(80, 96, generator=gen), torch.randn(80, generator=gen)
    x = torch.randn(40, 96, generator=gen)
    for tile in (kernel_choice.fbgemm_row_tile(), kernel_choice.FBGEMM_AVX2_ROWS):  # this CPU's, and the AVX2 one
        monkeypatch.setattr(batched_copies, "fbgemm_row_tile", lambda tile=tile: tile)
        layer = Float16WeightLinear(weight, bias)
        together = layer(x)
        torch.testing.assert_close(together, x @ weight.half().float().T + bias, rtol=1e-5, atol=1e-5)
        for rows in range(1, 40):
            assert torch.equal(layer(x[:rows]), together[:rows]), (tile, rows)
        assert torch.equal(layer(x[:12].reshape(3, 4, 96)), together[:12].reshape(3, 4, 80))
