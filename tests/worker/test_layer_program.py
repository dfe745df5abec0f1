"""The decoder layers as one C++ program (worker/layer_program.py) give the same bits as the Python loop
(`--enforce-eager`): greedy and seeded tokens and their logprobs, over mixed batches of decodes and prompt chunks,
prefix hits and n > 1, for each kind of layer it runs (Llama, Qwen2's biases, Qwen3's q/k norms, Phi-3's partial
rotary, Gemma 2's soft-caps and sandwich norms, Gemma 3's sliding layers in KV groups of their own, K-quant layers
stored in several formats, fbgemm's float16 layers, mixture-of-experts blocks); it runs where it says it does, and says why where it does not."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmserve import LLM, SamplingParams
from lmserve.worker.layer_program import LayerProgram
from lmserve.worker.weights import batched_copies

OPTIONS = {"dtype": "float32", "max_model_len": 256, "max_num_batched_tokens": 32, "max_num_seqs": 8}
QUANTIZED = {**OPTIONS, "quantization": "q8_0"}


def prompts() -> list[list[int]]:
    shared = list(range(300, 340))  # a prefix the later requests find cached
    return [shared + list(range(500 + 7 * i, 512 + 11 * i)) for i in range(4)] + [list(range(600, 611))]


def params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=3),
            SamplingParams(temperature=0.9, seed=7, n=2, max_tokens=20, ignore_eos=True, logprobs=2),
            SamplingParams(temperature=0.7, top_p=0.9, seed=3, max_tokens=20, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1),
            SamplingParams(temperature=1.0, seed=11, max_tokens=24, ignore_eos=True, logprobs=2)]


def run(model: str, monkeypatch: pytest.MonkeyPatch, enforce_eager: bool, **options) -> tuple[list, str, int]:
    """Every completion's tokens and logprobs, how the runner said its layers run, and how many steps the program
    ran."""
    calls = []
    original = LayerProgram.run

    def counting(self, *args, **kwargs):
        calls.append(args[0].shape[0])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(LayerProgram, "run", counting)
    with LLM(model, enforce_eager=enforce_eager, **options) as llm:
        first = llm.generate(prompts()[:1], params()[:1])  # caches the shared prefix
        outputs = first + llm.generate(prompts()[1:], params()[1:])
        how = llm.engine.executor.runner.layer_program
    completions = [(list(c.token_ids), repr(c.logprobs), c.cumulative_logprob) for o in outputs for c in o.outputs]
    return completions, how, len(calls)


MODELS = [
    ("default_source", {**OPTIONS}),
    ("tiny_llama_dir", QUANTIZED),
    ("tiny_qwen2_dir", {**OPTIONS, "quantization": "q4_1"}),
    ("tiny_qwen3_dir", QUANTIZED),
    ("tiny_gemma2_dir", QUANTIZED),
    ("tiny_gemma3_dir", QUANTIZED),
    ("tiny_phi3_dir", QUANTIZED),  # fused q/k/v and gate/up, LongRoPE over 3/4 of each head (partial rotary)
    ("tiny_q4_k_m_gguf", OPTIONS),
    ("tiny_llama_dir", {**OPTIONS, "quantization": "fp16"}),  # every layer on fbgemm's float16 weights
    ("mixed_gguf", OPTIONS),  # block formats, segments, and a float16 layer (down in Q6_K rows of 64)
    ("tiny_kquant_gguf", OPTIONS),  # layer 1: q2_k, q3_k and q5_k layers and segments
    ("moe_dirs:qwen2_moe", {**OPTIONS, "quantization": "q8_0"}),  # a shared expert and its sigmoid gate
    ("moe_dirs:olmoe", {**OPTIONS, "quantization": "q4_1"}),  # q/k norms over all heads
]


@pytest.mark.parametrize(("fixture", "options"), MODELS, ids=[f"{m[0]}-{m[1].get('quantization', 'auto')}" for m in MODELS])
def test_program_gives_the_python_loops_bits(fixture: str, options: dict, request: pytest.FixtureRequest,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    fixture, _, family = fixture.partition(":")
    model = request.getfixturevalue(fixture)
    if fixture == "moe_dirs":
        model = model[family]
    model = str(getattr(model, "path", model))
    if fixture == "tiny_q4_k_m_gguf":  # its file holds no vocabulary: the directory beside it does
        options = {**options, "tokenizer": str(Path(model).parent)}
    if fixture in ("mixed_gguf", "tiny_kquant_gguf"):
        options = {**options, "tokenizer": str(request.getfixturevalue("tiny_kquant_dir"))}
    program, how, steps = run(model, monkeypatch, False, **options)
    eager, eager_how, eager_steps = run(model, monkeypatch, True, **options)
    assert eager_how.startswith("off (--enforce-eager)") and eager_steps == 0
    assert how.startswith("one C++ program"), how
    assert steps > 20, "the program ran the prompt chunks and the decodes"
    assert program == eager


@pytest.mark.parametrize("batched", ["fp16", "prompt-fp16"])
def test_batches_the_program_does_not_take_run_from_python(batched: str, default_source,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """fp16: batches above the block kernel's rows take a float16 copy; prompt-fp16: prompt rows do. Those steps run
    from Python, the others as the program, and the tokens are the Python loop's."""
    options = {**OPTIONS, "batched_weights": batched}
    program, _, steps = run(str(default_source.path), monkeypatch, False, **options)
    eager, _, _ = run(str(default_source.path), monkeypatch, True, **options)
    assert steps > 0
    assert program == eager


def test_float16_rows_padded_to_fbgemms_row_tile(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On an AVX2 CPU fbgemm gets rows in multiples of its tile (Float16WeightLinear pads them with zero rows); the
    program pads and cuts them as the layer does, whatever this machine's tile."""
    monkeypatch.setattr(batched_copies, "fbgemm_row_tile", lambda: 4)
    options = {**OPTIONS, "quantization": "fp16"}
    program, how, steps = run(str(tiny_llama_dir), monkeypatch, False, **options)
    eager, _, _ = run(str(tiny_llama_dir), monkeypatch, True, **options)
    assert how.startswith("one C++ program") and steps > 20, how
    assert program == eager


def test_program_says_why_it_does_not_run(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cases = [(tiny_llama_dir, {**OPTIONS, "quantization": "none"}, "neither a block-format nor a float16 layer"),
             (tiny_llama_dir, {**QUANTIZED, "fused_ops": "none"}, "no fused ops"),
             (tiny_llama_dir, {**QUANTIZED, "attention_backend": "sdpa"}, "paged-cpu attention, not sdpa")]
    for model, options, reason in cases:
        _, how, steps = run(str(model), monkeypatch, False, **options)
        assert how.startswith("from Python") and reason in how, how
        assert steps == 0
