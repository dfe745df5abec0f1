"""gpt-oss (GptOssForCausalLM) through the real ModelRunner's paged path matches transformers on the same weights:
attention sinks, alternating sliding-window and full layers, YaRN RoPE, biases on q/k/v/o and the router, the router's
softmax over its top k, the experts' clamped SwiGLU with biases. Float32 logits within 1e-5 over chunked prefill,
decodes and mixed batches, under our C++ kernels (paged-cpu attention) and PyTorch's (sdpa).
"""

from __future__ import annotations

import pytest
import torch
from gpt_oss_models import save_tiny_gpt_oss
from test_model_parity import KERNELS, TINY_ATOL, Parity, chunked_prefill_then_decode, mixed_batch

from lmserve.worker.models.moe import SparseMoeBlock


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory: pytest.TempPathFactory, default_tokenizer):
    return save_tiny_gpt_oss(tmp_path_factory.mktemp("gpt-oss"), default_tokenizer)


@pytest.mark.parametrize("kernels", list(KERNELS))
def test_a_hugging_face_gpt_oss_matches_transformers(gpt_oss_dir, kernels: str) -> None:
    p = Parity(gpt_oss_dir, max_model_len=256, num_blocks=32, atol=TINY_ATOL, kernels=kernels)
    model = p.runner.model
    assert model.layer_types == ["sliding_attention", "full_attention"] * 2
    assert p.kv_groups.num_groups == 2 and sorted(p.kv_groups.windows) == [0, 8]
    blocks = model.moe_blocks()
    assert sorted(blocks) == [0, 1, 2, 3] and all(isinstance(b, SparseMoeBlock) for b in blocks.values())
    seq = p.sequence(76, 0)
    error, scale = chunked_prefill_then_decode(p, seq, split=29, prompt_len=70, blocks=[9, 0, 17, 4, 30])
    print(f"\n{p.name}: chunked prefill + decode, max abs logit error {error:.3g} (max |logit| {scale:.3g})")
    error, scale = mixed_batch(p, {"a": [11, 3], "b": [6, 25, 1], "c": [20]})
    print(f"\n{p.name}: mixed batch, max abs logit error {error:.3g} (max |logit| {scale:.3g})")


@pytest.mark.parametrize("change", ["no sinks", "no clamp", "full attention", "default rope"])
def test_the_parity_would_catch_a_missing_sink_clamp_window_or_yarn(gpt_oss_dir, change: str) -> None:
    """Each piece moves transformers' own logits far past the parity bound, so the parity test holds each one."""
    p = Parity(gpt_oss_dir, max_model_len=256, num_blocks=32, atol=TINY_ATOL)
    seq = p.sequence(40, 0)
    expected = p.reference_logits(seq)
    model = p.reference
    with torch.no_grad():
        for layer in model.model.layers:
            if change == "no sinks":
                layer.self_attn.sinks.fill_(-float("inf"))
            elif change == "no clamp":
                layer.mlp.experts.limit = float("inf")
            elif change == "full attention":
                layer.self_attn.sliding_window = None
        if change == "full attention":
            model.config.layer_types = ["full_attention"] * len(model.model.layers)
        if change == "default rope":
            rotary = model.model.rotary_emb
            rotary.inv_freq, rotary.attention_scaling = rotary.compute_default_rope_parameters(model.config)
    moved = (p.reference_logits(seq) - expected).abs().max().item()
    assert moved > 1000 * TINY_ATOL, (change, moved)

