"""A GGUF model's config without transformers (lmserve.models.GGUFConfig): for every file, the attributes the worker
reads hold what transformers' config class gives for the same header (load_hf_config), defaults included; and the
engine of a GGUF model never imports transformers (its config classes import torch.distributed.tensor: ~1 s)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
import torch
import transformers

from lmserve.formats.gguf_file import read_gguf_header
from lmserve.models import (
    DEFAULT_MODEL,
    GGUF_CONFIG_MAPPING,
    GGUF_EXTRA_CONFIG_MAPPING,
    SUPPORTED_MODEL_TYPES,
    GGUFConfig,
    load_hf_config,
    load_model_config,
    resolve_model,
)
from lmserve.worker.models.layers import layer_types
from lmserve.worker.models.rotary import RotaryEmbedding

# Every attribute of a config that the worker and the engine read (worker/models/llama.py, model_runner.py, the EOS ids).
READ_ATTRIBUTES = (
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "attention_bias", "hidden_act", "rms_norm_eps", "max_position_embeddings",
    "tie_word_embeddings", "bos_token_id", "eos_token_id", "rope_freqs", "rope_parameters", "hidden_activation",
    "sliding_window", "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
)  # fmt: skip
MISSING = object()


def assert_same_config(ours: GGUFConfig, theirs: transformers.PretrainedConfig) -> None:
    # transformers names text-only Gemma 3 gemma3_text, which a GGUF header calls gemma3.
    assert {"gemma3": "gemma3_text"}.get(ours.model_type, ours.model_type) == theirs.model_type
    for name in READ_ATTRIBUTES[1:]:
        # Absent and None are the same (qwen2 has no head_dim: the model then uses hidden_size / heads; nor a window).
        assert getattr(ours, name, None) == getattr(theirs, name, None), name
    assert layer_types(ours) == layer_types(theirs)  # transformers lists them for some architectures only


@pytest.mark.parametrize(
    "fixture",
    [None, "tiny_llama_gguf", "tiny_llama3_gguf", "tiny_qwen2_gguf", "tiny_qwen3_gguf", "tiny_kquant_gguf",
     "tiny_gemma2_gguf", "tiny_gemma3_gguf"],
)  # fmt: skip
def test_a_gguf_config_holds_transformers_values(request, fixture: str | None) -> None:
    source = resolve_model(DEFAULT_MODEL if fixture is None else str(request.getfixturevalue(fixture)))
    config = load_model_config(source)
    assert isinstance(config, GGUFConfig)
    assert_same_config(config, load_hf_config(source))


def write_header(path: Path, arch: str, **metadata) -> Path:
    """A GGUF with a header and no tensors: all that the config is read from."""
    writer = gguf.GGUFWriter(path, arch)
    for key, value in metadata.items():
        if isinstance(value, float):
            writer.add_float32(f"{arch}.{key}", value)
        elif isinstance(value, str):
            writer.add_string(f"{arch}.{key}", value)
        else:
            writer.add_uint32(f"{arch}.{key}", value)
    writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(100)])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3"])
def test_what_a_header_leaves_out_takes_transformers_defaults(tmp_path: Path, arch: str) -> None:
    """Only the sizes: KV heads, head_dim, context length, epsilon, rope base and token ids are transformers'
    defaults for the architecture (they differ between them)."""
    path = write_header(tmp_path / "bare.gguf", arch, block_count=2, embedding_length=256, feed_forward_length=512,
                        **{"attention.head_count": 4})
    source = resolve_model(str(path))
    assert_same_config(load_model_config(source), load_hf_config(source))


def test_linear_rope_scaling_gives_transformers_tables(tmp_path: Path) -> None:
    path = write_header(tmp_path / "linear.gguf", "llama", block_count=2, embedding_length=128, feed_forward_length=256,
                        **{"attention.head_count": 4, "rope.freq_base": 50000.0, "rope.scaling.type": "linear",
                           "rope.scaling.factor": 4.0})
    source = resolve_model(str(path))
    ours, theirs = load_model_config(source), load_hf_config(source)
    assert_same_config(ours, theirs)
    assert ours.rope_parameters["rope_type"] == "linear"
    expected_cos, expected_sin = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(theirs)(
        torch.zeros(1), torch.arange(64)[None]
    )
    rotary = RotaryEmbedding(ours, head_dim=32, max_position=64)
    torch.testing.assert_close(rotary.cos, expected_cos[0, :, :16], rtol=0, atol=0)
    torch.testing.assert_close(rotary.sin, expected_sin[0, :, :16], rtol=0, atol=0)


def test_the_metadata_table_is_transformers_own() -> None:
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING as theirs

    # HF's name for GGUF's gemma3; transformers reads no GGUF of Mixtral, OLMoE or nomic-bert (lmserve's own table,
    # llama.cpp's keys, as BERT's); XLM-RoBERTa, MPNet and the hybrid families run from HF directories only.
    hf_only = {"xlm-roberta", "mpnet", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"}
    assert set(SUPPORTED_MODEL_TYPES) - {"gemma3_text", "mixtral", "olmoe", "nomic_bert", "bert"} - hf_only <= set(
        GGUF_CONFIG_MAPPING)
    assert {"mixtral", "olmoe", "nomic_bert", "bert"} <= set(GGUF_EXTRA_CONFIG_MAPPING)
    for prefix in GGUF_CONFIG_MAPPING:
        assert GGUF_CONFIG_MAPPING[prefix] == theirs[prefix], prefix


ENGINE_WITHOUT_TRANSFORMERS = """
import os
import sys
from lmserve.config import make_engine_config
from lmserve.engine.core import EngineCore
from lmserve.engine.request import Request
from lmserve.sampling_params import SamplingParams

