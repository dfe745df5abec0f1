"""Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE) through the real ModelRunner's paged path match
transformers on the same weights, from Hugging Face directories and from GGUF files laid out as llama.cpp's converter
writes them; a GGUF's K-quant experts run at their stored size in the block kernels; and a token's result does not
depend on the other tokens of its step.

The parity checks are test_model_parity's: a prompt in two chunks then decodes, and mixed batches of prefill chunks and
decodes, each row's logits against one full transformers forward.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from moe_models import FAMILIES, write_moe_gguf
from test_model_parity import KERNELS, TINY_ATOL, Parity, chunked_prefill_then_decode, mixed_batch, scheduled

from lmserve.models import GGUFConfig, load_hf_config, load_model_config, resolve_model
from lmserve.moe_shape import moe_shape
from lmserve.worker.models.moe import SparseMoeBlock
from lmserve.worker.weights.block_linear import BlockQuantizedLinear

# int16 activations round each block of 32 inputs to 16-bit integers: measured 1.5e-4 on logits up to 1.8.
K_QUANT_ATOL = 1e-3


CASES = [*FAMILIES, "qwen3_moe_dense_first"]


@pytest.mark.parametrize("kernels", list(KERNELS))
@pytest.mark.parametrize("family", CASES)
def test_a_hugging_face_moe_matches_transformers(moe_dirs, family: str, kernels: str) -> None:
    p = Parity(moe_dirs[family], max_model_len=256, num_blocks=32, atol=TINY_ATOL, kernels=kernels)
    blocks = p.runner.model.moe_blocks()
    assert blocks and all(isinstance(b, SparseMoeBlock) for b in blocks.values())
    if family == "qwen3_moe_dense_first":
        assert sorted(blocks) == [1]
    seq = p.sequence(76, 0)
    error, scale = chunked_prefill_then_decode(p, seq, split=29, prompt_len=70, blocks=[9, 0, 17, 4, 30])
    print(f"\n{p.name}: chunked prefill + decode, max abs logit error {error:.3g} (max |logit| {scale:.3g})")
    error, scale = mixed_batch(p, {"a": [11, 3], "b": [6, 25, 1], "c": [20]})
    print(f"\n{p.name}: mixed batch, max abs logit error {error:.3g} (max |logit| {scale:.3g})")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_gguf_moe_as_llama_cpp_writes_it_matches_transformers(moe_dirs, tmp_path, family: str) -> None:
    """Stacked expert tensors, llama.cpp's architecture names (Mixtral as a llama with experts, its Q/K rows
    permuted), the shared expert's [hidden] gate: stored in float32, the file's model is the directory's."""
    path = write_moe_gguf(moe_dirs[family], tmp_path / f"{family}.gguf", expert_type=Q.F32)
    p = Parity(path, max_model_len=256, num_blocks=32, atol=TINY_ATOL, reference=moe_dirs[family])
    assert p.runner.hf_config.model_type == family
    chunked_prefill_then_decode(p, p.sequence(76, 0), split=29, prompt_len=70, blocks=[9, 0, 17, 4, 30])
    mixed_batch(p, {"a": [11, 3], "b": [6, 25, 1], "c": [20]})


def test_k_quant_experts_run_at_their_stored_size_and_match_transformers(moe_kquant) -> None:
    directory, path = moe_kquant
    p = Parity(path, max_model_len=256, num_blocks=32, atol=K_QUANT_ATOL, reference=directory,
               quantization="auto", block_activations="int16")
    model = p.runner.model
    for block in model.moe_blocks().values():
        for expert in block.experts:
            for linear, method in ((expert.gate_up_proj, "q4_k"), (expert.down_proj, "q6_k")):
                assert isinstance(linear, BlockQuantizedLinear) and linear.method == method
                assert linear.kernel_only and linear.batched is None and linear.prompt_copy is None
                # The file's 4.5 (Q4_K) or 6.5625 (Q6_K) bits a weight, in the int16 kernels' layout (a few percent
                # more: its scales widened), and no float copy beside them.
                stored = linear.out_features * linear.in_features * {"q4_k": 4.5, "q6_k": 6.5625}[method] / 8
                assert stored <= linear.blocks.nbytes < 1.05 * stored
    chunked_prefill_then_decode(p, p.sequence(76, 0), split=29, prompt_len=70, blocks=[9, 0, 17, 4, 30])
    mixed_batch(p, {"a": [11, 3], "b": [6, 25, 1], "c": [20]})


