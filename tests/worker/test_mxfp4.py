"""MXFP4 (gpt-oss's experts) against the format's definition: llama.cpp's block (an E8M0 scale byte, 32 E2M1 values
as q4_0's nibbles), gguf-py's dequantization of it, a block worked out by hand, OpenAI's checkpoint layout
(`*_blocks`/`*_scales`) read as transformers reads it, and the int16 kernel's packing of it (exact scales, a refusal
where a scale has no float16)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gpt_oss_models import hf_mxfp4_values, random_mxfp4

from lmserve.formats.block_formats import BLOCK_TYPES
from lmserve.worker.weights.block_packing import StoredBlocks
from lmserve.worker.weights.gpt_oss import dequantize_mxfp4, mxfp4_blocks_from_hf
from lmserve.worker.weights.kernel_choice import int16_kernel_loads
from lmserve.worker.weights.layer_types import LAYER_TYPES
from lmserve.worker.weights.stored_formats import convert_blocks

Q = gguf.GGMLQuantizationType


def test_the_table_holds_llama_cpps_block() -> None:
    assert BLOCK_TYPES["mxfp4"].block_bytes == gguf.GGML_QUANT_SIZES[Q.MXFP4][1] == 17
    assert BLOCK_TYPES["mxfp4"].block_width == gguf.GGML_QUANT_SIZES[Q.MXFP4][0] == 32
    assert BLOCK_TYPES["mxfp4"].exact_into == ("mxfp4", "q8_0")


def hand_block() -> tuple[np.ndarray, np.ndarray]:
    """Scale byte 127 (2^0); value k in byte k's low nibble, value k + 16 in its high one. E2M1 codes 0-7 are +0, 0.5,
    1, 1.5, 2, 3, 4, 6, codes 8-15 the same negated."""
    block = np.zeros(17, dtype=np.uint8)
    block[0] = 127
    block[1] = 0x71  # value 0: code 1 (+0.5); value 16: code 7 (+6)
    block[2] = 0xF9  # value 1: code 9 (-0.5); value 17: code 15 (-6)
    block[3] = 0x5A  # value 2: code 10 (-1); value 18: code 5 (+3)
    expected = np.zeros(32, dtype=np.float32)
    expected[[0, 16, 1, 17, 2, 18]] = [0.5, 6.0, -0.5, -6.0, -1.0, 3.0]
    return block, expected


def test_a_block_worked_out_by_hand() -> None:
    block, expected = hand_block()
    assert np.array_equal(dequantize_mxfp4(block[None]), expected)
    assert np.array_equal(gguf.quants.dequantize(block[None], Q.MXFP4)[0], expected)
    scaled = block.copy()
    scaled[0] = 130  # 2^3
    assert np.array_equal(dequantize_mxfp4(scaled[None]), expected * 8)


def test_every_code_and_scale_dequantizes_as_gguf_py_does() -> None:
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (256, 17), dtype=np.uint8)
    blocks[:, 0] = np.arange(256)  # every E8M0 byte, the subnormal 2^-128 and 2^-127 included
    with np.errstate(over="ignore"):  # e = 255: 2^127 times 12 is infinite in float32, in both
        ours, theirs = dequantize_mxfp4(blocks[:, None]), gguf.quants.dequantize(blocks, Q.MXFP4)
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))


def test_a_checkpoints_blocks_and_scales_are_llama_cpps_blocks_of_the_same_values() -> None:
    """OpenAI's layout (value 2i, 2i + 1 in one byte) as convert_hf_to_gguf.py repacks it, read back by gguf-py, gives
    what transformers' own reader (integrations/mxfp4.py) gives."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = random_mxfp4((3, 16, 96), np.random.default_rng(1), exponents=(100, 140))
    ggml = mxfp4_blocks_from_hf(torch.from_numpy(blocks), torch.from_numpy(scales))
    assert ggml.shape == (3, 16, 3, 17)
    theirs = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    values = gguf.quants.dequantize(ggml.numpy().reshape(48, -1), Q.MXFP4).reshape(3, 16, 96)
    assert torch.equal(torch.from_numpy(values), theirs.transpose(1, 2))
    assert np.array_equal(values, hf_mxfp4_values(blocks, scales))


