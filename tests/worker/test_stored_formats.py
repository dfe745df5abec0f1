"""A GGUF's stored block types in the kernels' formats: the conversions keep every value (against gguf's own
dequantization), each layer of a mixed file takes the format that holds all of its rows, and a model built from
such a file gives the outputs of its float32 weights."""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from torch import nn

from lmserve.distributed.layout import RankLayout
from lmserve.distributed.parallel_state import ParallelGroups
from lmserve.formats.block_formats import held_bytes_per_weight
from lmserve.formats.gguf_file import gguf_held_bits, read_gguf_header
from lmserve.models import load_hf_config, resolve_model
from lmserve.worker.kernels import cpu_kernels
from lmserve.worker.model_builder import build_model
from lmserve.worker.prompt_rows import PromptRows, prompt_rows
from lmserve.worker.weights import kernel_choice
from lmserve.worker.weights.batched_copies import Float16WeightLinear
from lmserve.worker.weights.block_embedding import BlockEmbedding
from lmserve.worker.weights.block_linear import (
    Q4_1Linear,
    Q8_0Linear,
    prepare_batched_copies,
    use_prompt_copies,
)
from lmserve.worker.weights.block_packing import StoredBlocks, as_blocks
from lmserve.worker.weights.kernel_choice import batched_path, int16_kernel_loads
from lmserve.worker.weights.kquants import Int16BlockLinear, KQuantLinear, kernel_formats
from lmserve.worker.weights.layer_types import LAYER_TYPES
from lmserve.worker.weights.loader import load_weights, stored_matrix_types
from lmserve.worker.weights.stored_formats import (
    BLOCK_FORMATS,
    STORED_BLOCK_BYTES,
    STORED_BLOCK_TYPES,
    block_width,
    convert_blocks,
    exact_kernel_format,
    float_fallbacks,
    preferred_kernel_format,
    q3_k_fields,
    runnable_types,
)

Q = gguf.GGMLQuantizationType
CPU = torch.device("cpu")


