"""float16 weights loaded without a float32 copy (worker/weights/float16.py): a bfloat16 safetensors directory, and a
GGUF's layers that no block format holds, give the same layers as converting a float32 model after loading."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from lmserve.config import CacheConfig, ModelConfig
from lmserve.models import load_hf_config, resolve_model
from lmserve.worker.model_builder import build_model
from lmserve.worker.model_runner import ModelRunner
from lmserve.worker.weights.batched_copies import Float16WeightLinear
from lmserve.worker.weights.float16 import PendingFloat16Linear
from lmserve.worker.weights.loader import hf_tensor_dtype, load_weights, stored_matrix_types
from lmserve.worker.weights.stored_formats import BLOCK_FORMATS, STORED_BLOCK_TYPES, runnable_types

CPU = torch.device("cpu")


def _bfloat16_copy(directory: Path, destination: Path) -> Path:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model.to(torch.bfloat16).save_pretrained(destination)
    transformers.AutoTokenizer.from_pretrained(directory).save_pretrained(destination)
    return destination


def _reference(source, config) -> torch.nn.Module:
    """The convert-after-loading path: float32 parameters, then every linear layer to float16."""
    reference = build_model(config, 64, CPU, torch.float32)
    reference.load_weights(load_weights(source, torch.float32))
    reference.quantize("fp16")
    return reference


def _float32_tensors(model: torch.nn.Module) -> dict[str, int]:
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    return {name: t.numel() for name, t in tensors.items() if t.dtype == torch.float32 and "rotary" not in name}


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])  # untied head; tied head with biases
def test_a_bfloat16_checkpoint_loads_straight_into_float16_layers(
    fixture: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    directory = _bfloat16_copy(request.getfixturevalue(fixture), tmp_path / "bf16")
    source = resolve_model(str(directory))
    assert hf_tensor_dtype(source, "model.embed_tokens.weight") == torch.bfloat16
    runner = ModelRunner(ModelConfig(model=str(directory), device="cpu", quantization="fp16"),
                         CacheConfig(num_blocks=4))
    model, config = runner.model, runner.hf_config
    reference = _reference(source, config)

    # No float32 matrix: the table stays in the checkpoint's bfloat16, the layers in fbgemm's float16.
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    hidden = config.hidden_size
    assert max(_float32_tensors(model).values()) <= 4 * hidden, _float32_tensors(model)
    assert not any(isinstance(m, PendingFloat16Linear) for m in model.modules())

    ids = torch.arange(config.vocab_size).view(8, -1)
    assert torch.equal(model.embed_tokens(ids), reference.embed_tokens(ids))
    assert model.embed_tokens(ids).dtype == torch.float32
    x = torch.randn(5, hidden, generator=torch.Generator().manual_seed(0))
    for name, layer in reference.named_modules():
        if isinstance(layer, Float16WeightLinear):
            ours = model.get_submodule(name)
            assert isinstance(ours, Float16WeightLinear), name
            inputs = torch.randn(5, layer.in_features, generator=torch.Generator().manual_seed(1))
            assert torch.equal(ours(inputs), layer(inputs)), name
    assert torch.equal(model.compute_logits(x), reference.compute_logits(x))


def test_a_float32_checkpoint_keeps_its_float32_table(tiny_llama_dir: Path) -> None:
    runner = ModelRunner(ModelConfig(model=str(tiny_llama_dir), device="cpu", quantization="fp16"),
                         CacheConfig(num_blocks=4))
    assert runner.model.embed_tokens.weight.dtype == torch.float32
    assert isinstance(runner.model.lm_head, Float16WeightLinear)


def test_rows_are_checked_and_saturate_as_fbgemm_saturates() -> None:
    layer = PendingFloat16Linear(64, 32, bias=True)
    layer.load_rows(0, torch.ones(16, 64))
    with pytest.raises(ValueError, match="do not fit"):
        layer.load_rows(24, torch.ones(16, 64))
    with pytest.raises(ValueError, match="do not fit"):
        layer.load_rows(0, torch.ones(16, 48))
    with pytest.raises(ValueError, match="loaded twice"):
        layer.load_rows(8, torch.ones(8, 64))
    with pytest.raises(ValueError, match="missing rows"):
        layer.finish()
    # Beyond float16's range the values saturate, as fbgemm's packing of float32 weights saturates them; the bias,
    # loaded after the rows were packed, is added all the same.
    layer.load_rows(16, torch.full((16, 64), 1e6))
    with torch.no_grad():
        layer.bias.copy_(torch.arange(32.0))
    finished = layer.finish()
    assert isinstance(finished, Float16WeightLinear)
    expected = torch.cat([torch.full((16,), 64.0), torch.full((16,), 64 * torch.finfo(torch.float16).max)])
    assert torch.equal(finished(torch.ones(1, 64))[0], expected + torch.arange(32.0))


def test_a_gguf_layer_without_a_block_format_loads_into_float16(mixed_gguf: Path) -> None:
    """conftest.mixed_gguf's Q6_K down projections, with only the block formats to run on: float16 layers filled
    from the dequantized rows, the same as the float32 layers converted after loading."""
    source = resolve_model(str(mixed_gguf))
    config = load_hf_config(source)
    per_layer = runnable_types(stored_matrix_types(source), BLOCK_FORMATS)
    assert per_layer["model.layers.1.mlp.down_proj.weight"] == "float"
    loaded = build_model(config, 64, CPU, torch.float32, block_method="q8_0", stored_types=per_layer,
                         formats=BLOCK_FORMATS, float16_layers=True)
    assert isinstance(loaded.layers[1].mlp.down_proj, PendingFloat16Linear)
    loaded.load_weights(load_weights(source, None, blocks=STORED_BLOCK_TYPES))
    converted = build_model(config, 64, CPU, torch.float32, block_method="q8_0", stored_types=per_layer,
                            formats=BLOCK_FORMATS)
    converted.load_weights(load_weights(source, torch.float32, blocks=STORED_BLOCK_TYPES))
    assert converted.quantize_float_layers("fp16") == 2
    x = torch.randn(3, config.intermediate_size, generator=torch.Generator().manual_seed(2))
    for i in range(config.num_hidden_layers):
        ours, theirs = loaded.layers[i].mlp.down_proj, converted.layers[i].mlp.down_proj
        assert isinstance(ours, Float16WeightLinear) and isinstance(theirs, Float16WeightLinear)
        assert torch.equal(ours(x), theirs(x))