@pytest.mark.parametrize("activations", ["int16", "int8"])
def test_a_tokens_result_does_not_depend_on_the_other_tokens_of_its_step(moe_kquant, activations: str) -> None:
    """The same decode, alone and beside a prefill chunk and another decode (which route to other experts and give
    its experts more rows): the same logits to the bit, with the engine's own settings (batched_weights auto: a
    generated row takes the block kernels at any batch size) and its own logits rows."""
    directory, path = moe_kquant
    p = Parity(path, max_model_len=256, num_blocks=32, atol=1.0, reference=directory, quantization="auto",
               block_activations=activations, batched_weights="auto")
    seq_a, seq_b, seq_c = p.sequence(30, 1), p.sequence(40, 2), p.sequence(12, 3)

    def logits_of_a(batch: list) -> torch.Tensor:
        inputs = p.runner.prepare_inputs(batch)
        logits = p.runner.forward(inputs)
        return logits[[s.request_id for s in inputs.sampling].index("a")]

    p.run([scheduled("a", seq_a, 0, 29, [1, 2])])
    p.run([scheduled("c", seq_c, 0, 11, [5])])
    alone = logits_of_a([scheduled("a", seq_a, 29, 30, [1, 2])])
    crowded = logits_of_a([scheduled("b", seq_b, 0, 40, [8, 9, 10]), scheduled("a", seq_a, 29, 30, [1, 2]),
                           scheduled("c", seq_c, 11, 12, [5])])
    assert torch.equal(alone, crowded)


def test_routing_counts_each_tokens_experts(moe_dirs) -> None:
    """Tokens routed to each expert, per layer: every token of a step counted top_k times, adding up over steps."""
    p = Parity(moe_dirs["qwen3_moe"], max_model_len=256, num_blocks=32, atol=TINY_ATOL)
    before = p.runner.expert_load()
    p.run([scheduled("a", p.sequence(20, 1), 0, 20, [1, 2])])
    after = p.runner.expert_load()
    assert sorted(after) == ["0", "1"]
    top_k = p.runner.hf_config.num_experts_per_tok
    for layer, counts in after.items():
        assert len(counts) == p.runner.hf_config.num_experts
        assert sum(counts) - sum(before[layer]) == 20 * top_k
        assert sum(1 for c in counts if c) > top_k  # random tokens spread over the experts


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_gguf_moe_config_routes_as_transformers_config(moe_dirs, tmp_path, family: str) -> None:
    """The file's header gives the same routing (experts, top k, sizes, renormalisation) as the directory's config,
    without transformers."""
    path = write_moe_gguf(moe_dirs[family], tmp_path / f"{family}.gguf", expert_type=Q.F32)
    source = resolve_model(str(path))
    ours = load_model_config(source)
    assert isinstance(ours, GGUFConfig) and ours.model_type == family
    assert moe_shape(ours) == moe_shape(load_hf_config(resolve_model(str(moe_dirs[family])))) is not None
    assert moe_shape(ours) == moe_shape(load_hf_config(source))


@pytest.mark.parametrize("family", [*FAMILIES, "qwen3_moe_dense_first"])
def test_the_planner_counts_every_expert_for_memory_and_the_chosen_for_time(moe_dirs, family: str) -> None:
    """`lmserve plan`'s parameters are the checkpoint's own count; its active ones drop exactly the experts a token
    does not read."""
    import transformers

    from lmserve.plan.model_spec import load_spec

    spec = load_spec(str(moe_dirs[family]))
    model = transformers.AutoModelForCausalLM.from_pretrained(moe_dirs[family])
    total = sum(p.numel() for p in model.parameters())
    assert spec.num_params == total
    shape = spec.moe
    config = model.config
    unread = sum((shape.num_experts - shape.top_k) * 3 * config.hidden_size * shape.expert_intermediate
                 for i in range(config.num_hidden_layers) if shape.is_moe_layer(i))
    assert spec.active_params == total - unread < total


