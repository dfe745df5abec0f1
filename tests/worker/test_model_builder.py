"""Building the model (worker/model_builder.py) puts everything on the chosen device in the chosen dtype, without a
float32 copy of the weights, and the RoPE tables are real values wherever the model is built.

Without a GPU, the meta device stands in for "not the CPU": a tensor left on the CPU (or created under the ambient
default device) when the model is built for meta is the bug that makes `--device cuda` fail with a device mismatch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

from lmserve.config import CacheConfig, ModelConfig
from lmserve.models import load_hf_config, resolve_model
from lmserve.worker.model_builder import build_model
from lmserve.worker.model_runner import ModelRunner
from lmserve.worker.models.llama import LlamaForCausalLM
from lmserve.worker.models.rotary import RotaryEmbedding
from lmserve.worker.weights.loader import load_weights

MAX_POSITION = 256
DEVICES = ["meta", "cpu"]
DTYPES = [torch.float32, torch.bfloat16]
MODELS = ["tiny_llama_dir", "tiny_llama3_dir", "tiny_qwen2_dir"]  # default rope, llama3-scaled rope, tied embeddings


def hf_config(request: pytest.FixtureRequest, fixture: str) -> transformers.PretrainedConfig:
    return load_hf_config(resolve_model(str(request.getfixturevalue(fixture))))


def hf_rope_tables(config: transformers.PretrainedConfig, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' own cos and sin (scaling included), first half of each row: ours hold each frequency once."""
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
    positions = torch.arange(max_position)[None]
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    half = cos.shape[-1] // 2
    return cos[0, :, :half], sin[0, :, :half]


