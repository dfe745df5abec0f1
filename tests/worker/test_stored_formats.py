"""A GGUF's stored block types in the kernels' formats: the conversions keep every value (against gguf's own
dequantization), each layer of a mixed file takes the format that holds all of its rows, and a model built from
such a file gives the outputs of its float32 weights."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from lmserve.models import load_hf_config, resolve_model
from lmserve.worker.block_embedding import BlockEmbedding
from lmserve.worker.kquant_formats import KQuantLinear, Q5_0Linear, kernel_formats
from lmserve.worker.loader import load_weights, stored_matrix_types
from lmserve.worker.model_builder import build_model
from lmserve.worker.quantization import (
    LAYER_TYPES,
    Float16WeightLinear,
    Q4_1Linear,
    Q8_0Linear,
    StoredBlocks,
    as_blocks,
    int16_kernel_loads,
)
from lmserve.worker.stored_formats import (
    BLOCK_FORMATS,
    STORED_BLOCK_BYTES,
    STORED_BLOCK_TYPES,
    convert_blocks,
    exact_kernel_format,
    float_fallbacks,
    preferred_kernel_format,
    runnable_types,
)

Q = gguf.GGMLQuantizationType
CPU = torch.device("cpu")


def random_stored_blocks(stored_type: str, rows: int, blocks: int, seed: int) -> np.ndarray:
    """Valid random blocks: random code bytes, float16 scales of a realistic size and sign (negative ones too)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, blocks, STORED_BLOCK_BYTES[stored_type]), dtype=np.uint8)
    scales = (rng.uniform(1e-4, 3e-2, (rows, blocks)) * rng.choice([-1, 1], (rows, blocks))).astype(np.float16)
    raw[..., 0:2] = scales[..., None].view(np.uint8)
    if stored_type in ("q4_1", "q5_1"):  # the minimum m
        raw[..., 2:4] = (-8 * np.abs(scales))[..., None].astype(np.float16).view(np.uint8)
    return raw


def gguf_values(stored_type: str, blocks: np.ndarray) -> np.ndarray:
    return gguf.quants.dequantize(blocks.reshape(blocks.shape[0], -1), Q[stored_type.upper()])


@pytest.mark.parametrize(("stored_type", "kernel_format"), [("q5_0", "q8_0"), ("q4_0", "q8_0"), ("q4_0", "q4_1")])
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


def test_a_conversion_that_would_change_values_is_refused() -> None:
    blocks = random_stored_blocks("q5_0", 2, 1, seed=0)
    with pytest.raises(ValueError, match="do not convert exactly into q4_1"):
        convert_blocks("q5_0", blocks, "q4_1")
    with pytest.raises(ValueError, match="do not convert exactly"):
        convert_blocks("q4_k", blocks, "q8_0")
    with pytest.raises(ValueError, match="q5_0 blocks have 22 bytes"):
        convert_blocks("q5_0", blocks[..., :20], "q8_0")


def test_each_layer_takes_the_format_that_holds_all_its_rows() -> None:
    assert exact_kernel_format(["q4_0"]) == "q4_1"
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
    assert preferred_kernel_format(["q3_k", "q2_k", "f16"]) is None
    assert preferred_kernel_format(["q5_1", "q5_k"]) == "q5_k" and exact_kernel_format(["q5_1"]) == "q5_1"
    assert runnable_types({"a": "q6_k", "b": "q5_0", "c": "f32"}, BLOCK_FORMATS) == {"a": "float", "b": "q5_0",
                                                                                    "c": "float"}


def test_matrices_without_a_kernel_are_named_for_the_log() -> None:
    stored = {"a": "q3_k", "b": "q3_k", "c": "q2_k", "d": "q5_0", "e": "f32", "f": "q6_k"}
    assert float_fallbacks(stored, runnable_types(stored, BLOCK_FORMATS)) == "2 q3_k, 1 q2_k, 1 q6_k"
    everything = ("q8_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")
    assert float_fallbacks(stored, runnable_types(stored, everything)) == "2 q3_k, 1 q2_k"
    assert float_fallbacks({"d": "q5_0", "e": "f16"}, {"d": "q5_0", "e": "float"}) is None


# ------------------------------------------------------------------ a Q4_K_M-like file of a model 896 wide, in small

def test_each_layer_of_a_mixed_file_holds_the_files_values(mixed_gguf: Path) -> None:
    """conftest.mixed_gguf: Q5_0, Q8_0 and Q4_0 layers in two kernel formats, Q6_K ones in float16."""
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
    expected_types = {"self_attn.qkv_proj": Q8_0Linear, "self_attn.o_proj": Q4_1Linear,
                      "mlp.gate_up_proj": Q8_0Linear, "mlp.down_proj": down_type}
    for i in range(config.num_hidden_layers):
        for name, layer_type in expected_types.items():
            layer = model.layers[i].get_submodule(name)
            assert type(layer) is layer_type, (i, name)
            if layer_type is not Float16WeightLinear:  # the file's values, bit for bit
                assert torch.equal(layer.dequantized(), reference.layers[i].get_submodule(name).weight), (i, name)
    # The tied Q5_0 embedding's own values, as q5_0 where its kernel runs, else as q8_0 blocks.
    assert isinstance(model.lm_head, Q5_0Linear if "q5_0" in formats else Q8_0Linear)
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
@pytest.mark.parametrize("stored_type", ["q5_0", "q5_1"])
def test_five_bit_blocks_run_at_their_stored_size_with_the_files_values(stored_type: str) -> None:
    blocks = random_stored_blocks(stored_type, 48, 12, seed=11)
    values = torch.from_numpy(gguf_values(stored_type, blocks))
    layer = LAYER_TYPES[stored_type](StoredBlocks(stored_type, torch.from_numpy(blocks)), None)
    assert isinstance(layer, Q5_0Linear)
    assert layer.blocks.numel() == blocks.size  # 22 (q5_1: 24) bytes a block of 32: the file's size
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
    from lmserve.models import read_gguf_header, read_gguf_tensor

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


def test_a_whole_untied_embedding_table_stays_the_files_mapping(tmp_path: Path) -> None:
    """Like llama.cpp, the embedding of an untied model (Qwen2.5's 89 MB Q5_0 table) is looked up in the file's own
    pages: only the rows of tokens seen become resident. A table given in parts is copied, row for row."""
    from lmserve.distributed.parallel_state import ParallelGroups, RankLayout

    blocks = random_stored_blocks("q5_0", 64, 4, seed=21)
    path = tmp_path / "table.bin"
    blocks.tofile(path)
    mapped = np.memmap(path, mode="c", dtype=np.uint8, shape=blocks.shape)  # as models.read_gguf_blocks maps it
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