def random_stored_blocks(stored_type: str, rows: int, blocks: int, seed: int) -> np.ndarray:
    """Valid random blocks: random code bytes, float16 scales of a realistic size and sign (negative ones too)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, blocks, STORED_BLOCK_BYTES[stored_type]), dtype=np.uint8)
    scales = (rng.uniform(1e-4, 3e-2, (rows, blocks)) * rng.choice([-1, 1], (rows, blocks))).astype(np.float16)
    at = {"q3_k": 108, "q6_k": 208}.get(stored_type, 0)  # where the K-quants keep their float16 d
    raw[..., at : at + 2] = scales[..., None].view(np.uint8)
    if stored_type in ("q4_1", "q5_1"):  # the minimum m
        raw[..., 2:4] = (-8 * np.abs(scales))[..., None].astype(np.float16).view(np.uint8)
    if stored_type == "mxfp4":  # no float16 d: an E8M0 byte, 2^(e - 128) from 2^-16 to 2^-1 (gpt-oss's experts' span)
        raw[..., 0] = rng.integers(112, 128, (rows, blocks), dtype=np.uint8)
    return raw


def gguf_values(stored_type: str, blocks: np.ndarray) -> np.ndarray:
    return gguf.quants.dequantize(blocks.reshape(blocks.shape[0], -1), Q[stored_type.upper()])


@pytest.mark.parametrize(("stored_type", "kernel_format"),
                         [("q5_0", "q8_0"), ("q4_0", "q8_0"), ("q4_0", "q4_1"), ("iq4_nl", "q8_0"),
                          ("mxfp4", "q8_0")])
def test_conversion_keeps_every_value(stored_type: str, kernel_format: str) -> None:
    blocks = random_stored_blocks(stored_type, 24, 7, seed=len(stored_type) + len(kernel_format))
    converted = convert_blocks(stored_type, blocks, kernel_format)
    assert converted.shape == (24, 7, {"q8_0": 34, "q4_1": 20}[kernel_format]) and converted.dtype == np.uint8
    expected = gguf_values(stored_type, blocks)
    assert np.array_equal(gguf_values(kernel_format, converted), expected)
    # The layer's own reader and the kernels' packing read the same values back.
    stored = StoredBlocks(stored_type, torch.from_numpy(blocks))
    assert np.array_equal(stored.dequantize().numpy(), expected)
    assert torch.equal(as_blocks(kernel_format, stored), torch.from_numpy(converted))
    layer = LAYER_TYPES[kernel_format](stored, None)
    assert np.array_equal(layer.dequantized().numpy(), expected.reshape(24, -1))
    x = torch.randn(3, 7 * 32, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(layer(x), x @ torch.from_numpy(expected).reshape(24, -1).T, atol=1e-5, rtol=1e-4)


def test_q3_k_blocks_run_as_they_are_or_as_q6_k_blocks_with_every_value() -> None:
    """Q3_K (w = d (ls - 32) q, q in -4..3, a 6-bit ls a sub-block of 16) runs on its own kernel format (3.56 bits a
    weight), and is a q6_k block with sc = ls - 32 and codes q + 32 where a layer fuses it with Q6_K rows: the file's
    values exactly either way, where it had float16 weights (16)."""
    blocks = random_stored_blocks("q3_k", 32, 3, seed=13)
    _, scales, values = q3_k_fields(blocks)
    assert set(np.unique(values)) == set(range(-4, 4)) and scales.min() == -32 and scales.max() == 31
    expected = gguf_values("q3_k", blocks)
    converted = convert_blocks("q3_k", blocks, "q6_k")
    assert converted.shape == (32, 3, 210) and np.array_equal(gguf_values("q6_k", converted), expected)
    stored = StoredBlocks("q3_k", torch.from_numpy(blocks))
    assert np.array_equal(stored.dequantize().numpy(), expected)
    assert exact_kernel_format(["q3_k"]) == "q3_k" and exact_kernel_format(["q3_k", "q6_k"]) == "q6_k"
    assert exact_kernel_format(["q3_k", "q4_k"]) is None
    assert runnable_types({"a": "q3_k"}, BLOCK_FORMATS) == {"a": "float"}  # no K-quant kernel: float16 as before
    if "q6_k" not in kernel_formats():
        return
    x = torch.randn(5, 768, generator=torch.Generator().manual_seed(14))
    reference = x.double() @ torch.from_numpy(expected).double().T
    outputs = {}
    for method in ("q3_k", "q6_k"):
        layer = LAYER_TYPES[method](stored, None)
        assert layer.method == method and torch.equal(layer.dequantized(), torch.from_numpy(expected))
        got = outputs[method] = layer(x)
        assert (got.double() - reference).abs().max().item() < 2e-3 * reference.abs().max().item()
        for i in range(5):  # each row's bits its own
            assert torch.equal(layer(x[i : i + 1]), got[i : i + 1]), i
    # The same exact integer products under the same scales: the two layouts give the same bits.
    assert torch.equal(outputs["q3_k"], outputs["q6_k"])


def test_a_conversion_that_would_change_values_is_refused() -> None:
    blocks = random_stored_blocks("q5_0", 2, 1, seed=0)
    with pytest.raises(ValueError, match="do not convert exactly into q4_1"):
        convert_blocks("q5_0", blocks, "q4_1")
    with pytest.raises(ValueError, match="do not convert exactly"):
        convert_blocks("q4_k", blocks, "q8_0")
    with pytest.raises(ValueError, match="q5_0 blocks have 22 bytes"):
        convert_blocks("q5_0", blocks[..., :20], "q8_0")


def test_each_layer_takes_the_format_that_holds_all_its_rows() -> None:
    assert exact_kernel_format(["q4_0"]) == "q4_0" and exact_kernel_format(["q4_0"], BLOCK_FORMATS) == "q4_1"
    assert exact_kernel_format(["q4_0", "q4_1"]) == "q4_1"
    assert exact_kernel_format(["q5_0", "q5_0", "q8_0"]) == "q8_0"  # a Q4_K_M file's q, k and v of a 896-wide model
    assert exact_kernel_format(["q5_0"]) == "q5_0" and exact_kernel_format(["q5_0"], BLOCK_FORMATS) == "q8_0"
    assert exact_kernel_format(["q4_0", "q5_0"]) == "q8_0"
    assert exact_kernel_format(["q4_1", "q8_0"]) is None  # q4_1 (w = d q + m) is not a q8_0 block
    assert exact_kernel_format(["q5_0", "q6_k"]) is None
    assert exact_kernel_format(["f32"]) is None and exact_kernel_format([]) is None
    assert exact_kernel_format(["q4_k", "q4_k"]) == "q4_k" and exact_kernel_format(["q6_k"]) == "q6_k"
    assert exact_kernel_format(["q4_k", "q6_k"]) is None  # Q4_K_M's q and k beside a Q6_K v: float16
    assert exact_kernel_format(["q6_k"], BLOCK_FORMATS) is None  # without the K-quant kernel
    mixed = ["q5_0"] * 5 + ["q4_k"] * 9 + ["q4_1"] * 2
    assert preferred_kernel_format(mixed) == "q4_k"
    assert preferred_kernel_format(mixed, BLOCK_FORMATS) == "q8_0"
    assert preferred_kernel_format(["q5_0"] * 3 + ["q6_k"]) == "q5_0"
    assert preferred_kernel_format(["iq3_s", "f16"]) is None and preferred_kernel_format(["q3_k", "q2_k"]) == "q2_k"
    assert preferred_kernel_format(["q5_1", "q5_k"]) == "q5_k" and exact_kernel_format(["q5_1"]) == "q5_1"
    assert runnable_types({"a": "q6_k", "b": "q5_0", "c": "f32"}, BLOCK_FORMATS) == {"a": "float", "b": "q5_0",
                                                                                    "c": "float"}


def test_matrices_without_a_kernel_are_named_for_the_log() -> None:
    stored = {"a": "q3_k", "b": "q3_k", "c": "q2_k", "d": "q5_0", "e": "f32", "f": "q6_k"}
    assert float_fallbacks(stored, runnable_types(stored, BLOCK_FORMATS)) == "2 q3_k, 1 q2_k, 1 q6_k"
    everything = ("q8_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")
    assert float_fallbacks(stored, runnable_types(stored, everything)) == "1 q2_k"  # q3_k runs as q6_k
    assert float_fallbacks({"d": "q5_0", "e": "f16"}, {"d": "q5_0", "e": "float"}) is None


def random_iq4_blocks(stored_type: str, rows: int, columns: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, bytes] of valid random IQ4_NL or IQ4_XS blocks (gguf-py cannot quantize to them): random indices (and
    IQ4_XS's random 6-bit sub-block scales), float16 scales d that give weights of ~0.01-0.04."""
    raw = rng.integers(0, 256, (rows, columns // block_width(stored_type), STORED_BLOCK_BYTES[stored_type]),
                       dtype=np.uint8)
    top = 2e-4 if stored_type == "iq4_nl" else 1e-5  # IQ4_XS multiplies d by a sub-block scale of up to 32 too
    d = (rng.uniform(top / 4, top, raw.shape[:2]) * rng.choice([-1, 1], raw.shape[:2])).astype(np.float16)
    raw[..., 0:2] = d[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def test_an_iq4_file_runs_at_its_stored_size(tmp_path: Path, tiny_kquant, gguf_writer) -> None:
    """IQ4_NL's indices pick int8 values under a float16 scale: its kernel reads the file's 18-byte blocks, and where
    none runs, q8_0 blocks hold them exactly (34 bytes for 18, where float16 takes 64). IQ4_XS scales its sub-blocks
    by d x a 6-bit integer: IQ4_NL (or q8_0) blocks whose scale is that product rounded to float16, so every weight is
    the file's to within float16's rounding, as float16 weights would be."""
    directory, kquant_blocks = tiny_kquant
    rng, blocks = np.random.default_rng(7), {}
    for name, (data, qtype) in kquant_blocks.items():
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        columns = data.shape[1] // type_size * block_size
        stored = "iq4_xs" if ".ffn_" in name else "iq4_nl"  # attention matrices and the (tied) embedding: IQ4_NL
        blocks[name] = (random_iq4_blocks(stored, data.shape[0], columns, rng), Q[stored.upper()])
    path = gguf_writer(directory, tmp_path / "tiny-iq4.gguf", blocks=blocks)
    source = resolve_model(str(path))
    config = load_hf_config(source)
    stored = stored_matrix_types(source)
    assert set(stored.values()) == {"iq4_nl", "iq4_xs"}
    formats = kernel_formats()
    reference = build_model(config, 64, CPU, torch.float32)
    reference.load_weights(load_weights(source, torch.float32))  # gguf's own dequantization, in float32
    model = build_model(config, 64, CPU, torch.float32, block_method="q8_0",
                        stored_types=runnable_types(stored, formats), formats=formats)
    model.load_weights(load_weights(source, torch.float32, blocks=STORED_BLOCK_TYPES))
    assert model.quantize_float_layers("fp16") == 0
    held = "iq4_nl" if "iq4_nl" in formats else "q8_0"
    with torch.no_grad():
        for i in range(config.num_hidden_layers):
            layer, ref = model.layers[i], reference.layers[i]
            assert layer.self_attn.qkv_proj.method == held and layer.mlp.down_proj.method == held
            assert torch.equal(layer.self_attn.qkv_proj.dequantized(), ref.self_attn.qkv_proj.weight)
            assert torch.equal(layer.self_attn.o_proj.dequantized(), ref.self_attn.o_proj.weight)
            for name in ("gate_up_proj", "down_proj"):
                mlp, ref_mlp = getattr(layer.mlp, name), getattr(ref.mlp, name)
                torch.testing.assert_close(mlp.dequantized(), ref_mlp.weight, rtol=2**-11, atol=0)
                x = torch.randn(3, mlp.in_features, generator=torch.Generator().manual_seed(i))
                torch.testing.assert_close(mlp(x), ref_mlp(x), atol=2e-3, rtol=2e-3)
    if held == "iq4_nl":  # the stored size: 288 bytes a 16 x 32 block of weights, the file's 16 x 18
        assert layer.mlp.down_proj.blocks.numel() == layer.mlp.down_proj.out_features * layer.mlp.down_proj.in_features * 18 // 32
    # What the planner counts for the file where every kernel runs: 4.5 bits a matrix weight (iq4_nl), the embedding's
    # 4.5 for its lookups in the file's blocks, its (tied) output layer in iq4_nl beside them, 32 for the vectors.
    header = read_gguf_header(path)
    bits = {2: 4.5, 1: 32.0}
    expected = sum(np.prod(t.shape) * bits[len(t.shape)] for t in header.tensors) / sum(
        np.prod(t.shape) for t in header.tensors)
    assert gguf_held_bits(path) == pytest.approx(expected, rel=1e-9)
    # The tied IQ4_NL embedding: its output layer in the layers' format, its lookups in the file's 18-byte blocks.
    assert model.lm_head.method == held and isinstance(model.embed_tokens, BlockEmbedding)
    assert torch.equal(model.lm_head.dequantized()[: config.vocab_size], reference.embed_tokens.weight)
    every_token = torch.arange(config.vocab_size).view(64, -1)
    assert torch.equal(model.embed_tokens(every_token), reference.embed_tokens(every_token))


def test_iq4_xs_becomes_iq4_nl_or_q8_0_with_each_sub_blocks_scale_rounded_once() -> None:
    rng = np.random.default_rng(11)
    blocks = random_iq4_blocks("iq4_xs", 16, 1024, rng).reshape(16, 4, 136)
    blocks[0, 0, 2:8] = [0xFF, 0xFF, 0x11, 0x11, 0x11, 0x11]  # every sub-block scale 49 - 32 = 17: d x 17 rounds
    blocks[1, 0, 2:8] = [0xAA, 0xAA, 0x22, 0x22, 0x22, 0x22]  # 34 - 32 = 2: a power of two, exact in float16
    converted = convert_blocks("iq4_xs", blocks, "q8_0")
    assert converted.shape == (16, 32, 34) and converted.dtype == np.uint8
    expected = gguf_values("iq4_xs", blocks)
    got = gguf_values("q8_0", converted)
    np.testing.assert_allclose(got, expected, rtol=2**-11, atol=0)
    assert np.array_equal(got[1, :256], expected[1, :256]) and not np.array_equal(got, expected)
    layer = LAYER_TYPES["q8_0"](StoredBlocks("iq4_xs", torch.from_numpy(blocks)), None)
    assert torch.equal(layer.dequantized(), torch.from_numpy(got))
    as_iq4_nl = convert_blocks("iq4_xs", blocks, "iq4_nl")  # the same scales, the file's indices as they lie
    assert as_iq4_nl.shape == (16, 32, 18) and np.array_equal(gguf_values("iq4_nl", as_iq4_nl), got)
    if "iq4_nl" in kernel_formats():
        layer = LAYER_TYPES["iq4_nl"](StoredBlocks("iq4_xs", torch.from_numpy(blocks)), None)
        assert torch.equal(layer.dequantized(), torch.from_numpy(got))


def test_a_tensor_ranks_share_of_iq4_xs_columns_that_splits_a_super_block_is_its_iq4_nl_blocks() -> None:
    """A row-parallel IQ4_XS matrix (down_proj) over 4 ranks: 512 columns are 2 super-blocks, 128 a rank. Each rank
    keeps its iq4_nl blocks (what its layer holds anyway), not float weights quantized again."""
    from lmserve.worker.weights.shards import column_shard

    blocks = random_iq4_blocks("iq4_xs", 8, 512, np.random.default_rng(5)).reshape(8, 2, 136)
    whole = gguf_values("q8_0", convert_blocks("iq4_xs", blocks, "q8_0")).reshape(8, 512)
    stored = StoredBlocks("iq4_xs", torch.from_numpy(blocks))
    assert column_shard(stored, 2, 1).method == "iq4_xs"  # whole super-blocks a rank: the file's blocks
    for rank in range(4):
        share = column_shard(stored, 4, rank)
        assert isinstance(share, StoredBlocks) and share.method == "iq4_nl" and share.shape == (8, 128)
        assert np.array_equal(share.dequantize().numpy(), whole[:, 128 * rank : 128 * (rank + 1)])


def test_a_files_q3_k_matrices_run_as_q3_k_layers(tmp_path: Path, tiny_kquant, gguf_writer) -> None:
    """What a Q3_K file of a model 256-wide blocks wide holds in its down projections and (tied) embedding: each
    matrix loads into a q3_k layer with the file's values (where the K-quant kernel runs; float16 weights elsewhere),
    the embedding looks its rows up in the file's Q3_K blocks, and the planner counts the file's 3.4375 bits a weight
    for the layers."""
    directory, kquant_blocks = tiny_kquant
    blocks = dict(kquant_blocks)
    for name, (data, qtype) in kquant_blocks.items():
        if ".ffn_down." in name or name == "token_embd.weight":
            columns = data.shape[1] // gguf.GGML_QUANT_SIZES[qtype][1] * gguf.GGML_QUANT_SIZES[qtype][0]
            raw = random_stored_blocks("q3_k", data.shape[0], columns // 256, seed=len(blocks) + data.shape[0])
            blocks[name] = (raw.reshape(data.shape[0], -1), Q.Q3_K)
    path = gguf_writer(directory, tmp_path / "tiny-q3-k.gguf", blocks=blocks)
    source = resolve_model(str(path))
    config, stored = load_hf_config(source), stored_matrix_types(source)
    assert stored["model.layers.0.mlp.down_proj.weight"] == "q3_k" and stored["model.embed_tokens.weight"] == "q3_k"
    formats = kernel_formats()
    reference = build_model(config, 64, CPU, torch.float32)
    reference.load_weights(load_weights(source, torch.float32))
    model = build_model(config, 64, CPU, torch.float32, block_method="q8_0",
                        stored_types=runnable_types(stored, formats), formats=formats)
    model.load_weights(load_weights(source, torch.float32, blocks=STORED_BLOCK_TYPES))
    model.quantize_float_layers("fp16")
    for i in range(config.num_hidden_layers):
        down, ref = model.layers[i].mlp.down_proj, reference.layers[i].mlp.down_proj
        if "q3_k" in formats:
            assert down.method == "q3_k" and torch.equal(down.dequantized(), ref.weight)
        else:
            assert isinstance(down, Float16WeightLinear)
    every_token = torch.arange(config.vocab_size).view(64, -1)
    assert torch.equal(model.embed_tokens(every_token), reference.embed_tokens(every_token))
    if "q3_k" in formats:  # the lookups in the file's blocks, the tied output layer's values in q3_k blocks
        assert isinstance(model.embed_tokens, BlockEmbedding) and model.embed_tokens.stored_type == "q3_k"
        assert model.lm_head.method == "q3_k"
        assert torch.equal(model.lm_head.dequantized()[: config.vocab_size], reference.embed_tokens.weight)
    # Against the same file with its own types: each q3_k matrix counted at its 3.4375 bits instead; the embedding at
    # its 3.4375, the tied output layer in the same format (as the plain file's Q6_K one).
    header, plain = read_gguf_header(path), gguf_writer(directory, tmp_path / "tiny-plain.gguf", blocks=kquant_blocks)
    total = sum(np.prod(t.shape) for t in header.tensors)
    change = sum(np.prod(t.shape) * (3.4375 - 8 * held_bytes_per_weight(kquant_blocks[t.name][1].name.lower()))
                 for t in header.tensors if ".ffn_down." in t.name)
    embedding = next(np.prod(t.shape) for t in header.tensors if t.name == "token_embd.weight")
    assert kquant_blocks["token_embd.weight"][1] == Q.Q6_K
    change += embedding * (8 * 110 / 256 - 8 * 210 / 256)
    assert change != 0 and gguf_held_bits(path) * total == pytest.approx(gguf_held_bits(plain) * total + change)


def test_a_type_lmserve_does_not_read_is_refused_by_name(tmp_path: Path, tiny_kquant, gguf_writer) -> None:
    directory, kquant_blocks = tiny_kquant
    name, (data, qtype) = next((n, b) for n, b in sorted(kquant_blocks.items()) if ".ffn_down." in n)
    columns = data.shape[1] // gguf.GGML_QUANT_SIZES[qtype][1] * gguf.GGML_QUANT_SIZES[qtype][0]
    block_size, type_size = gguf.GGML_QUANT_SIZES[Q.IQ3_S]
    raw = np.zeros((data.shape[0], columns // block_size * type_size), dtype=np.uint8)
    path = gguf_writer(directory, tmp_path / "iq3-s.gguf", blocks={**kquant_blocks, name: (raw, Q.IQ3_S)})
    with pytest.raises(ValueError, match=r"holds tensors of GGUF type IQ3_S; lmserve dequantizes .*IQ4_NL, IQ4_XS"):
        list(load_weights(resolve_model(str(path)), torch.float32, blocks=STORED_BLOCK_TYPES))


def test_an_iq4_xs_embedding_looks_its_rows_up_in_the_files_blocks() -> None:
    """A type no kernel format holds still comes as blocks: an embedding keeps them (136 bytes a 256 weights) and
    gives gguf's values for each row it looks up."""
    vocab, hidden = 40, 512
    raw = random_iq4_blocks("iq4_xs", vocab, hidden, np.random.default_rng(3))
    embedding = BlockEmbedding(vocab, hidden, ParallelGroups(RankLayout(0)), "iq4_xs")
    embedding.load_rows(0, StoredBlocks("iq4_xs", torch.from_numpy(raw.reshape(vocab, hidden // 256, 136))))
    ids = torch.tensor([[3, 0, 39], [7, 7, 12]])
    expected = gguf_values("iq4_xs", raw.reshape(vocab, -1))[ids.reshape(-1)].reshape(2, 3, hidden)
    assert torch.equal(embedding(ids), torch.from_numpy(expected))


# ------------------------------------------------------------------ a Q4_K_M-like file of a model 896 wide, in small

def test_each_layer_of_a_mixed_file_holds_the_files_values(mixed_gguf: Path) -> None:
    """conftest.mixed_gguf: Q5_0, Q8_0 and Q4_0 layers in the kernel formats that hold them, Q6_K ones in float16."""
    source = resolve_model(str(mixed_gguf))
    config = load_hf_config(source)
    stored = stored_matrix_types(source)
    assert stored["model.layers.0.self_attn.v_proj.weight"] == "q8_0"
    assert stored["model.layers.1.mlp.down_proj.weight"] == "q6_k"
    formats = kernel_formats()
    assert preferred_kernel_format(stored.values(), formats) == ("q5_0" if "q5_0" in formats else "q8_0")
    reference = build_model(config, 64, CPU, torch.float32)
    reference.load_weights(load_weights(source, torch.float32))
    model = build_model(config, 64, CPU, torch.float32, block_method="q8_0",
                        stored_types=runnable_types(stored, formats), formats=formats)
    model.load_weights(load_weights(source, torch.float32, blocks=STORED_BLOCK_TYPES))
    # The down projections: at their stored size where the K-quant kernel runs (AVX-512 VNNI or AVX2), else float16.
    down_type = KQuantLinear if "q6_k" in formats else Float16WeightLinear
    assert model.quantize_float_layers("fp16") == (0 if down_type is KQuantLinear else 2)
    # The Q4_0 output projections: at their stored size where the int16 kernels run, else as q4_1 blocks.
    o_type = Int16BlockLinear if "q4_0" in formats else Q4_1Linear
    expected_types = {"self_attn.qkv_proj": Q8_0Linear, "self_attn.o_proj": o_type,
                      "mlp.gate_up_proj": Q8_0Linear, "mlp.down_proj": down_type}
    for i in range(config.num_hidden_layers):
        for name, layer_type in expected_types.items():
            layer = model.layers[i].get_submodule(name)
            assert type(layer) is layer_type or type(layer).__bases__ == (layer_type,), (i, name)
            if layer_type is not Float16WeightLinear:  # the file's values, bit for bit
                assert torch.equal(layer.dequantized(), reference.layers[i].get_submodule(name).weight), (i, name)
    # The tied Q5_0 embedding's own values, as q5_0 where its kernel runs, else as q8_0 blocks.
    assert isinstance(model.lm_head, Int16BlockLinear if "q5_0" in formats else Q8_0Linear)
    assert torch.equal(model.lm_head.dequantized()[: config.vocab_size], reference.embed_tokens.weight)
    # The embedding looks its rows up in the file's Q5_0 blocks: the float table's values, at 22 of its 128 bytes.
    assert isinstance(model.embed_tokens, BlockEmbedding) and model.embed_tokens.stored_type == "q5_0"
    every_token = torch.arange(config.vocab_size).view(64, -1)
    assert torch.equal(model.embed_tokens(every_token), reference.embed_tokens(every_token))
    assert model.embed_tokens.blocks.numel() * 32 == reference.embed_tokens.weight.numel() * 22
    # Each block layer computes with those values: its output is the float32 layer's to within float32 sums.
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for i in range(config.num_hidden_layers):
            for name, layer_type in expected_types.items():
                layer, ref = model.layers[i].get_submodule(name), reference.layers[i].get_submodule(name)
                x = torch.randn(5, layer.in_features, generator=gen)
                # float16 weights: their rounding; int16 activations (the K-quant kernel): theirs, 1/512 of a block
                tolerance = 1e-4 if layer_type in (Q8_0Linear, Q4_1Linear) else 2e-3
                torch.testing.assert_close(layer(x), ref(x), atol=tolerance, rtol=tolerance)


@pytest.mark.skipif(not int16_kernel_loads(), reason="the int16 kernels did not build (q5_0 is q8_0 there)")
@pytest.mark.parametrize("stored_type", ["q4_0", "q5_0", "q5_1", "iq4_nl", "mxfp4"])
def test_int16_kernel_blocks_run_at_their_stored_size_with_the_files_values(stored_type: str) -> None:
    blocks = random_stored_blocks(stored_type, 48, 12, seed=11)
    values = torch.from_numpy(gguf_values(stored_type, blocks))
    layer = LAYER_TYPES[stored_type](StoredBlocks(stored_type, torch.from_numpy(blocks)), None)
    assert isinstance(layer, Int16BlockLinear)
    # 22 (q5_1: 24, q4_0 and iq4_nl: 18) bytes a block of 32: the file's; mxfp4's 17 as 18 (its scale a float16 d)
    assert layer.blocks.numel() == blocks.size * (18 / 17 if stored_type == "mxfp4" else 1)
    assert torch.equal(layer.dequantized(), values)
    x = torch.randn(9, 384, generator=torch.Generator().manual_seed(12))
    x[2, :32] *= 50
    expected = x.double() @ values.double().T
    got = layer(x)
    assert (got.double() - expected).abs().max().item() < 2e-3 * expected.abs().max().item()
    for i in range(9):  # each row's bits its own
        assert torch.equal(layer(x[i : i + 1]), got[i : i + 1]), i
    assert stored_type in kernel_formats() and exact_kernel_format([stored_type], kernel_formats()) == stored_type


@pytest.mark.parametrize("activations", ["float32", "int16"])
def test_q8_0_rows_read_back_out_of_either_kernel_layout(activations: str) -> None:
    """The panels of 8 rows (float activations) and the int16 kernel's groups of 16 give back the file's blocks of any
    row, bit for bit: what lets a tied embedding look its rows up in the output layer."""
    if activations == "int16" and not int16_kernel_loads():
        pytest.skip("the int16 kernels did not build")
    blocks = random_stored_blocks("q8_0", 48, 3, seed=5)
    layer = Q8_0Linear(StoredBlocks("q8_0", torch.from_numpy(blocks.copy())), None, activations=activations)
    assert layer.activations == activations
    rows = np.array([0, 7, 8, 15, 16, 31, 47, 3])
    assert np.array_equal(layer.stored_rows(rows), blocks[rows])


def test_a_tied_q8_0_embedding_is_held_once_and_looks_up_the_files_rows(default_source) -> None:
    """The default model ties its Q8_0 embedding to the output layer: the embedding drops its copy and reads its rows
    out of the output layer's kernel layout, which gives exactly the file's values for every token."""
    from lmserve.formats.gguf_file import read_gguf_header, read_gguf_tensor

    config = load_hf_config(default_source)
    formats = kernel_formats()
    stored = stored_matrix_types(default_source)
    model = build_model(config, 64, CPU, torch.float32, block_method="q4_1",
                        stored_types=runnable_types(stored, formats), formats=formats)
    model.load_weights(load_weights(default_source, torch.float32, blocks=STORED_BLOCK_TYPES))
    embedding = model.embed_tokens
    assert isinstance(embedding, BlockEmbedding) and embedding.rows_source is model.lm_head
    assert embedding.blocks.numel() == 0
    info = next(t for t in read_gguf_header(default_source.path).tensors if t.name == "token_embd.weight")
    expected = torch.from_numpy(read_gguf_tensor(default_source.path, info))
    every_token = torch.arange(config.vocab_size).view(96, -1)
    assert torch.equal(embedding(every_token).view(config.vocab_size, -1), expected)


def mapped_file_of(address: int) -> str | None:
    """The file mapped at `address` in this process, from /proc/self/maps (None: anonymous memory)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if start <= address < end:
            return fields[5].strip() if len(fields) == 6 and fields[5].startswith("/") else None
    return None


def resident_bytes_of(path: Path) -> int:
    """This process's resident bytes of its mappings of the file (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's first line: its range, ..., its file
            inside = fields[-1] == str(path)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


@pytest.mark.skipif(sys.platform != "linux", reason="the pages are given back with Linux's madvise")
@pytest.mark.skipif(not int16_kernel_loads(), reason="no K-quant kernel runs here: the table is held as floats")
def test_a_tied_table_in_another_layout_gives_its_pages_back_to_the_file(tiny_q4_k_m_gguf: Path) -> None:
    """A Q4_K_M file's tied Q6_K embedding: the output layer packs every row of it into the K-quant kernel's layout,
    which the embedding does not read rows back from, so the table stays the file's mapping. The packing's read
    left all of it resident (183 MB of a 1.5B Qwen file); after loading, its pages are the file's again, and every
    token still looks up the file's values."""
    from lmserve.formats.gguf_file import read_gguf_tensor

    source = resolve_model(str(tiny_q4_k_m_gguf))
    config, formats = load_hf_config(source), kernel_formats()
    model = build_model(config, 64, CPU, torch.float32, block_method="q4_1",
                        stored_types=runnable_types(stored_matrix_types(source), formats), formats=formats)
    model.load_weights(load_weights(source, torch.float32, blocks=STORED_BLOCK_TYPES))
    embedding, path = model.embed_tokens, tiny_q4_k_m_gguf.resolve()
    assert isinstance(embedding, BlockEmbedding) and embedding.stored_type == "q6_k"
    assert embedding.rows_source is None and isinstance(model.lm_head, KQuantLinear)
    assert mapped_file_of(embedding.blocks.data_ptr()) == str(path)
    table_bytes = embedding.blocks.numel()
    assert resident_bytes_of(path) < table_bytes / 8, "the table's pages stayed resident after the packing read them"
    info = next(t for t in read_gguf_header(path).tensors if t.name == "token_embd.weight")
    expected = torch.from_numpy(read_gguf_tensor(path, info))
    every_token = torch.arange(config.vocab_size).view(-1, 64)
    assert torch.equal(embedding(every_token).view(config.vocab_size, -1), expected)
    assert resident_bytes_of(path) > table_bytes / 2  # looked up: read from the file again


def test_a_whole_untied_embedding_table_stays_the_files_mapping(tmp_path: Path) -> None:
    """Like llama.cpp, the embedding of an untied model (Qwen2.5's 89 MB Q5_0 table) is looked up in the file's own
    pages: only the rows of tokens seen become resident. A table given in parts is copied, row for row."""
    from lmserve.distributed.layout import RankLayout
    from lmserve.distributed.parallel_state import ParallelGroups

    blocks = random_stored_blocks("q5_0", 64, 4, seed=21)
    path = tmp_path / "table.bin"
    blocks.tofile(path)
    mapped = np.memmap(path, mode="c", dtype=np.uint8, shape=blocks.shape)  # as gguf_file.read_gguf_blocks maps it
    expected = torch.from_numpy(gguf_values("q5_0", blocks)).view(64, -1)
    ids = torch.tensor([[3, 63, 0], [17, 17, 40]])

    whole = BlockEmbedding(64, 128, ParallelGroups(RankLayout(0)), "q5_0")
    whole.load_rows(0, StoredBlocks("q5_0", torch.from_numpy(mapped)))
    assert mapped_file_of(whole.blocks.data_ptr()) == str(path.resolve())
    assert torch.equal(whole(ids), expected[ids])

    parts = BlockEmbedding(64, 128, ParallelGroups(RankLayout(0)), "q5_0")
    parts.load_rows(0, StoredBlocks("q5_0", torch.from_numpy(mapped[:40])))
    parts.load_rows(40, StoredBlocks("q5_0", torch.from_numpy(mapped[40:])))
    assert mapped_file_of(parts.blocks.data_ptr()) is None
    assert torch.equal(parts(ids), expected[ids])


# ------------------------------------------- prompt rows with 8-bit activations (--batched-weights prompt-int8)

INT16_LAYOUT_TYPES = ["q4_1", "q8_0", "q4_0", "q5_0", "q5_1", "iq4_nl", "mxfp4", "q4_k", "q5_k", "q6_k"]


def int16_layout_layer(stored_type: str, make_k_quant, rows: int, cols: int, seed: int, path=None):
    """A layer of the stored type in the int16 kernels' layout, and gguf's float32 values of its weights."""
    if stored_type in ("q4_k", "q5_k", "q6_k"):
        raw = make_k_quant(rows, cols, Q[stored_type.upper()], np.random.default_rng(seed))
        blocks, values = raw.reshape(rows, cols // 256, -1), gguf.quants.dequantize(raw, Q[stored_type.upper()])
    else:
        blocks = random_stored_blocks(stored_type, rows, cols // 32, seed)
        values = gguf_values(stored_type, blocks)
    layer = LAYER_TYPES[stored_type](StoredBlocks(stored_type, torch.from_numpy(blocks)), None, path,
                                     activations="int16")
    assert layer.activations == "int16" and torch.equal(layer.dequantized(), torch.from_numpy(values))
    return layer, torch.from_numpy(values).double()


@pytest.mark.skipif(not int16_kernel_loads(), reason="the int16 kernels did not build")
@pytest.mark.parametrize("stored_type", INT16_LAYOUT_TYPES)
def test_8_bit_activations_round_each_block_to_8_bits_and_keep_rows_apart(stored_type: str, make_k_quant) -> None:
    """The int8 op multiplies the same blocks by x rounded to 8 bits a block of 32 (s = max|x| / 127, round(x / s);
    the K-quants' default rounds a block of 256, llama.cpp's q8_K, which test_kquant_formats.py holds to its own
    reference, so this grid check runs them with one scale per 32): on inputs already on that grid it gives the
    int16 op's bits; elsewhere an error of the 8-bit rounding, more than the 16-bit one's; and every row its own bits
    whatever rows share the call (tiles of 1 to 8 rows)."""
    layer, values = int16_layout_layer(stored_type, make_k_quant, 48, 512, seed=21)
    gen = torch.Generator().manual_seed(22)
    # On the grid: per block integers in -127..127 reaching 127, times a power of two per block.
    ints = torch.randint(-127, 128, (13, 16, 32), generator=gen).float()
    ints[..., 0] = 127
    on_grid = (ints * 2.0 ** torch.randint(-8, 4, (13, 16, 1), generator=gen).float()).reshape(13, 512)
    ops = cpu_kernels()
    per_256 = ops.set_kquant_super_scale(False)
    try:
        int8 = layer.int8_linear_op(on_grid, layer.blocks, 48, None)
    finally:
        ops.set_kquant_super_scale(per_256)
    assert torch.equal(int8, layer.linear_op(on_grid, layer.blocks, 48, None))
    x = torch.randn(13, 512, generator=gen)
    x[3, :64] *= 40  # an outlier block
    expected = x.double() @ values.T
    int8, int16 = layer.int8_linear_op(x, layer.blocks, 48, None), layer.linear_op(x, layer.blocks, 48, None)
    error8, error16 = (int8.double() - expected).abs().max().item(), (int16.double() - expected).abs().max().item()
    assert error8 < 2e-2 * expected.abs().max().item()
    assert error8 > 10 * error16  # 8 bits indeed, not the 16-bit split
    for i in range(13):
        assert torch.equal(layer.int8_linear_op(x[i : i + 1], layer.blocks, 48, None), int8[i : i + 1]), i
    assert torch.equal(layer.int8_linear_op(x[2:11], layer.blocks, 48, None), int8[2:11])


@pytest.mark.skipif(not int16_kernel_loads(), reason="the int16 kernels did not build")
@pytest.mark.parametrize("stored_type", ["q8_0", "q5_0", "q4_k", "q6_k"])
def test_prompt_int8_sends_prompt_rows_to_8_bits_and_generated_rows_to_16_without_a_copy(
    stored_type: str, make_k_quant
) -> None:
    path = batched_path("prompt-int8")
    layer, _ = int16_layout_layer(stored_type, make_k_quant, 32, 256, seed=23, path=path)
    model = nn.Sequential(layer)
    assert use_prompt_copies(model) == 1
    prepare_batched_copies(model)
    x = torch.randn(70, 256, generator=torch.Generator().manual_seed(24))
    int8, int16 = layer.int8_linear_op(x, layer.blocks, 32, None), layer.linear_op(x, layer.blocks, 32, None)
    for mask in (np.arange(70) >= 5, np.arange(70) % 4 == 0, np.ones(70, dtype=bool)):
        with prompt_rows(PromptRows.from_mask(mask)):
            got = layer(x)
        assert torch.equal(got[mask], int8[mask]) and torch.equal(got[~mask], int16[~mask])
    assert torch.equal(layer(x), int16)  # rows of a caller that said nothing: generated rows
    assert layer.prompt_copy is None and layer.batched is None  # nothing but the file's blocks


def test_prompt_int8_is_refused_where_the_int16_kernels_do_not_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel_choice, "int16_kernel_loads", lambda: False)
    with pytest.raises(ValueError, match="prompt-int8 needs the int16 block kernels"):
        kernel_choice.batched_path("prompt-int8")
    monkeypatch.setattr(kernel_choice, "int16_kernel_loads", lambda: True)
    path = kernel_choice.batched_path("prompt-int8")
    assert path == kernel_choice.BatchedPath("none", sys.maxsize, prompt_copies=True, prompt_weights="int8")