@pytest.mark.parametrize("fixture", MODELS)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_everything_follows_the_chosen_device_and_dtype(request, fixture: str, device: str, dtype) -> None:
    config = hf_config(request, fixture)
    model = build_model(config, MAX_POSITION, torch.device(device), dtype)
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    assert tensors
    for name, tensor in tensors.items():
        assert (tensor.device.type, tensor.dtype) == (device, dtype), name
    # The RoPE tables follow the device but stay float32 (module.to(dtype) must not round them).
    for table in (model.rotary["full_attention"].cos, model.rotary["full_attention"].sin):
        assert (table.device.type, table.dtype) == (device, torch.float32)
        assert table.shape == (MAX_POSITION, model.kv_shape[1] // 2)
    if device == "cpu":
        expected_cos, expected_sin = hf_rope_tables(config, MAX_POSITION)
        torch.testing.assert_close(model.rotary["full_attention"].cos, expected_cos, rtol=0, atol=1e-6)
        torch.testing.assert_close(model.rotary["full_attention"].sin, expected_sin, rtol=0, atol=1e-6)


@pytest.mark.parametrize("ambient", ["meta", "cpu"])
def test_rope_tables_are_computed_on_the_cpu_whatever_the_default_device(request, ambient: str) -> None:
    """The CUDA bug, reproduced on the CPU: built under `with torch.device(...)`, transformers' llama3 init made its
    positions on the default device and moved them to the CPU (meta: 'Cannot copy out of meta tensor'; CUDA: a
    device mismatch). The tables must be real values on the device asked for."""
    config = hf_config(request, "tiny_llama3_dir")
    expected_cos, expected_sin = hf_rope_tables(config, MAX_POSITION)
    with torch.device(ambient):
        rope = RotaryEmbedding(config, 16, MAX_POSITION, device=torch.device("cpu"))
    torch.testing.assert_close(rope.cos, expected_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(rope.sin, expected_sin, rtol=0, atol=1e-6)
    with torch.device(ambient):  # no device given: the ambient default, as before
        assert RotaryEmbedding(config, 16, MAX_POSITION).cos.device.type == ambient


class AllocationRecorder(TorchDispatchMode):
    """Every tensor an op creates on a real (non-meta) device: (op, dtype, shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.created: list[tuple[str, torch.dtype, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, list | tuple) else [out]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.created.append((str(func), t.dtype, tuple(t.shape)))
        return out


def weight_sized(recorder: AllocationRecorder, model: LlamaForCausalLM) -> list[tuple[str, torch.dtype, tuple]]:
    shapes = {tuple(p.shape) for p in model.parameters()}
    assert (MAX_POSITION, model.kv_shape[1] // 2) not in shapes  # the RoPE tables do not pass for a weight
    return [c for c in recorder.created if c[2] in shapes]


@pytest.mark.parametrize("fixture", MODELS)
def test_a_bfloat16_model_never_has_a_float32_copy_of_its_weights(request, fixture: str) -> None:
    config = hf_config(request, fixture)
    with AllocationRecorder() as recorder:
        model = build_model(config, MAX_POSITION, torch.device("cpu"), torch.bfloat16)
    created = weight_sized(recorder, model)
    # Each parameter is allocated once, in bfloat16, and nothing writes random values into it.
    assert sorted(c[2] for c in created) == sorted(tuple(p.shape) for p in model.parameters())
    assert {c[1] for c in created} == {torch.bfloat16}
    assert {c[0] for c in created} == {"aten.empty.memory_format"}  # uninitialised memory (torch.empty)

    # The check sees the old way's float32, randomly initialised copy.
    with AllocationRecorder() as recorder, torch.device("cpu"):
        old = LlamaForCausalLM(config, MAX_POSITION).to(torch.bfloat16)
    assert torch.float32 in {c[1] for c in weight_sized(recorder, old)}


@pytest.mark.parametrize("fixture", ["tiny_llama3_dir", "tiny_qwen2_dir"])
def test_every_weight_comes_from_the_checkpoint_whatever_the_seed(request, fixture: str) -> None:
    """Uninitialised memory plus load_weights: the seed no longer touches any parameter, and a tied embedding (qwen2)
    still serves as the output layer."""
    path = str(request.getfixturevalue(fixture))

    def runner(seed: int) -> ModelRunner:
        return ModelRunner(ModelConfig(model=path, device="cpu", dtype="bfloat16", seed=seed), CacheConfig(num_blocks=4))

    a, b = runner(0), runner(1)
    params_a, params_b = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    assert params_a.keys() == params_b.keys()
    for name, p in params_a.items():
        assert p.dtype == torch.bfloat16 and torch.equal(p, params_b[name]), name
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    expected = hf.model.embed_tokens.weight.to(torch.bfloat16)
    assert torch.equal(params_a["embed_tokens.weight"], expected)
    assert (a.model.lm_head is None) == bool(hf.config.tie_word_embeddings)


def test_a_checkpoint_without_a_weight_is_refused(tiny_llama_dir: Path) -> None:
    """What makes uninitialised parameters safe: a weight the checkpoint lacks is an error, not random values."""
    source = resolve_model(str(tiny_llama_dir))
    model = build_model(load_hf_config(source), MAX_POSITION, torch.device("cpu"), torch.float32)
    weights = [(n, t) for n, t in load_weights(source, torch.float32) if "layers.1.mlp.down_proj" not in n]
    with pytest.raises(ValueError, match="missing weights"):
        model.load_weights(weights)


@pytest.mark.parametrize("model_type, extra", [
    ("llama", {}),
    ("qwen2", {}),
    ("gemma3_text", {"head_dim": 48}),  # a head_dim that is not hidden / heads
    ("phi3", {"pad_token_id": 0}),  # fused qkv_proj and gate_up_proj
])
def test_decoder_linear_weights_counts_what_transformers_builds(model_type: str, extra: dict) -> None:
    from lmserve.worker.models.llama import decoder_linear_weights

    config = transformers.AutoConfig.for_model(
        model_type, vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, **extra)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    linears = [m for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    assert decoder_linear_weights(config) == sum(m.weight.numel() for m in linears)