engine = EngineCore(make_engine_config(kv_cache_memory="64MiB", max_model_len=256))
assert engine.executor.runner.quantization == "q4_1"
engine.add_request(Request("r", list(range(100, 140)), SamplingParams(max_tokens=4, ignore_eos=True)))
while engine.has_unfinished_requests():
    engine.step()
print(" ".join(sorted({name.split(".")[0] for name in sys.modules})))
print(" ".join(name for name in sys.modules if name.startswith("torch.distributed.tensor")), flush=True)
os._exit(0)  # not through interpreter shutdown, where the fp16-copies thread may still run (std::terminate)
"""


def test_the_engine_of_a_gguf_model_never_imports_transformers() -> None:
    """The engine process's work for the default model, start-up and a request, in a fresh interpreter: no
    transformers (nor the tokenizer, templates or structured-output libraries only the front-end or a grammar need,
    nor torch.distributed.tensor, which transformers' config validators pulled in, nor sympy, which Module.to_empty
    on meta tensors did)."""
    import lmserve

    env = {**os.environ, "PYTHONPATH": str(Path(lmserve.__file__).parents[1])}
    result = subprocess.run([sys.executable, "-c", ENGINE_WITHOUT_TRANSFORMERS], capture_output=True, text=True,
                            timeout=300, env=env, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    *_, top_level, distributed_tensor, _ = result.stdout.split("\n")
    modules = set(top_level.split())
    assert "torch" in modules and "lmserve" in modules  # the check sees the engine's imports
    for absent in ("transformers", "tokenizers", "jinja2", "safetensors", "xgrammar", "ray", "matplotlib", "sympy"):
        assert absent not in modules, absent
    assert distributed_tensor == ""


def test_a_header_is_read_once_per_version_of_the_file(tmp_path: Path) -> None:
    path = write_header(tmp_path / "h.gguf", "llama", block_count=2, embedding_length=128,
                        **{"attention.head_count": 4})
    first = read_gguf_header(path)
    assert read_gguf_header(path) is first
    write_header(path, "llama", block_count=3, embedding_length=128, **{"attention.head_count": 4})
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))  # however coarse the clock
    assert read_gguf_header(path).metadata["llama.block_count"] == 3


def test_a_header_keeps_short_number_arrays_and_gives_long_ones_as_their_length(tmp_path: Path) -> None:
    """Per-layer values (a few numbers) are read; a vocabulary's scores and types are not held by every process."""
    path = tmp_path / "arrays.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint32("llama.block_count", 3)
    writer.add_array("llama.attention.head_count_kv", [2, 4, 2])
    writer.add_array("tokenizer.ggml.scores", [float(i) for i in range(5000)])
    writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(5000)])
    writer.add_uint32("llama.context_length", 77)  # after the long arrays: they were stepped over exactly
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    metadata = read_gguf_header(path).metadata
    assert metadata["llama.attention.head_count_kv"] == [2, 4, 2]
    assert metadata["tokenizer.ggml.scores"] == 5000 and metadata["tokenizer.ggml.tokens"] == 5000
    assert metadata["llama.context_length"] == 77


@pytest.mark.parametrize("max_position", [200, 512])  # up to Phi-3's original context of 256, and past it
def test_phi3_gguf_rope_is_transformers_longrope_of_the_same_model(tiny_phi3_dir, tiny_phi3_gguf, max_position) -> None:
    """A Phi-3 GGUF's rotary dimensions, LongRoPE factors (tensors), original context and attention factor give the
    tables transformers computes from the HF config the file was written from: short factors for an engine within
    the original context, long ones past it, 3/4 of each head turning. (transformers' own GGUF reader drops all of
    these and would run plain RoPE over whole heads.)"""
    ours = load_model_config(resolve_model(str(tiny_phi3_gguf)))
    theirs = load_hf_config(resolve_model(str(tiny_phi3_dir)))
    assert ours.rope_parameters["rope_type"] == "longrope" and ours.rope_parameters["partial_rotary_factor"] == 0.75
    positions = torch.arange(max_position)[None]
    reference = transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding(theirs)
    expected_cos, expected_sin = reference(torch.zeros(1), positions)  # its choice of factors: by sequence length
    rotary = RotaryEmbedding(ours, head_dim=16, max_position=max_position)
    assert rotary.cos.shape == (max_position, 6)
    # Angles up to ~500 radians are rounded to float32 (ulp ~3e-5) by both, in another order of operations.
    torch.testing.assert_close(rotary.cos, expected_cos[0, :, :6], rtol=0, atol=3e-5)
    torch.testing.assert_close(rotary.sin, expected_sin[0, :, :6], rtol=0, atol=3e-5)
    # Short and long tables differ by far more than that: the choice is checked.
    other = RotaryEmbedding(ours, head_dim=16, max_position=712 - max_position)
    rows = min(max_position, 712 - max_position)
    assert (other.cos[:rows] - rotary.cos[:rows]).abs().max() > 0.01
