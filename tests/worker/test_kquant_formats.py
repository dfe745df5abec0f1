"""K-quant layers at their stored size (worker/weights/kquants.py, kernels/kquant_int16.cpp): the file's values bit for
bit, products against float64 ones of the same weights, and each row's result independent of its batch."""

from __future__ import annotations

import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch

from lmserve.models import load_hf_config, resolve_model
from lmserve.worker.kernels import cpu_kernels
from lmserve.worker.model_builder import build_model
from lmserve.worker.weights.block_packing import StoredBlocks
from lmserve.worker.weights.kernel_choice import batched_path, int16_kernel_loads
from lmserve.worker.weights.kquants import (
    KQuantLinear,
    kernel_formats,
    pack_kquant,
    q4_k_fields,
    q5_k_fields,
    q6_k_fields,
)
from lmserve.worker.weights.layer_types import LAYER_TYPES
from lmserve.worker.weights.loader import load_weights, stored_matrix_types
from lmserve.worker.weights.pending import PendingBlockLinear
from lmserve.worker.weights.row_segments import RowSegmentsLinear
from lmserve.worker.weights.stored_formats import STORED_BLOCK_TYPES, runnable_types

Q = gguf.GGMLQuantizationType
CPU = torch.device("cpu")
needs_kernel = pytest.mark.skipif(not int16_kernel_loads(), reason="the int16 kernels did not build (no AVX2)")
METHODS = ["q2_k", "q3_k", "q4_k", "q5_k", "q6_k"]


@pytest.fixture(scope="module")
def stored(make_k_quant):
    """stored(method, rows, cols, seed): random valid blocks [rows, cols / 256, bytes] and gguf's float32 values of
    them [rows, cols]."""
    return lambda method, rows, cols, seed: _stored(make_k_quant, method, rows, cols, seed)