def test_expert_parallel_ranks_hold_and_read_whole_experts(moe_dirs) -> None:
    """With expert parallel each of two ranks holds every other expert whole (and the loader skips the others'
    weights unread); without it, each rank holds half of every expert's columns."""
    from lmserve.distributed.layout import RankLayout
    from lmserve.distributed.parallel_state import ParallelGroups
    from lmserve.worker.models.llama import LlamaForCausalLM

    config = load_hf_config(resolve_model(str(moe_dirs["qwen3_moe"])))
    columns = config.moe_intermediate_size
    for rank in (0, 1):
        with torch.device("meta"):
            whole = LlamaForCausalLM(config, 256, ParallelGroups(RankLayout(rank, 2)), expert_parallel=True)
            split = LlamaForCausalLM(config, 256, ParallelGroups(RankLayout(rank, 2)))
        block = whole.layers[0].mlp
        assert block.local_experts == [e for e in range(config.num_experts) if e % 2 == rank]
        assert block.experts[rank].gate_up_proj.out_features == 2 * columns
        assert whole.wants(f"model.layers.0.mlp.experts.{rank}.down_proj.weight")
        assert not whole.wants(f"model.layers.0.mlp.experts.{1 - rank}.down_proj.weight")
        assert whole.checkpoint_part(f"model.layers.0.mlp.experts.{rank}.down_proj.weight", (64, columns)) is None
        assert len(split.layers[0].mlp.local_experts) == config.num_experts
        assert split.layers[0].mlp.experts[0].gate_up_proj.out_features == columns
        assert split.wants(f"model.layers.0.mlp.experts.{1 - rank}.down_proj.weight")


@pytest.mark.parametrize("case", ["qwen3_moe-k-quants", "qwen2_moe-q8_0", "mixtral-q4_1", "olmoe-fp16"])
def test_the_blocks_one_cpp_call_gives_the_python_loops_bits(moe_dirs, moe_kquant, case: str) -> None:
    """kernels/moe_block.h's MoeBlock against SparseMoeBlock.python_forward on the same layers: one decode, a few
    tokens, and a prompt's worth (experts with many rows, some with none), to the bit, and the same routing counts."""
    family, _, quantization = case.partition("-")
    if quantization == "k-quants":
        directory, path = moe_kquant
        p = Parity(path, max_model_len=256, num_blocks=32, atol=K_QUANT_ATOL, reference=directory,
                   quantization="auto", block_activations="int16")
    else:
        p = Parity(moe_dirs[family], max_model_len=256, num_blocks=32, atol=1.0, quantization=quantization)
    hidden = p.runner.hf_config.hidden_size
    generator = torch.Generator().manual_seed(0)
    for block in p.runner.model.moe_blocks().values():
        program = block.program_block()
        assert program is not None
        for tokens in (1, 3, 50):
            x = torch.randn(tokens, hidden, generator=generator)
            before = block.routed_tokens.clone()
            ours = program.forward(x)
            counted = block.routed_tokens - before
            reference = block.python_forward(x)
            assert torch.equal(ours, reference)
            assert torch.equal(counted, block.routed_tokens - before - counted)
            assert int(counted.sum()) == tokens * block.top_k


def test_float32_experts_run_the_python_loop(moe_dirs) -> None:
    """Experts that are plain float32 layers are not what the C++ block runs: the block says so and keeps its loop."""
    p = Parity(moe_dirs["qwen3_moe"], max_model_len=256, num_blocks=32, atol=TINY_ATOL)
    assert all(block.program_block() is None for block in p.runner.model.moe_blocks().values())


def test_the_combine_sums_each_tokens_experts_in_its_own_order_whatever_the_other_tokens() -> None:
    """kernels/moe_block.h's combine_slots (the C++ block's weighted sum, read from each expert's own output rows; the
    Python loop's through `moe_combine`): token t gets scale[t, 0] v[t, 0] then one FMA per further expert in its top-k
    order, its bits the same alone as beside other tokens."""
    from lmserve.worker.kernels import moe_combine_op

    combine = moe_combine_op()
    if combine is None:
        pytest.skip("the CPU kernels did not build")
    tokens, k, hidden = 7, 4, 100
    generator = torch.Generator().manual_seed(3)
    slot_out = torch.randn(tokens * k, hidden, generator=generator)
    scale = torch.rand(tokens, k, generator=generator)
    got = combine(slot_out, scale)
    by_choice = slot_out.view(tokens, k, hidden).double()
    expected = (by_choice * scale.double().unsqueeze(-1)).sum(1)
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-5)
    for t in range(tokens):
        assert torch.equal(combine(slot_out[t * k : (t + 1) * k], scale[t : t + 1]), got[t : t + 1]), t
    first_then_fma = slot_out[0::k] * scale[:, :1]
    for j in range(1, k):
        first_then_fma = torch.addcmul(first_then_fma, slot_out[j::k], scale[:, j : j + 1])
    torch.testing.assert_close(got, first_then_fma, rtol=0, atol=1e-6)
