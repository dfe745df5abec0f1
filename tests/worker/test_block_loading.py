"""A GGUF's q4_1 and q8_0 blocks go straight into the block layers' panels (a rearrangement of the file's bytes), with
no float32 copy of those weights: the packed bytes are exactly what dequantizing to float and packing that gives (the
path before, whose packer is kept below as the reference), on one rank and on each tensor-parallel rank."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lmserve.distributed.layout import RankLayout
from lmserve.distributed.parallel_state import ParallelGroups
from lmserve.models import DEFAULT_MODEL, load_hf_config, resolve_model
from lmserve.worker.model_builder import build_model
from lmserve.worker.weights.block_linear import BlockQuantizedLinear, Q4_1Linear, Q8_0Linear
from lmserve.worker.weights.block_packing import StoredBlocks, pack_q4_1, pack_q8_0, quantize_blocks
from lmserve.worker.weights.kernel_choice import BLOCK_METHODS
from lmserve.worker.weights.loader import load_weights
from lmserve.worker.weights.pending import PendingBlockLinear

CPU = torch.device("cpu")


# ------------------------------------------------------------------------------ the packer before (commit ae89b68)


def _old_blocks(weight: torch.Tensor) -> torch.Tensor:
    out_features, in_features = weight.shape
    return weight.detach().float().reshape(out_features, in_features // 32, 32)


def _old_panels(values: torch.Tensor) -> torch.Tensor:
    rows = values.shape[0]
    padded = -(-rows // 8) * 8
    if padded != rows:
        values = torch.cat([values, values.new_zeros(padded - rows, *values.shape[1:])])
    return values.reshape(padded // 8, 8, *values.shape[1:]).transpose(1, 2)


def _old_bytes(values: torch.Tensor) -> torch.Tensor:
    return values.contiguous().view(torch.uint8).reshape(*values.shape[:2], -1)


def _old_packed(panels: list[torch.Tensor]) -> torch.Tensor:
    packed = torch.cat(panels, -1)
    return packed.reshape(packed.shape[0] * 8, -1)


def _old_reciprocal(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))


def reference_pack_q4_1(weight: torch.Tensor) -> torch.Tensor:
    blocks = _old_blocks(weight)
    low, high = blocks.amin(-1), blocks.amax(-1)
    scale, minimum = ((high - low) / 15).half(), low.half()
    q = ((blocks - minimum.float()[..., None]) * _old_reciprocal(scale.float())[..., None]).round().clamp(0, 15)
    q = q.to(torch.uint8)
    nibbles = q[..., :16] | (q[..., 16:] << 4)
    return _old_packed([_old_bytes(_old_panels(scale)), _old_bytes(_old_panels(minimum)),
                        _old_bytes(_old_panels(nibbles).transpose(2, 3))]).contiguous()


def reference_pack_q8_0(weight: torch.Tensor) -> torch.Tensor:
    blocks = _old_blocks(weight)
    scale = (blocks.abs().amax(-1) / 127).half()
    q = (blocks * _old_reciprocal(scale.float())[..., None]).round().clamp(-128, 127).to(torch.int8)
    return _old_packed([_old_bytes(_old_panels(scale)), _old_bytes(_old_panels(q).transpose(2, 3))]).contiguous()


REFERENCE = {"q4_1": reference_pack_q4_1, "q8_0": reference_pack_q8_0}


@pytest.mark.parametrize("rows", [1, 8, 45, 200])
def test_packing_floats_gives_the_old_packers_bytes(rows: int) -> None:
    weight = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)) * 0.05
    weight[0, :32] = 0.25  # a constant block: scale 0
    assert torch.equal(pack_q4_1(weight), reference_pack_q4_1(weight))
    assert torch.equal(pack_q8_0(weight), reference_pack_q8_0(weight))


# ------------------------------------------------------------------------------------------- the default model


def block_layers(model: nn.Module) -> dict[str, BlockQuantizedLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, BlockQuantizedLinear)}


@pytest.fixture(scope="module")
def default_float_model() -> nn.Module:
    """The default model loaded the way every block layer was built before: dequantized to float32."""
    source = resolve_model(DEFAULT_MODEL)
    model = build_model(load_hf_config(source), 64, CPU, torch.float32)
    model.load_weights(load_weights(source, torch.float32))
    return model


def test_the_loader_hands_over_the_files_blocks_not_floats() -> None:
    source = resolve_model(DEFAULT_MODEL)
    weights = dict(load_weights(source, torch.float32, blocks=BLOCK_METHODS))
    layer = weights["model.layers.3.mlp.down_proj.weight"]
    assert isinstance(layer, StoredBlocks) and layer.method == "q4_1"
    assert layer.data.dtype == torch.uint8 and layer.data.shape == (576, 1536 // 32, 20) and layer.shape == (576, 1536)
    embedding = weights["model.embed_tokens.weight"]
    assert isinstance(embedding, StoredBlocks) and embedding.method == "q8_0"
    assert isinstance(weights["model.norm.weight"], torch.Tensor)  # F32 in the file


def test_the_default_models_blocks_go_straight_into_the_panels_bit_for_bit(default_float_model) -> None:
    source = resolve_model(DEFAULT_MODEL)
    model = build_model(load_hf_config(source), 64, CPU, torch.float32, block_method="q4_1")
    assert isinstance(model.layers[0].mlp.down_proj, PendingBlockLinear)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())  # no float32 matrices to fill
    model.load_weights(load_weights(source, torch.float32, blocks=BLOCK_METHODS))
    assert not any(isinstance(m, PendingBlockLinear) for m in model.modules())
    layers = block_layers(model)
    assert len(layers) == 30 * 4 + 1
    for name, layer in layers.items():
        if name == "lm_head":
            # The tied output layer: the file's q8_0 embedding, as the old path re-packed the dequantized table.
            assert isinstance(layer, Q8_0Linear)
            assert torch.equal(layer.blocks, reference_pack_q8_0(default_float_model.embed_tokens.weight))
        else:
            assert isinstance(layer, Q4_1Linear), name
            weight = default_float_model.get_submodule(name).weight
            assert torch.equal(layer.blocks, reference_pack_q4_1(weight)), name
    # The float tables (the embedding, dequantized in torch now) are the reader's values too.
    for name, param in model.named_parameters():
        assert torch.equal(param, default_float_model.get_parameter(name)), name


def test_the_default_model_splits_its_blocks_across_three_tensor_ranks(default_float_model) -> None:
    """Column-parallel q/k/v and gate/up by rows, row-parallel o_proj (576 = 3 x 6 blocks) and down_proj
    (1536 = 3 x 16 blocks) at block boundaries, the output layer by vocabulary rows: each rank's bytes are the old
    packer's of that rank's float shard."""
    source = resolve_model(DEFAULT_MODEL)
    config = load_hf_config(source)
    full = default_float_model
    for rank in range(3):
        parallel = ParallelGroups(RankLayout(rank, tp_size=3))
        model = build_model(config, 64, CPU, torch.float32, parallel, block_method="q4_1")
        model.load_weights(load_weights(source, torch.float32, blocks=BLOCK_METHODS))
        for i in (0, 29):
            attn, mlp = full.layers[i].self_attn, full.layers[i].mlp
            q, k, v = attn.qkv_proj.weight.split([attn.q_size, attn.kv_size, attn.kv_size])
            gate, up = mlp.gate_up_proj.weight.chunk(2)
            expected = {
                "self_attn.qkv_proj": torch.cat([t.chunk(3)[rank] for t in (q, k, v)]),
                "self_attn.o_proj": attn.o_proj.weight.chunk(3, dim=1)[rank],
                "mlp.gate_up_proj": torch.cat([gate.chunk(3)[rank], up.chunk(3)[rank]]),
                "mlp.down_proj": mlp.down_proj.weight.chunk(3, dim=1)[rank],
            }
            for name, weight in expected.items():
                layer = model.layers[i].get_submodule(name)
                assert torch.equal(layer.blocks, reference_pack_q4_1(weight)), (rank, i, name)
        rows = model.lm_head.out_features
        head = full.embed_tokens.weight[rank * rows : (rank + 1) * rows]
        assert torch.equal(model.lm_head.blocks, reference_pack_q8_0(head)), rank


# ------------------------------------------------------------------- other formats, biases, shards: tiny models


@pytest.mark.parametrize("fixture", ["tiny_llama_gguf", "tiny_qwen2_gguf", "tiny_llama_dir"])
@pytest.mark.parametrize("method", BLOCK_METHODS)
@pytest.mark.parametrize("tp", [1, 2])
def test_pending_block_layers_end_as_quantizing_the_loaded_floats(request, fixture: str, method: str, tp: int):
    """Whatever reaches a pending layer (the file's blocks in its format or another one, F16/BF16/Q4_0/Q5 tensors,
    safetensors floats, q/k/v biases), the layers end up as quantize() makes them of the loaded float model."""
    source = resolve_model(str(request.getfixturevalue(fixture)))
    config = load_hf_config(source)
    for rank in range(tp):
        parallel = ParallelGroups(RankLayout(rank, tp_size=tp))
        before = build_model(config, 64, CPU, torch.float32, parallel)
        before.load_weights(load_weights(source, torch.float32))
        before.quantize(method)
        direct = build_model(config, 64, CPU, torch.float32, parallel, block_method=method)
        direct.load_weights(load_weights(source, torch.float32, blocks=BLOCK_METHODS))
        expected, got = block_layers(before), block_layers(direct)
        assert got.keys() == expected.keys() and got
        for name, layer in got.items():
            assert type(layer) is type(expected[name]), name
            assert torch.equal(layer.blocks, expected[name].blocks), (rank, name)
            if expected[name].bias is None:
                assert layer.bias is None
            else:
                assert torch.equal(layer.bias, expected[name].bias), name
        for name, param in direct.named_parameters():
            assert torch.equal(param, before.get_parameter(name)), name


def test_a_pending_layer_refuses_rows_that_do_not_fit() -> None:
    layer = PendingBlockLinear("q4_1", 64, 16, bias=False)
    with pytest.raises(ValueError, match="do not fit"):
        layer.load_rows(8, torch.randn(16, 64))
    with pytest.raises(ValueError, match="do not fit"):
        layer.load_rows(0, torch.randn(16, 96))
    with pytest.raises(ValueError, match="multiple of 32; a layer has 40"):
        PendingBlockLinear("q8_0", 40, 16, bias=False)


def test_a_pending_layer_refuses_to_finish_with_rows_missing_or_loaded_twice() -> None:
    """A fused layer's parts must cover its rows once each: a gap would leave rows of whatever memory held."""
    rows = quantize_blocks("q4_1", torch.randn(48, 64))
    gap = PendingBlockLinear("q4_1", 64, 48, bias=False)
    gap.load_rows(0, StoredBlocks("q4_1", rows[:16]))
    gap.load_rows(32, StoredBlocks("q4_1", rows[32:]))
    with pytest.raises(ValueError, match="rows 16.. .* never loaded"):
        gap.finish()
    short = PendingBlockLinear("q4_1", 64, 48, bias=False)
    short.load_rows(0, StoredBlocks("q4_1", rows[:32]))
    with pytest.raises(ValueError, match="rows 32.. .* never loaded"):
        short.finish()
    overlap = PendingBlockLinear("q4_1", 64, 48, bias=False)
    overlap.load_rows(0, StoredBlocks("q4_1", rows[:32]))
    overlap.load_rows(16, StoredBlocks("q4_1", rows[16:]))
    with pytest.raises(ValueError, match="loaded twice"):
        overlap.finish()
    with pytest.raises(ValueError, match="rows 0.. .* loaded twice"):
        overlap.load_rows(0, StoredBlocks("q4_1", rows[:16]))
    whole = PendingBlockLinear("q4_1", 64, 48, bias=False)
    for start in (32, 0, 16):  # in any order
        whole.load_rows(start, StoredBlocks("q4_1", rows[start : start + 16]))
    assert torch.equal(whole.finish().blocks, Q4_1Linear(StoredBlocks("q4_1", rows), None).blocks)


