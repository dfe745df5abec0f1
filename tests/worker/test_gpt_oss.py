"""gpt-oss (GptOssForCausalLM) through the real ModelRunner's paged path matches transformers on the same weights:
attention sinks, alternating sliding-window and full layers, YaRN RoPE, biases on q/k/v/o and the router, the router's
softmax over its top k, the experts' clamped SwiGLU with biases. Float32 logits within 1e-5 over chunked prefill,
decodes and mixed batches, under our C++ kernels (paged-cpu attention) and PyTorch's (sdpa).

MXFP4 experts, from OpenAI's checkpoint layout and from the GGUF llama.cpp's own converter writes of it, run at their
stored size on the int16 kernels and match transformers on the float32 model that holds the blocks' values, within the
kernels' rounding of the activations.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gpt_oss_models import LLAMA_CPP_SOURCE, convert_with_llama_cpp, save_mxfp4_twin, save_tiny_gpt_oss
from test_model_parity import (
    KERNELS,
    TINY_ATOL,
    Parity,
    chunked_prefill_then_decode,
    hf_reference,
    mixed_batch,
    scheduled,
)

from lmserve.models import resolve_model
from lmserve.worker.models.moe import SparseMoeBlock
from lmserve.worker.weights.block_linear import Q8_0Linear
from lmserve.worker.weights.kernel_choice import int16_kernel_loads
from lmserve.worker.weights.kquants import Int16BlockLinear
from lmserve.worker.weights.loader import stored_matrix_types

# int16 activations round each block of 32 inputs to 16-bit integers: measured 1.7e-4 on logits up to 0.8 here (the
# q8_0 int16 kernel on the same weights gives the mxfp4 kernel's bits), where float32 activations on the same blocks
# give 8e-7.
MXFP4_ATOL = 1e-3
needs_int16 = pytest.mark.skipif(not int16_kernel_loads(), reason="the int16 kernels did not build (mxfp4 is q8_0)")


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


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(tmp_path_factory: pytest.TempPathFactory, default_tokenizer):
    """(the float32 directory, the same model with its experts as MXFP4 blocks in OpenAI's layout). gpt-oss's own
    SwiGLU limit (7.0): llama.cpp fixes it (a GGUF header does not carry one)."""
    float_dir = save_tiny_gpt_oss(tmp_path_factory.mktemp("gpt-oss-float"), default_tokenizer, swiglu_limit=7.0)
    mxfp4_dir = save_mxfp4_twin(float_dir, tmp_path_factory.mktemp("gpt-oss-mxfp4"), np.random.default_rng(0))
    return float_dir, mxfp4_dir


def mxfp4_parity(path, float_dir, activations: str = "int16", **settings) -> Parity:
    """Our runner on `path` under --quantization auto (MXFP4 experts on their kernel; the other matrices float16, as
    auto holds a checkpoint's float matrices) against transformers on the float directory with the same float16
    rounding of its linear layers (the experts and the router are no nn.Linear there: they keep their values)."""
    p = Parity(path, max_model_len=256, num_blocks=32, atol=MXFP4_ATOL, quantization="auto",
               block_activations=activations, reference=float_dir, **settings)
    p.reference = hf_reference(float_dir, fp16_weights=True)
    return p


def check_experts_at_their_stored_size(p: Parity) -> None:
    for block in p.runner.model.moe_blocks().values():
        for expert in block.experts:
            for linear in (expert.gate_up_proj, expert.down_proj):
                assert isinstance(linear, Int16BlockLinear) and linear.method == "mxfp4"
                assert linear.kernel_only and linear.batched is None and linear.prompt_copy is None
                # 18 bytes a block of 32 (the file's 17, the scale byte as a float16 d), no float copy beside them.
                assert linear.blocks.nbytes == linear.out_features * linear.in_features * 18 // 32
                assert linear.bias is not None


@needs_int16
def test_mxfp4_experts_of_a_checkpoint_run_at_their_stored_size_and_match_transformers(gpt_oss_mxfp4) -> None:
    float_dir, mxfp4_dir = gpt_oss_mxfp4
    types = stored_matrix_types(resolve_model(str(mxfp4_dir)))
    assert set(types.values()) == {"mxfp4"} and len(types) == 4 * 4 * 3  # layers x experts x gate, up, down
    p = mxfp4_parity(mxfp4_dir, float_dir)
    check_experts_at_their_stored_size(p)
    chunked_prefill_then_decode(p, p.sequence(76, 0), split=29, prompt_len=70, blocks=[9, 0, 17, 4, 30])
    mixed_batch(p, {"a": [11, 3], "b": [6, 25, 1], "c": [20]})


def test_mxfp4_experts_under_float32_activations_are_q8_0_blocks_of_the_same_values(gpt_oss_mxfp4) -> None:
    """Where the int16 kernels do not run (or float32 activations are asked for), each MXFP4 block is a q8_0 block
    with the same values (codes the doubled E2M1 values, d the scale as a float16 power of two): the float32 block
    kernel then computes the checkpoint's model to float32 rounding."""
    float_dir, mxfp4_dir = gpt_oss_mxfp4
    p = mxfp4_parity(mxfp4_dir, float_dir, activations="float32")
    p.atol = TINY_ATOL
    for block in p.runner.model.moe_blocks().values():
        for expert in block.experts:
            for linear in (expert.gate_up_proj, expert.down_proj):
                assert isinstance(linear, Q8_0Linear) and linear.kernel_only
    chunked_prefill_then_decode(p, p.sequence(76, 0), split=29, prompt_len=70, blocks=[9, 0, 17, 4, 30])
    mixed_batch(p, {"a": [11, 3], "b": [6, 25, 1], "c": [20]})
    chunked_prefill_then_decode(p, p.sequence(76, 0), split=29, prompt_len=70, blocks=[9, 0, 17, 4, 30])
    mixed_batch(p, {"a": [11, 3], "b": [6, 25, 1], "c": [20]})


@needs_int16
@pytest.mark.skipif(not (LLAMA_CPP_SOURCE / "convert_hf_to_gguf.py").exists(), reason="no llama.cpp source here")
def test_the_gguf_llama_cpp_converts_it_to_runs_its_mxfp4_experts_and_matches_transformers(gpt_oss_mxfp4,
                                                                                           tmp_path) -> None:
    """llama.cpp's names (attn_sinks, post_attention_norm, ffn_gate_inp with its bias, the stacked experts and their
    biases), its YaRN keys and its MXFP4 repacking: the file's model is the checkpoint's, and greedy decoding picks
    transformers' tokens."""
    float_dir, mxfp4_dir = gpt_oss_mxfp4
    path = convert_with_llama_cpp(mxfp4_dir, tmp_path / "gpt-oss-mxfp4.gguf")
    types = stored_matrix_types(resolve_model(str(path)))
    assert {t for name, t in types.items() if ".experts." in name and name.endswith(".weight")} == {"mxfp4"}
    p = mxfp4_parity(path, float_dir)
    assert p.runner.hf_config.model_type == "gpt_oss"
    assert p.runner.model.layer_types == ["sliding_attention", "full_attention"] * 2
    check_experts_at_their_stored_size(p)
    seq = p.sequence(76, 0)
    chunked_prefill_then_decode(p, seq, split=29, prompt_len=70, blocks=[9, 0, 17, 4, 30])
    mixed_batch(p, {"a": [11, 3], "b": [6, 25, 1], "c": [20]})
    # Greedy decoding from a prompt: the same tokens as transformers' generate on the float model.
    prompt, steps = p.sequence(12, 5), 16
    expected = p.reference.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False,
                                    min_new_tokens=steps)[0, len(prompt):].tolist()
    tokens = list(prompt)
    for _ in range(steps):
        start = 0 if len(tokens) == len(prompt) else len(tokens) - 1
        out = p.run([scheduled("g", tokens, start, len(tokens), [2, 7])])
        tokens.append(int(out["g"][1][-1].argmax()))
    assert tokens[len(prompt):] == expected


@needs_int16
@pytest.mark.parametrize("activations", ["int16", "int8"])
def test_a_tokens_result_does_not_depend_on_the_other_tokens_of_its_step(gpt_oss_mxfp4, activations: str) -> None:
    """The same decode alone and beside a prefill chunk and another decode (other experts, more rows for its own):
    the same logits to the bit on the MXFP4 kernels, with the engine's own batched_weights setting."""
    float_dir, mxfp4_dir = gpt_oss_mxfp4
    p = mxfp4_parity(mxfp4_dir, float_dir, activations, batched_weights="auto")
    seq_a, seq_b, seq_c = p.sequence(30, 1), p.sequence(40, 2), p.sequence(12, 3)

    def logits_of_a(batch: list) -> torch.Tensor:
        inputs = p.runner.prepare_inputs(batch)
        return p.runner.forward(inputs)[[s.request_id for s in inputs.sampling].index("a")]

    p.run([scheduled("a", seq_a, 0, 29, [1, 2])])
    p.run([scheduled("c", seq_c, 0, 11, [5])])
    alone = logits_of_a([scheduled("a", seq_a, 29, 30, [1, 2])])
    crowded = logits_of_a([scheduled("b", seq_b, 0, 40, [8, 9, 10]), scheduled("a", seq_a, 29, 30, [1, 2]),
                           scheduled("c", seq_c, 11, 12, [5])])
    assert torch.equal(alone, crowded)