def _stored(make_k_quant, method: str, rows: int, cols: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    raw = make_k_quant(rows, cols, Q[method.upper()], np.random.default_rng(seed))
    return raw.reshape(rows, cols // 256, -1), gguf.quants.dequantize(raw, Q[method.upper()])


def test_the_fields_read_are_ggufs(stored) -> None:
    """Codes and scales as read for packing give gguf's values back (the packing only moves them)."""
    blocks, values = stored("q4_k", 16, 512, seed=1)
    d, dmin, sc, mn, codes = q4_k_fields(blocks)
    scale = d.view(np.float16).astype(np.float32) * sc  # [16, 2, 8]
    minimum = dmin.view(np.float16).astype(np.float32) * mn
    got = scale.reshape(16, 16, 1) * codes.reshape(16, 16, 32) - minimum.reshape(16, 16, 1)
    assert np.array_equal(got.reshape(16, 512), values)
    blocks, values = stored("q5_k", 16, 512, seed=4)
    d, dmin, sc, mn, codes = q5_k_fields(blocks)
    assert codes.max() == 31
    scale = d.view(np.float16).astype(np.float32) * sc
    minimum = dmin.view(np.float16).astype(np.float32) * mn
    got = scale.reshape(16, 16, 1) * codes.reshape(16, 16, 32) - minimum.reshape(16, 16, 1)
    assert np.array_equal(got.reshape(16, 512), values)
    blocks, values = stored("q6_k", 16, 256, seed=2)
    d, sc, codes = q6_k_fields(blocks)
    scale = d.view(np.float16).astype(np.float32) * sc.view(np.int8)
    got = scale.reshape(16, 16, 1) * (codes.reshape(16, 16, 16).astype(np.float32) - 32)
    assert np.array_equal(got.reshape(16, 256), values)


@needs_kernel
@pytest.mark.parametrize("method", METHODS)
def test_packed_blocks_hold_the_files_values_at_the_stored_size(stored, method: str) -> None:
    blocks, values = stored(method, 48, 768, seed=3)
    layer = KQuantLinear(StoredBlocks(method, torch.from_numpy(blocks)), None)
    assert (layer.out_features, layer.in_features) == (48, 768)
    assert torch.equal(layer.dequantized(), torch.from_numpy(values))
    per_weight = layer.blocks.numel() / (48 * 768)
    # 3.125, 3.5625, 4.625, 5.625 and 6.5625 bits a weight (the file's 2.625, 3.4375, 4.5, 5.5 and 6.5625)
    assert per_weight == {"q2_k": 1600 / 4096, "q3_k": 1824 / 4096, "q4_k": 2368 / 4096, "q5_k": 2880 / 4096,
                          "q6_k": 3360 / 4096}[method]
    assert method in repr(layer)


@needs_kernel
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("rows", [1, 3, 7, 20])
def test_the_product_is_the_float64_product_of_the_files_weights(stored, method: str, rows: int) -> None:
    blocks, values = stored(method, 32, 512, seed=rows)
    bias = torch.randn(32, generator=torch.Generator().manual_seed(rows))
    layer = KQuantLinear(StoredBlocks(method, torch.from_numpy(blocks)), bias)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(100 + rows))
    x[0, :40] *= 30  # an outlier block
    expected = x.double() @ torch.from_numpy(values).double().T + bias.double()
    got = layer(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 32)
    # The int16 activations' rounding (1/512 of each block's range) is all that separates them.
    assert (got.double() - expected).abs().max().item() < 2e-3 * expected.abs().max().item()


@needs_kernel
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(("activations", "per_256"), [("int16", True), ("int8", True), ("int8", False)])
def test_a_row_gets_the_same_bits_whatever_rows_share_its_call(stored, method: str, activations: str,
                                                               per_256: bool) -> None:
    """Under 16-bit activations, and under 8-bit ones with one scale per 256 inputs (q4_k, q5_k, q6_k) or per 32."""
    blocks, _ = stored(method, 64, 1024, seed=7)
    layer = LAYER_TYPES[method](StoredBlocks(method, torch.from_numpy(blocks)), None, batched_path("none"),
                                activations=activations)
    x = torch.randn(23, 1024, generator=torch.Generator().manual_seed(8))
    ops = cpu_kernels()
    before = ops.set_kquant_super_scale(per_256)
    try:
        together = layer(x)
        for i in range(23):
            assert torch.equal(layer(x[i : i + 1]), together[i : i + 1]), i
        assert torch.equal(layer(x[5:12]), together[5:12])
    finally:
        ops.set_kquant_super_scale(before)


def _q8_k(x: torch.Tensor) -> torch.Tensor:
    """x as llama.cpp's q8_K activations, in float64: per 256 inputs s = (largest |x|) / 127, x = s round(x / s)
    (the quotient as the kernel computes it, x times 127 / largest in float32)."""
    rows = x.reshape(x.shape[0], -1, 256)
    largest = rows.abs().amax(-1, keepdim=True)
    q = torch.round(rows * (127.0 / largest))
    return (q.double() * (largest / 127.0).double()).reshape(x.shape)


@needs_kernel
@pytest.mark.parametrize("method", ["q4_k", "q5_k", "q6_k"])
@pytest.mark.parametrize("rows", [1, 5, 9])
def test_8_bit_k_quant_products_take_one_activation_scale_per_256_inputs(stored, method: str, rows: int) -> None:
    """The int8 q4_k, q5_k and q6_k products are the float64 products of the file's weights with llama.cpp's q8_K
    activations (the sub-block scales and minimums folded into int32 sums, one float step per 256 inputs), to float32's
    rounding; set_kquant_super_scale(False) gives the per-32 products back, which are another rounding of x."""
    blocks, values = stored(method, 48, 1024, seed=60 + rows)
    weight = pack_kquant(method, blocks)
    x = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(61 + rows))
    x[0, :40] *= 30  # an outlier: its super-block's scale is 30x the others'
    bias = torch.randn(48, generator=torch.Generator().manual_seed(62))
    ops = cpu_kernels()
    linear = getattr(ops, f"{method}_int8_linear")
    expected = _q8_k(x) @ torch.from_numpy(values).double().T + bias.double()
    got = linear(x, weight, 48, bias)
    scale = expected.abs().max().item()
    assert (got.double() - expected).abs().max().item() < 1e-5 * scale
    before = ops.set_kquant_super_scale(False)
    try:
        per_32 = linear(x, weight, 48, bias)
    finally:
        ops.set_kquant_super_scale(before)
    assert (per_32.double() - expected).abs().max().item() > 1e-4 * scale  # the other rounding
    exact = x.double() @ torch.from_numpy(values).double().T + bias.double()
    assert (per_32.double() - exact).abs().max().item() < 2e-2 * scale
    assert (got.double() - exact).abs().max().item() < 2e-2 * scale