@pytest.mark.skipif(not int16_kernel_loads(), reason="the int16 kernels did not build")
def test_the_kernels_packing_holds_the_scales_exactly_and_refuses_one_float16_cannot_hold() -> None:
    block, expected = hand_block()
    blocks = np.tile(block, (16, 2, 1))  # 16 rows (a kernel group) of 2 blocks
    blocks[:, 1, 0] = 104  # 2^-24: float16's smallest subnormal
    blocks[3, 0, 0] = 143  # 2^15: its largest power of two
    layer = LAYER_TYPES["mxfp4"](StoredBlocks("mxfp4", torch.from_numpy(blocks)), None)
    assert torch.equal(layer.dequantized(), torch.from_numpy(gguf.quants.dequantize(blocks.reshape(16, -1), Q.MXFP4)))
    assert torch.equal(layer.dequantized()[0, :32], torch.from_numpy(expected))
    for exponent in (103, 144):
        blocks[5, 1, 0] = exponent
        with pytest.raises(RuntimeError, match="outside float16's range"):
            LAYER_TYPES["mxfp4"](StoredBlocks("mxfp4", torch.from_numpy(blocks)), None)
        with pytest.raises(ValueError, match="outside float16's range"):
            convert_blocks("mxfp4", blocks, "q8_0")


@pytest.mark.skipif(not int16_kernel_loads(), reason="the int16 kernels did not build")
@pytest.mark.parametrize("activations", ["int8", "int16"])
def test_a_row_gets_its_own_bits_under_either_activation_split(activations: str) -> None:
    """Batch invariance on the mxfp4 kernel: every row the bits it gets alone, whatever rows share its call (an inf's
    row and a zero row among them), under the AVX2 build's vector split and its element-by-element one
    (LMSERVE_DISABLE_CPU_FEATURES=avx2-split), which give the same bits (mxfp4 reads no block sum of x)."""
    from test_stored_formats import random_stored_blocks

    from lmserve.worker.kernels import cpu_kernels

    ops = cpu_kernels()
    blocks = random_stored_blocks("mxfp4", 48, 64, seed=31)
    layer = LAYER_TYPES["mxfp4"](StoredBlocks("mxfp4", torch.from_numpy(blocks)), None, activations=activations)
    linear = layer.linear_op if activations == "int16" else layer.int8_linear_op
    x = torch.randn(11, 2048, generator=torch.Generator().manual_seed(32))
    x *= torch.logspace(-3, 2, 2048)[torch.randperm(2048, generator=torch.Generator().manual_seed(33))]
    x[3, 5], x[7] = float("inf"), 0.0
    bias = torch.randn(48, generator=torch.Generator().manual_seed(34))
    splits = (True, False) if not ops.int16_uses_vnni() else (True,)  # the VNNI build has one split
    results = []
    try:
        for vectors in splits:
            ops.set_avx2_split(vectors)
            alone = torch.cat([linear(x[i : i + 1], layer.blocks, 48, bias) for i in range(11)])
            assert alone[3].isnan().all() and not alone[[0, 1, 2, 4, 5, 6, 7, 8, 9, 10]].isnan().any()
            for rows in (2, 4, 5, 11):
                together = linear(x[:rows], layer.blocks, 48, bias)
                assert torch.equal(together.nan_to_num(0.0), alone[:rows].nan_to_num(0.0)), (vectors, rows)
            results.append(alone.nan_to_num(0.0))
    finally:
        ops.set_avx2_split(True)
    assert all(torch.equal(r, results[0]) for r in results)
