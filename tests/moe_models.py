"""Tiny random mixture-of-experts models of each family lmserve runs (Qwen3-MoE, Qwen2-MoE with its shared expert,
Mixtral, OLMoE), saved as real Hugging Face directories, and their GGUF files as llama.cpp's convert_hf_to_gguf.py
writes them (architecture names, the experts stacked in one [experts, rows, columns] tensor each, Mixtral as a llama
with experts and its Q/K rows permuted)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from safetensors import safe_open
from safetensors.torch import save_file

# Small, but with GQA, more experts than are chosen, and inner sizes that are whole 32-wide blocks.
MOE_SIZES = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
}
# K-quant experts need rows of whole 256-weight blocks.
MOE_K_SIZES = {**MOE_SIZES, "hidden_size": 256}

FAMILIES = {
    # top 2 of 8 experts, the chosen weights renormalised
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "intermediate_size": 96,
                   "norm_topk_prob": True, "head_dim": 32, "decoder_sparse_step": 1}),
    # a shared expert beside the routed ones, weights not renormalised, q/k/v biases
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM,
                  {"num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 32, "intermediate_size": 96,
                   "shared_expert_intermediate_size": 96, "norm_topk_prob": False}),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 64}),
    # q and k normalised over all heads
    "olmoe": (transformers.OlmoeConfig, transformers.OlmoeForCausalLM,
              {"num_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32, "norm_topk_prob": False}),
}
GGUF_ARCHS = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama", "olmoe": "olmoe"}


def save_tiny_moe(directory: Path, family: str, tokenizer, sizes: dict | None = None, **changes) -> Path:
    config_class, model_class, routing = FAMILIES[family]
    config = config_class(**(sizes or MOE_SIZES), **{**routing, **changes}, vocab_size=len(tokenizer),
                          bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                          pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = model_class(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.1)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.1)
            elif ".gate.weight" in name:  # a router whose choices are far from ties, so that routing is decisive
                param.normal_(0.0, 0.5)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}  # fmt: skip
_EXPERT_NAMES = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
                 "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:  # convert_hf_to_gguf.py's LlamaModel.permute
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def add_sizes(writer: gguf.GGUFWriter, config: transformers.PretrainedConfig) -> None:
    """The decoder's sizes as llama.cpp's converter writes them (shared by the tests' GGUF writers)."""
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)


def write_moe_gguf(hf_dir: Path, path: Path, expert_type: Q = Q.Q8_0, other_type: Q = Q.F32,
                   expert_blocks: dict[str, tuple[np.ndarray, Q]] | None = None) -> Path:
    """The directory's model as llama.cpp's converter writes it. expert_blocks: a stacked expert tensor's raw blocks
    and their type by GGUF name, stored as given instead of quantizing the directory's weights."""
    config = transformers.AutoConfig.from_pretrained(hf_dir)
    family, arch = config.model_type, GGUF_ARCHS[config.model_type]
    # The checkpoint's own tensors (one per expert), as the converter reads them.
    with safe_open(hf_dir / "model.safetensors", "pt") as f:
        state = {name: f.get_tensor(name).float() for name in f.keys()}  # noqa: SIM118 (not a dict)
    writer = gguf.GGUFWriter(path, arch)
    add_sizes(writer, config)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_expert_count(getattr(config, "num_experts", None) or config.num_local_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if family in ("qwen3_moe", "qwen2_moe"):
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if family == "qwen2_moe":
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    writer.add_vocab_size(config.vocab_size)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)

    experts: dict[str, dict[int, np.ndarray]] = {}
    for hf_name, tensor in state.items():
        data = tensor.numpy()
        if hf_name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                    "lm_head.weight": "output.weight"}[hf_name]
            _add(writer, name, data, other_type if data.ndim == 2 else Q.F32)
            continue
        _, _, layer, rest = hf_name.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        module = module.replace("block_sparse_moe.", "mlp.")
        if ".experts." in module:
            _, index, linear = module.rsplit(".", 2)
            experts.setdefault(f"blk.{layer}.{_EXPERT_NAMES[linear]}.{kind}", {})[int(index)] = data
            continue
        name = f"blk.{layer}.{_LAYER_NAMES[module]}.{kind}"
        if family == "mixtral" and module == "self_attn.q_proj":
            data = _permute(data, config.num_attention_heads)
        elif family == "mixtral" and module == "self_attn.k_proj":
            data = _permute(data, config.num_key_value_heads)
        if module == "mlp.shared_expert_gate":
            data = data.reshape(-1)  # llama.cpp's {n_embd}
        keep_float = data.ndim == 1 or module in ("mlp.gate", "mlp.shared_expert_gate")
        _add(writer, name, data, Q.F32 if keep_float else other_type)
    for name, by_expert in experts.items():
        stacked = np.stack([by_expert[e] for e in sorted(by_expert)])
        if expert_blocks and name in expert_blocks:
            blocks, qtype = expert_blocks[name]
            writer.add_tensor(name, blocks, raw_dtype=qtype)
        else:
            _add(writer, name, stacked, expert_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add(writer: gguf.GGUFWriter, name: str, data: np.ndarray, qtype: Q) -> None:
    if qtype == Q.F32:
        writer.add_tensor(name, data.astype(np.float32))
    elif qtype == Q.F16:
        writer.add_tensor(name, data.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)


def quantize_experts_k(directory: Path, rng: np.random.Generator, random_k_quant) -> dict[str, tuple[np.ndarray, Q]]:
    """Replaces every routed expert's weights in the directory's checkpoint with those of random K-quant blocks, as
    llama.cpp's Q4_K_M stores experts (gate and up Q4_K, down Q6_K), rounds the other matrices but the routers to
    float16 (write_moe_gguf's other_type=F16), and returns the stacked blocks by GGUF name: the directory then holds
    exactly the weights the file does. random_k_quant: the tests' maker of valid blocks."""
    path = directory / "model.safetensors"
    with safe_open(path, "pt") as f:
        state = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (not a dict)
    stacks: dict[str, dict[int, np.ndarray]] = {}
    for name in sorted(state):
        if ".experts." not in name:
            if state[name].ndim == 2 and not name.endswith((".gate.weight", "shared_expert_gate.weight")):
                state[name] = state[name].half().float()
            continue
        _, _, layer, rest = name.split(".", 3)
        module, _ = rest.rsplit(".", 1)
        _, index, linear = module.rsplit(".", 2)
        gguf_name = f"blk.{layer}.{_EXPERT_NAMES[linear]}.weight"
        qtype = Q.Q6_K if gguf_name.endswith("down_exps.weight") else Q.Q4_K
        blocks = random_k_quant(*state[name].shape, qtype, rng)
        state[name] = torch.from_numpy(gguf.quants.dequantize(blocks, qtype)).to(state[name].dtype)
        stacks.setdefault(gguf_name, {})[int(index)] = blocks
    save_file(state, path, metadata={"format": "pt"})
    return {name: (np.stack([by_expert[e] for e in sorted(by_expert)]),
                   Q.Q6_K if name.endswith("down_exps.weight") else Q.Q4_K) for name, by_expert in stacks.items()}