@needs_kernel
def test_per_256_activation_scales_are_turned_off_by_their_disabled_feature() -> None:
    """LMSERVE_DISABLE_CPU_FEATURES=q8k: the kernels load with one activation scale per 32 inputs for the 8-bit
    K-quant products (the setting the next set_kquant_super_scale call replaces); without it, one per 256."""
    script = ("from lmserve.worker.kernels import cpu_kernels; ops = cpu_kernels(); "
              "print(ops.set_kquant_super_scale(True))")
    for disabled, expected in (("q8k", "False"), ("", "True")):
        env = {**os.environ, "LMSERVE_DISABLE_CPU_FEATURES": disabled}
        result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
        assert result.stdout.split() == [expected], disabled


@needs_kernel
@pytest.mark.parametrize("method", ["q4_k", "q6_k", "q5_0"])
@pytest.mark.parametrize("activations", ["int16", "int8"])
def test_a_prompts_rows_in_cache_sized_blocks_get_each_rows_own_bits(stored, method: str, activations: str) -> None:
    """Wide layers take a prompt's rows a block at a time (int16_simd.h's for_each_tile: 4,096 inputs of 16-bit
    activations make blocks of 30 rows); a row still gets the bits it gets alone, in the first block, the last, and
    across the seam."""
    if method == "q5_0":
        from test_stored_formats import random_stored_blocks

        blocks = random_stored_blocks("q5_0", 32, 128, seed=41)
    else:
        blocks, _ = stored(method, 32, 4096, seed=41)
    # Every row on the block kernel (on the AVX2 kind a batch this large would take the float16 copy).
    layer = LAYER_TYPES[method](StoredBlocks(method, torch.from_numpy(blocks)), None, batched_path("none"),
                                activations=activations)
    x = torch.randn(100, 4096, generator=torch.Generator().manual_seed(42))
    together = layer(x)
    for i in (0, 29, 30, 31, 63, 64, 65, 99):
        assert torch.equal(layer(x[i : i + 1]), together[i : i + 1]), i
    assert torch.equal(layer(x[25:70]), together[25:70])


def _equal_with_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


@needs_kernel
@pytest.mark.parametrize("method", ["q4_k", "q6_k"])
@pytest.mark.parametrize("activations", ["int8", "int16"])
def test_the_avx2_splits_give_the_same_halves_and_each_row_its_own_bits(stored, method: str, activations: str) -> None:
    """The AVX2 build's activation split in vectors (kernels/int16_activations.h's split_rows_avx2) and element by
    element (split_rows_portable, LMSERVE_DISABLE_CPU_FEATURES=avx2-split): the same int8 halves (q6_k, which reads no
    block float sum, gets the same bits from both), q4_k's minimums within the float sum's rounding; under each, every
    row its own bits whatever the rows beside it, an inf's row and a zero row included."""
    ops = cpu_kernels()
    if ops.int16_uses_vnni():
        pytest.skip("the AVX-512 VNNI build has one split")
    blocks, _ = stored(method, 48, 2048, seed=11)
    weight = pack_kquant(method, blocks)
    x = torch.randn(11, 2048, generator=torch.Generator().manual_seed(12))
    x *= torch.logspace(-3, 2, 2048)[torch.randperm(2048, generator=torch.Generator().manual_seed(13))]
    x[3, 5], x[7] = float("inf"), 0.0
    bias = torch.randn(48, generator=torch.Generator().manual_seed(14))
    linear = getattr(ops, f"{method}_{activations}_linear")
    results = {}
    per_256 = ops.set_kquant_super_scale(False)  # the per-32 products read the split's halves; per 256 has its own
    try:
        for vectors in (True, False):
            ops.set_avx2_split(vectors)
            alone = torch.cat([linear(x[i : i + 1], weight, 48, bias) for i in range(11)])
            assert alone[3].isnan().all() and not alone[[0, 1, 2, 4, 5, 6, 7, 8, 9, 10]].isnan().any()
            for rows in (2, 4, 5, 11):
                assert _equal_with_nan(linear(x[:rows], weight, 48, bias), alone[:rows]), (vectors, rows)
            results[vectors] = alone
    finally:
        ops.set_avx2_split(True)
        ops.set_kquant_super_scale(per_256)
    if method == "q6_k":
        assert _equal_with_nan(results[True], results[False])
    else:
        finite = [0, 1, 2, 4, 5, 6, 7, 8, 9, 10]
        torch.testing.assert_close(results[True][finite], results[False][finite], rtol=1e-5, atol=1e-5)


