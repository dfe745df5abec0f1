"""Tiny random hybrid linear-attention models (Qwen3.5 dense, Qwen3.5-MoE, Qwen3-Next), saved as real Hugging Face
directories: three Gated DeltaNet layers to one full-attention layer, grouped value heads (4 value heads to 2 key
heads), partial RoPE, and for the MoE families a shared expert beside top 2 of 8 routed experts."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

HYBRID_SIZES = {
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
    "intermediate_size": 96,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
}
_EXPERTS = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48}
HYBRID_FAMILIES = {
    "qwen3_5_text": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM, {}),
    "qwen3_5_moe_text": (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM, _EXPERTS),
    "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM,
                   {**_EXPERTS, "norm_topk_prob": True}),
}


def save_tiny_hybrid(directory: Path, family: str, tokenizer, **changes) -> Path:
    config_class, model_class, extra = HYBRID_FAMILIES[family]
    config = config_class(**HYBRID_SIZES, **{**extra, **changes}, vocab_size=len(tokenizer),
                          bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                          pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = model_class(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):  # zero-centred (and the gated norm's ones) moved off their defaults
                param.add_(torch.randn_like(param) * 0.1)
            elif ".gate.weight" in name or name.endswith("dt_bias"):
                # routers whose choices are far from ties (Qwen3-Next's start at zeros), decays of several sizes
                param.normal_(0.0, 0.5)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