@pytest.mark.parametrize("fixture", ["tiny_llama_gguf", "tiny_llama_dir"])
def test_a_pipeline_stage_reads_only_its_own_weights(request, fixture: str) -> None:
    """Each stage's loader skips the other stages' tensors before reading or converting them, and the stage ends with
    the same parameters as one that read everything and dropped what it does not own."""
    source = resolve_model(str(request.getfixturevalue(fixture)))
    config = load_hf_config(source)
    every_name = [name for name, _ in load_weights(source, torch.float32)]
    for rank in range(2):
        model = build_model(config, 64, CPU, torch.float32, ParallelGroups(RankLayout(rank, pp_size=2)))
        names = [name for name, _ in load_weights(source, torch.float32, wanted=model.wants)]
        layers = {int(n.split(".")[2]) for n in names if n.startswith("model.layers.")}
        assert layers == set(model.stage_layers) and len(names) < len(every_name)
        assert ("model.embed_tokens.weight" in names) == (rank == 0 or config.tie_word_embeddings)
        model.load_weights(load_weights(source, torch.float32, wanted=model.wants))
        everything = build_model(config, 64, CPU, torch.float32, ParallelGroups(RankLayout(rank, pp_size=2)))
        everything.load_weights(load_weights(source, torch.float32))
        for name, param in model.named_parameters():
            assert torch.equal(param, everything.get_parameter(name)), (rank, name)