@needs_kernel
def test_the_avx2_split_is_turned_off_by_its_disabled_feature() -> None:
    """LMSERVE_DISABLE_CPU_FEATURES=avx2-split: the kernels load with the element-by-element split (the setting the
    next set_avx2_split call replaces); without it the AVX2 build splits in vectors."""
    script = ("from lmserve.worker.kernels import cpu_kernels; ops = cpu_kernels(); "
              "print(ops.int16_uses_vnni(), ops.set_avx2_split(True))")
    outputs = {}
    for disabled in ("avx2-split", ""):
        env = {**os.environ, "LMSERVE_DISABLE_CPU_FEATURES": disabled}
        result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
        outputs[disabled] = result.stdout.split()
    vnni = outputs[""][0] == "True"
    assert outputs["avx2-split"] == [str(vnni), "False"]
    assert outputs[""] == [str(vnni), str(not vnni)]


@needs_kernel
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("activations", ["int16", "int8"])
def test_a_non_finite_input_gives_nan_in_its_row_only(stored, method: str, activations: str) -> None:
    blocks, _ = stored(method, 16, 256, seed=9)
    layer = LAYER_TYPES[method](StoredBlocks(method, torch.from_numpy(blocks)), None, batched_path("none"),
                                activations=activations)
    x = torch.randn(3, 256)
    x[1, 7] = float("inf")
    y = layer(x)
    assert y[1].isnan().all() and y[[0, 2]].isfinite().all()
    assert torch.equal(layer(torch.zeros(2, 256)), torch.zeros(2, 16))


@needs_kernel
@pytest.mark.parametrize("method", METHODS)
def test_the_kernels_packer_writes_the_numpy_packers_bytes(stored, method: str) -> None:
    blocks, _ = stored(method, 48, 1024, seed=21)
    ops = cpu_kernels()
    assert torch.equal(getattr(ops, f"{method}_int16_pack")([torch.from_numpy(blocks)]), pack_kquant(method, blocks))
    with pytest.raises(RuntimeError, match="multiple of 16"):
        getattr(ops, f"{method}_int16_pack")([torch.from_numpy(blocks[:24])])


@needs_kernel
@pytest.mark.parametrize("method", ["q4_k", "q6_k", "q5_0"])
def test_a_fused_layers_parts_pack_as_the_whole_layer(stored, tmp_path, method: str) -> None:
    """A fused layer's q, k and v (or gate and up) go to the packer as the file's mapped parts, no copy of the whole
    layer first: the packed bytes and the products are those of the layer given whole."""
    if method == "q5_0":
        from test_stored_formats import random_stored_blocks

        blocks = random_stored_blocks("q5_0", 64, 16, seed=33)
    else:
        blocks, _ = stored(method, 64, 512, seed=33)
    path = tmp_path / "layer.bin"
    blocks.tofile(path)
    mapped = torch.from_numpy(np.memmap(path, mode="c", dtype=np.uint8, shape=blocks.shape))  # as the loader maps it
    whole = LAYER_TYPES[method](StoredBlocks(method, torch.from_numpy(blocks)), None, activations="int16")
    pending = PendingBlockLinear(method, 512, 64, bias=False, activations="int16")
    for start, stop in ((48, 64), (0, 32), (32, 48)):  # in any order the file lists them
        pending.load_rows(start, StoredBlocks(method, mapped[start:stop]))
    layer = pending.finish()
    assert torch.equal(layer.blocks, whole.blocks)
    x = torch.randn(5, 512)
    assert torch.equal(layer(x), whole(x))


def test_packing_refuses_what_the_kernel_cannot_tile(stored) -> None:
    blocks, _ = stored("q4_k", 24, 256, seed=0)
    with pytest.raises(ValueError, match="multiple of 16"):
        pack_kquant("q4_k", blocks)
    with pytest.raises(ValueError, match="q6_k blocks have 210 bytes"):
        pack_kquant("q6_k", blocks[:16])


@needs_kernel
def test_a_fused_layer_of_two_k_quants_runs_each_part_in_its_own_format(tiny_kquant_gguf) -> None:
    """Q4_K_M's layer: q and k in Q4_K, v in Q6_K (conftest.K_QUANT_LAYER_TYPES, layer 0): q/k/v as segments of rows,
    each at its stored size with the file's values; layer 1's (Q2_K, Q3_K, Q5_K) too."""
    source = resolve_model(str(tiny_kquant_gguf))
    config = load_hf_config(source)
    formats = kernel_formats()
    stored = runnable_types(stored_matrix_types(source), formats)
    reference = build_model(config, 64, CPU, torch.float32)
    reference.load_weights(load_weights(source, torch.float32))
    model = build_model(config, 64, CPU, torch.float32, block_method="q4_k", stored_types=stored, formats=formats)
    model.load_weights(load_weights(source, torch.float32, blocks=STORED_BLOCK_TYPES))
    model.quantize_float_layers("fp16")
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, RowSegmentsLinear)
    assert [(s.method, s.out_features) for s in qkv.segments] == [("q4_k", 256), ("q4_k", 128), ("q6_k", 128)]
    assert torch.equal(qkv.dequantized(), reference.layers[0].self_attn.qkv_proj.weight)
    assert isinstance(model.layers[0].mlp.gate_up_proj, KQuantLinear)  # Q4_K gate and up: one layer
    other = model.layers[1].self_attn.qkv_proj
    assert [(s.method, s.out_features) for s in other.segments] == [("q2_k", 256), ("q3_k", 128), ("q5_k", 128)]
    assert torch.equal(other.dequantized(), reference.layers[1].self_attn.qkv_proj.weight)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference.layers[0].self_attn.qkv_proj(x)
    torch.testing.assert_close(qkv(x), expected, atol=2e-3, rtol=2e-3)
    assert torch.equal(qkv(x[2:3]), qkv(x)[2:3])  # each segment's rows batch-invariant


def test_a_layer_whose_slice_fits_no_block_is_named_in_a_warning() -> None:
    """A K-quant layer whose shape on this rank is no whole number of 256-column blocks stays a float (float16)
    layer: that used to happen without a word; now each such layer is collected and the warning names them, by
    kind and layer index, with the format and the rank's shape."""
    from lmserve.worker.weights.pending import pend_block_linears
    from lmserve.worker.weights.shards import unfit_layers_message

    with torch.device("meta"):
        layers = torch.nn.ModuleDict({str(i): torch.nn.ModuleDict({"o_proj": torch.nn.Linear(128, 64, bias=False),
                                                                   "down_proj": torch.nn.Linear(512, 64, bias=False)})
                                      for i in range(2)})
    unfit: list = []
    assert pend_block_linears(layers, "q4_k", unfit=unfit) == 2  # the down_proj layers take the blocks
    assert unfit == [("0.o_proj", "q4_k", 64, 128), ("1.o_proj", "q4_k", 64, 128)]
    assert isinstance(layers["0"]["o_proj"], torch.nn.Linear)
    message = unfit_layers_message(unfit, 2)
    assert message.startswith("2 layer(s) do not split into whole blocks of their format under tensor parallel")
    assert "o_proj of layer(s) 0, 1 (q4_k, [64, 128] on this rank)" in message and "float16" in message
