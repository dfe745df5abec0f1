"""Engine configuration: one dataclass per concern, bundled in EngineConfig.

Each setting is declared once, as a dataclass field made by `setting()` (default, help, choices); the command line's
flags (`add_engine_args`) and the flat keywords of `LLM(**kwargs)` (`make_engine_config`) are generated from the
fields, so a new setting is one line here. A field's flat name is its own unless `flat=` says otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmserve.config_values import MAX_CPUS, parse_cpus, parse_json_object, parse_memory
from lmserve.kv_transfer_config import KVTransferConfig, parse_kv_transfer_config
from lmserve.speculative_config import SpeculativeConfig, parse_speculative_config

# Positions per KV-cache block: the engine's block tables, the planner's counts and the kernels' layouts all use it.
KV_BLOCK_SIZE = 16
DEFAULT_MODEL = "smollm2-135m-instruct"
# The architectures lmserve runs, as configs name them (an HF directory's model_type, a GGUF's general.architecture):
# one list for the resolver, the worker and the planner.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "gemma3_text", "phi3",
                         "qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "gpt_oss", "bert", "nomic_bert", "xlm-roberta",
                         "mpnet", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
# Those that are encoders (bidirectional attention, no decode): the server runs them as a pooling runner (vLLM's
# `--runner pooling`), which answers /v1/embeddings and not the generating routes (docs/embeddings.md).
POOLING_MODEL_TYPES = ("bert", "nomic_bert", "xlm-roberta", "mpnet")
# Decoders that are embedding models when their directory is in sentence-transformers' layout (modules.json):
# Qwen3-Embedding (causal, last token), EmbeddingGemma (bidirectional, mean, Dense heads). Run by the decoder's code.
DECODER_EMBEDDING_MODEL_TYPES = ("qwen3", "gemma3_text")
# Decoders that --task score runs as yes/no rerankers (Qwen3-Reranker), by the decoder's code.
DECODER_RERANKER_MODEL_TYPES = ("qwen3",)
# Those whose MLPs are mixtures of experts (lmserve.moe_shape says how each routes).
MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "gpt_oss", "qwen3_5_moe_text", "qwen3_next")
# Hybrid models: Gated DeltaNet (linear attention, a fixed-size recurrent state per request) between full-attention
# layers with an output gate, partial RoPE and zero-centred (1 + weight) norms (worker/models/hybrid.py).
HYBRID_MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
# The same families' multimodal checkpoints (a vision tower beside the text model): refused, text only for now.
HYBRID_MULTIMODAL_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")
# Those of them that run Gemma's decoder layer (HF directories name Gemma 3 gemma3_text, GGUF files gemma3).
GEMMA_MODEL_TYPES = ("gemma2", "gemma3", "gemma3_text")
# Those that normalize each head of q and k before RoPE (one RMSNorm weight of head_dim each, shared by the heads).
QK_NORM_MODEL_TYPES = ("qwen3", "gemma3", "gemma3_text", "qwen3_moe", *HYBRID_MODEL_TYPES)
# Those that normalize the whole q and k projections instead (OLMoE: one RMSNorm weight of heads x head_dim each).
FULL_QK_NORM_MODEL_TYPES = ("olmoe",)
# Those whose q/k/v projections always carry biases (the others: where the config's attention_bias says).
QKV_BIAS_MODEL_TYPES = ("qwen2", "qwen2_moe")
# Those whose attention has a learned sink logit per head (gpt-oss): it joins every softmax and takes no value; their
# output projection carries a bias too, and their experts run gpt-oss's clamped SwiGLU with biases.
ATTENTION_SINK_MODEL_TYPES = ("gpt_oss",)
# --block-activations auto (weights/kernel_choice.py): from this many decoder weights (q/k/v/o/gate/up/down, the whole
# model) 8-bit activations. There a batch's integer products bound the step, and int16's two products a weight cost
# 1.35x (Qwen2.5 0.5B) to 1.5x (1.5B shapes) of int8's time on an 8-concurrent burst (benchmarks/burst_steps.py),
# while int8 moves a K-quant file's perplexity by less than llama.cpp's own 8-bit activations do (+0.06% against
# +0.25% on Qwen2.5 0.5B Q4_K_M). Below it (the default model: 106 M, whose MLP outliers cost +1.9% under int8; Gemma
# 3 270M: 100 M) int16 stays exact and cheap.
INT8_ACTIVATIONS_FROM_WEIGHTS = 250_000_000


def default_layer_types(model_type: str, num_layers: int, sliding_window: int | None = None) -> list[str]:
    """Each layer's attention where a config does not list it (a GGUF header never does), as transformers decides it:
    Gemma 2 alternates from a sliding-window first layer, Gemma 3 has five sliding-window layers to one full, Mistral
    and Phi-3 slide on every layer when their config names a window (Mistral 7B v0.1: 4096, Phi-3-mini-4k: 2047);
    the others attend in full."""
    if model_type in ("mistral", "phi3", "mixtral"):
        return ["sliding_attention" if sliding_window else "full_attention"] * num_layers
    pattern = {"gemma2": 2, "gpt_oss": 2, "gemma3": 6, "gemma3_text": 6}.get(model_type, 0)
    return ["sliding_attention" if pattern and (i + 1) % pattern else "full_attention" for i in range(num_layers)]


def model_layer_types(config: Any) -> list[str]:
    """Each layer's attention as a model config gives it ("full_attention" or "sliding_attention"), or its
    architecture's pattern where it does not list them."""
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    return default_layer_types(config.model_type, config.num_hidden_layers, getattr(config, "sliding_window", None))


# `lmserve serve --max-request-body-bytes`: a larger HTTP body gets 413 before it is read.
DEFAULT_MAX_REQUEST_BODY_BYTES = 8 << 20
# `lmserve serve --header-timeout`: a request's headers must be complete this long after its connection opens or its
# last response ends (a connection trickling them, or silent, is closed). `--body-timeout`: its body this long after
# its headers (else 408); 8 MiB at 2 Mbit/s is 34 s. `--limit-concurrency` (uvicorn's name): connections and requests
# in flight past this are answered 503; each holds a file descriptor.
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 60.0
DEFAULT_LIMIT_CONCURRENCY = 1024
# `--async-scheduling` (vLLM's): plan step N+1 while step N computes. Off until measured on these machines.
DEFAULT_ASYNC_SCHEDULING = False


def cache_directory() -> Path:
    """lmserve's cache (built kernels, converted tokenizers): $LMSERVE_CACHE, else $XDG_CACHE_HOME/lmserve or
    ~/.cache/lmserve. Everything in it can be rebuilt."""
    xdg = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return Path(os.environ.get("LMSERVE_CACHE") or xdg / "lmserve")


def setting(
    default: Any, help: str = "", *, choices: tuple[str, ...] | None = None, flat: str | None = None,
    parse: Callable[[Any], Any] | None = None, flag: bool = True, short: str | None = None,
) -> Any:
    """A configuration field. `parse` turns a flag's or keyword's value into the field's (e.g. '2GiB' -> bytes);
    `flag=False` keeps a setting out of the command line (tests' knobs such as num_blocks)."""
    metadata = {"help": help, "choices": choices, "flat": flat, "parse": parse, "flag": flag, "short": short}
    return field(default=default, metadata=metadata)


# vLLM's other names for dtypes.
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
# More compute threads than any machine has CPUs for: OpenMP crashes trying to start 100,000 of them.
MAX_ENGINE_THREADS = 1024


def _positive_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass
class ModelConfig:
    model: str = setting(DEFAULT_MODEL, "registered name, HF directory or GGUF file")
    dtype: str = setting("auto", "auto: float32 on CPU, bfloat16 on CUDA; half and float as vLLM",
                         choices=("auto", "float32", "bfloat16", "float16", "half", "float"))
    tokenizer: str | None = setting(None, "the tokenizer's model (registered name, HF directory or GGUF file); "
                                          "default: the model's own")
    chat_template: str | None = setting(None, "a Jinja chat template, or a file holding one, instead of the "
                                              "tokenizer's (e.g. one with tool support)")
    generation_config: str = setting(
        "auto", "default sampling of requests that do not set it: auto: the model's generation_config.json "
        "(temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens); vllm: none (SamplingParams' own); "
        "or a directory holding a generation_config.json")
    override_generation_config: dict[str, Any] | None = setting(  # noqa: RUF009 - a dataclasses.field
        None, 'JSON object over the default sampling, e.g. \'{"temperature": 0.5}\'', parse=parse_json_object)
    quantization: str = setting(
        "auto", "weights in fewer bytes, float32 arithmetic (CPU, float32 only): fp16, or llama.cpp's q8_0 / q4_1 "
        "blocks; auto: the GGUF's own block format where it is one of those, else fp16",
        choices=("auto", "none", "fp16", "q8_0", "q4_1"), short="-q")
    batched_weights: str = setting(
        "auto", "with q4_1/q8_0 blocks, the copy of the weights that batches too large for the block kernel multiply "
        "with: prompt-fp16 (prompt tokens through fbgemm on float16 weights, generated tokens through the block "
        "kernel at any batch size: a request's tokens do not depend on its batch); prompt-bf16 (AMX only: prompt "
        "tokens through lmserve's AMX kernel on bfloat16 weights instead, 2-10x faster prefill); prompt-int8 (no "
        "copy: prompt tokens through the stored blocks with 8-bit activations per block of 32, as llama.cpp computes "
        "them: a prefill 1.4x faster than none on AVX-512 VNNI; generated tokens keep 16-bit ones); fp16 (fbgemm above "
        "64 rows for every token: a token's result moves with its batch's size by the float16 rounding of the weights); bf16 (oneDNN, activations "
        "rounded to bfloat16 above a few rows: tokens may depend on the batch); none (every token through the block "
        "kernels: no copy, the weights take the file's size in memory); auto: none where the activations are int8 "
        "(a model of 250 M decoder weights or more: no copy of 2 bytes a weight on any kind), else prompt-bf16 where "
        "the CPU has AMX, none where the int16 block kernels run on AVX-512 VNNI (as fast as the copy there), else "
        "prompt-fp16",
        choices=("auto", "bf16", "fp16", "prompt-bf16", "prompt-fp16", "prompt-int8", "none"))
    block_activations: str = setting(
        "auto", "how the block kernels take their activations: float32 (q4_1/q8_0 blocks only), or int16 (16-bit integers per "
        "block of 32 inputs, exact integer products on AVX-512 VNNI or AVX2: faster decoding, next-token KL < 1e-5 "
        "from the float32 model; a row's result never depends on its batch); int8 (the same kernels with 8-bit "
        "activations per block of 32 for every token, as llama.cpp computes them: half the integer products, so extra "
        "rows of a batch or a speculative verify step cost about half; perplexity +0.06% on Qwen2.5 0.5B Q4_K_M, "
        "+1.9% on the default model, whose activations carry outliers; int16: < 0.01%; a row's result still its "
        f"own); auto, where the kernels build: int8 for models of {INT8_ACTIVATIONS_FROM_WEIGHTS / 1e6:.0f} M decoder weights and more (Qwen2.5 0.5B and "
        "up: there a batch's integer products bound the step, 1.35-1.5x faster under 8 concurrent requests), int16 "
        "below (the default model, Gemma 3 270M); float32 where they do not build",
        choices=("auto", "float32", "int16", "int8"))
    attention_backend: str = setting(
        "auto", "paged-cpu: decodes read the KV blocks in place (CPU, float32); auto: paged-cpu where it runs",
        choices=("auto", "sdpa", "paged-cpu"))
    fused_ops: str = setting(
        "auto", "cpu: RMSNorm+residual, SiLU-and-mul and RoPE as one C++ op each (CPU, float32); auto: where it runs",
        choices=("auto", "none", "cpu"))
    enforce_eager: bool = setting(
        False, "vLLM's: run the decoder layers op by op from Python; by default a step's layers run as one C++ call "
        "where every layer is what it runs (block-format or float16 weights, fused ops, paged-cpu attention, not "
        "split by tensor parallelism; a pipeline stage runs its own layers so): the same kernels, without Python "
        "between them")
    packed_weights_cache: str = setting(
        "auto", "where a GGUF file's weights, once packed into the kernels' layout, are kept on disk so that later "
        "starts map them instead of packing again (keyed by the file's size, modification time and header): auto "
        "($LMSERVE_PACKED_CACHE where set, else <lmserve cache>/packed), off, or a directory")
    packed_weights_cache_size: int | None = setting(
        None, "the packed weights cache's largest size on disk, e.g. 40GiB (the default); the entries read least "
        "recently are removed first", parse=parse_memory)
    packed_weights_cache_min_bytes: int | None = setting(
        None, "models whose packed weights are smaller are not cached (default 64 MiB; tests cache tiny ones)",
        flag=False)
    device: str = setting("auto", "auto | cpu | cuda")
    max_model_len: int | None = setting(None, "context length (default: the model's own)")
    seed: int = setting(0, "seed of the model's random state")
    task: str = setting(
        "auto", "what the model serves: auto: as its files say (an encoder, or a decoder in sentence-transformers' "
        "layout: embeddings; a ...ForSequenceClassification: scores; otherwise generation); score: a Qwen3 decoder "
        "as a yes/no reranker (Qwen3-Reranker: relevance from the logits of \"yes\" and \"no\" after its prompt) "
        "for /v1/rerank and /v1/score, which --rerank-model implies", choices=("auto", "score"))

    def __post_init__(self) -> None:
        self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**63:
            raise ValueError(f"seed must be an integer in [-2**63, 2**63), got {self.seed!r}")
        if self.packed_weights_cache_size is not None and (parse_memory(self.packed_weights_cache_size) or 0) <= 0:
            raise ValueError(f"packed_weights_cache_size must be more than 0 bytes, e.g. 40GiB, got "
                             f"{self.packed_weights_cache_size!r}")
        if self.max_model_len is not None and not _positive_integer(self.max_model_len):
            raise ValueError(f"max_model_len must be an integer >= 1 (leave it out for the model's own), got "
                             f"{self.max_model_len!r}")


@dataclass
class CacheConfig:
    block_size: int = setting(KV_BLOCK_SIZE, "positions per KV-cache block", flag=False)
    kv_cache_memory: int | None = setting(
        None, "bytes of KV cache, or with a unit: 2GiB, 512MiB (default: 2GiB on CPU; on CUDA what "
        "--gpu-memory-utilization leaves); wins over --gpu-memory-utilization", parse=parse_memory)
    gpu_memory_utilization: float = setting(
        0.9, "CUDA only, as vLLM: the fraction of the device's memory this engine may use; the KV cache gets what is "
        "left of it after the weights and the peak activations of a profiling step")
    num_blocks: int | None = setting(None, "KV blocks; overrides kv_cache_memory (tests use tiny pools)", flag=False)
    enable_prefix_caching: bool = setting(True, "reuse the KV of shared prompt prefixes")
    disable_hybrid_kv_cache_manager: bool = setting(
        False, "vLLM's: keep one block table for every layer of a model with sliding-window layers (Gemma 2/3), so "
        "the blocks out of every window stay held (by default a sliding layer holds only its window)")
    kv_cache_dtype: str = setting(
        "auto", "element type of the KV cache; float16 halves its bytes per token, int8 (a float16 scale per 32 "
        "values, as llama.cpp's q8_0) nearly halves them again; vLLM's fp8, fp8_e4m3 and fp8_e5m2 are stored as int8. "
        "auto: float16 for the paged-cpu kernel on a float32 model (CPUs with F16C), else the model's dtype",
        choices=("auto", "float32", "float16", "int8", "fp8", "fp8_e4m3", "fp8_e5m2"))

    kv_transfer_config: KVTransferConfig | None = setting(  # noqa: RUF009 - a dataclasses.field
        None, 'as vLLM: prefill/decode disaggregation, e.g. \'{"kv_connector": "SharedStorageConnector", "kv_role": '
        '"kv_producer", "kv_connector_extra_config": {"shared_storage_path": "/dev/shm/kv"}}\' on the prefill instance '
        'and kv_consumer on the decode one (`lmserve router` in front of both); connectors: SharedStorageConnector, '
        'PyNcclConnector, or one of yours through "kv_connector_module_path" (docs/parallel.md)',
        parse=parse_kv_transfer_config)

    def __post_init__(self) -> None:
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        # Given as bytes or as text with a unit ("64MiB"; LLM(kv_cache_memory=...) keeps the text).
        if self.kv_cache_memory is not None and (size := parse_memory(self.kv_cache_memory) or 0) <= 0:
            raise ValueError(f"kv_cache_memory must be more than 0 bytes, e.g. 2GiB or 512MiB, got {size} bytes")
        if self.num_blocks is not None and not _positive_integer(self.num_blocks):
            raise ValueError(f"num_blocks must be an integer >= 1, got {self.num_blocks!r}")


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = setting(2048, "positions one engine step computes at most (the token budget)")
    max_num_seqs: int = setting(64, "requests running at once; also the largest n a request may ask for")
    long_prefill_token_threshold: int = setting(0, "positions one prefill chunk may take per step (0: no cap)")
    policy: str = setting("fcfs", "fcfs, or priority (lower value first)", choices=("fcfs", "priority"),
                          flat="scheduling_policy")
    async_scheduling: bool = setting(
        DEFAULT_ASYNC_SCHEDULING, "as vLLM: plan the next step while the current one computes (one rank per engine); "
        "a decoding request is planned before its previous token is known, except with a grammar or prompt logprobs")
    speculative_config: SpeculativeConfig | None = setting(  # noqa: RUF009 - a dataclasses.field
        None, 'as vLLM: speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 5}\' (prompt lookup: drafts copied from earlier in the '
        'sequence, verified in one forward pass; output unchanged)', parse=parse_speculative_config)

    def __post_init__(self) -> None:
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {self.policy!r}: use 'fcfs' or 'priority'")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")


@dataclass
class PlacementConfig:
    """Where the engine's compute runs. On a small CPU machine the API process, the engine loop and the compute
    threads share a few cores, and busy-waiting BLAS threads fight whatever else runs there."""

    engine_threads: int | None = setting(None, "compute threads of the engine (default: one per CPU it may use)")
    engine_cpus: list[int] | None = setting(  # noqa: RUF009 - setting() is a dataclasses.field, default None
        None, "CPUs the engine runs on, e.g. '1' or '0-3' (default: all)",
        parse=lambda v: parse_cpus(v) if isinstance(v, str) else v)

    def __post_init__(self) -> None:
        # Not checked against this machine's CPUs here: a configuration may be made for another machine's ranks.
        # worker.placement checks where it is applied, and the CLI before anything starts.
        if self.engine_threads is not None and not (
                _positive_integer(self.engine_threads) and self.engine_threads <= MAX_ENGINE_THREADS):
            raise ValueError(f"engine_threads must be an integer in [1, {MAX_ENGINE_THREADS}], got "
                             f"{self.engine_threads!r}")
        if self.engine_cpus is not None and not (
                self.engine_cpus and all(isinstance(c, int) and 0 <= c < MAX_CPUS for c in self.engine_cpus)):
            raise ValueError(f"engine_cpus must be CPU ids from 0 to {MAX_CPUS - 1}, got {self.engine_cpus!r}")


def cuda_device_index(local_replica: int, ranks_per_node: int, local_rank: int, device_count: int) -> int:
    """The GPU of a rank: each of this machine's data-parallel replicas with GPUs of its own (its local replica r's
    ranks here on GPUs r * ranks_per_node ...), wrapping around when they need more GPUs than the machine has."""
    return (local_replica * ranks_per_node + local_rank) % device_count


def cpu_share(cpus: list[int], parts: int, index: int) -> list[int]:
    """Part `index` of `parts` disjoint, contiguous shares of the CPUs (data-parallel replicas, then each replica's
    ranks), so that no two of them run their compute threads on one core. With fewer CPUs than parts, parts take the
    CPUs in turn, one each."""
    cpus = sorted(cpus)
    if len(cpus) < parts:
        return [cpus[index % len(cpus)]]
    size = len(cpus) // parts
    return cpus[index * size : (index + 1) * size]


EXECUTOR_BACKENDS = ("uni", "mp", "ray")


@dataclass
class ParallelConfig:
    """How one model is split across ranks (tensor, pipeline) and how many engine replicas serve it (data), with
    vLLM's flag names. One engine's ranks share its scheduler; each replica has its own."""

    tensor_parallel_size: int = setting(1, "ranks that split each layer (Megatron: heads and MLP columns)",
                                        short="-tp")
    pipeline_parallel_size: int = setting(1, "stages that each run consecutive layers", short="-pp")
    data_parallel_size: int = setting(1, "engine replicas behind one front-end, each with its own KV cache",
                                      short="-dp")
    enable_expert_parallel: bool = setting(
        False, "a mixture of experts' tensor ranks hold whole experts (expert e on rank e mod tp) instead of a share "
        "of every expert's columns")
    # Which replica this engine is (set per replica by the front-end, never a flag): its ranks' GPUs follow the
    # other replicas' (cuda_device_index).
    data_parallel_rank: int = setting(0, "this engine's index among the data-parallel replicas (set by the front-end)",
                                      flag=False)
    distributed_executor_backend: str | None = setting(
        None, "how an engine runs its ranks: uni (in the engine process, one rank), mp (one process per rank), "
        "ray (Ray actors, possibly on several machines); default: uni for one rank, mp for more",
        choices=EXECUTOR_BACKENDS)
    # Several machines without Ray, as vLLM's mp executor: every node runs `lmserve serve` with the same model and
    # layout flags; node 0 serves the API and runs the engine, the others run only their ranks (--headless).
    nnodes: int = setting(1, "machines this engine's tensor x pipeline ranks run on (mp executor): ranks "
                          "node_rank * world_size / nnodes ... on each; nodes other than 0 run with --headless")
    node_rank: int = setting(0, "this machine's index among --nnodes (0: the one that serves the API)")
    master_addr: str = setting("127.0.0.1", "with --nnodes > 1: node 0's address that every node can reach; the "
                               "ranks' rendezvous and the engine's step sockets listen there")
    master_port: int = setting(29501, "with --nnodes > 1: torch.distributed's rendezvous port on --master-addr; "
                               "the engine's step sockets take the next 1 + tensor x pipeline ports")

    # Data-parallel replicas on several machines, as vLLM: node 0's front-end runs replicas 0 ... L - 1 and waits for
    # the rest, which `lmserve serve ... --data-parallel-start-rank S --headless` starts on the other nodes.
    data_parallel_size_local: int | None = setting(
        None, "replicas that run on this machine (default: all of -dp); the others run on other machines "
        "(--headless there) and connect to --data-parallel-address")
    data_parallel_start_rank: int = setting(
        0, "the first replica this machine runs (with --headless on machines other than the front-end's)")
    data_parallel_address: str = setting(
        "127.0.0.1", "with replicas on other machines: the front-end machine's address that they reach; its "
        "sockets for them listen there")
    data_parallel_rpc_port: int = setting(
        13345, "with replicas on other machines: the first of the 2 x -dp ports the front-end listens on for them")

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "nnodes"):
            value = getattr(self, name)
            if not _positive_integer(value):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if isinstance(self.node_rank, bool) or not isinstance(self.node_rank, int) \
                or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be an integer in [0, nnodes={self.nnodes}), got {self.node_rank!r}")
        if isinstance(self.master_port, bool) or not isinstance(self.master_port, int) \
                or not 1 <= self.master_port <= 65535 - 1 - self.world_size:
            raise ValueError(f"master_port must be a port in [1, {65535 - 1 - self.world_size}] (the step sockets "
                             f"take the next {1 + self.world_size}), got {self.master_port!r}")
        if not isinstance(self.master_addr, str) or not self.master_addr or len(self.master_addr) > 255:
            raise ValueError(f"master_addr must be a host name or address, got {self.master_addr!r}")
        if self.nnodes > 1:
            self._check_multi_node()
        self._check_data_parallel_nodes()
        if self.distributed_executor_backend not in (None, *EXECUTOR_BACKENDS):
            raise ValueError(f"unknown distributed_executor_backend {self.distributed_executor_backend!r}: "
                             f"use one of {', '.join(EXECUTOR_BACKENDS)}")
        if self.distributed_executor_backend == "uni" and self.world_size > 1:
            raise ValueError(f"distributed_executor_backend uni runs one rank; tensor x pipeline parallel "
                             f"{self.world_size} needs mp or ray")

    def _check_multi_node(self) -> None:
        if self.distributed_executor_backend not in (None, "mp"):
            raise ValueError(f"nnodes={self.nnodes} runs ranks with the mp executor; "
                             f"{self.distributed_executor_backend} cannot (Ray places its ranks on its own nodes)")
        if self.world_size % self.nnodes:
            raise ValueError(f"tensor x pipeline parallel {self.world_size} ranks cannot be split evenly over "
                             f"nnodes={self.nnodes}")
        if self.data_parallel_size > 1:
            raise ValueError("data parallel replicas with nnodes > 1: not supported (run one multi-node engine, or "
                             "replicas with Ray: --distributed-executor-backend ray)")

    def _check_data_parallel_nodes(self) -> None:
        size, start, local = self.data_parallel_size, self.data_parallel_start_rank, self.data_parallel_size_local
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start < size:
            raise ValueError(f"data_parallel_start_rank must be an integer in [0, data_parallel_size={size}), "
                             f"got {start!r}")
        if local is not None and (isinstance(local, bool) or not isinstance(local, int)
                                  or not 1 <= local <= size - start):
            raise ValueError(f"data_parallel_size_local must be an integer in [1, {size - start}] (replicas "
                             f"{start} ... {size - 1} are left for this machine), got {local!r}")
        address = self.data_parallel_address
        if not isinstance(address, str) or not address or len(address) > 255:
            raise ValueError(f"data_parallel_address must be a host name or address, got {address!r}")
        if len(self.local_replicas) == size:
            return  # every replica here: no socket listens for other machines
        port = self.data_parallel_rpc_port
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65536 - 2 * size:
            raise ValueError(f"data_parallel_rpc_port must be a port in [1, {65536 - 2 * size}] (the front-end "
                             f"listens on 2 x data_parallel_size={size} ports from it), got {port!r}")

    @property
    def local_replicas(self) -> range:
        """The data-parallel replicas that run on this machine."""
        start = self.data_parallel_start_rank
        count = self.data_parallel_size_local or self.data_parallel_size - start
        return range(start, start + count)

    def cuda_device(self, local_rank: int, device_count: int) -> int:
        """This replica's rank `local_rank` (on this machine)'s GPU, counting replicas from this machine's first
        (a machine that runs replicas 2 and 3 gives them its GPUs from 0, as the one that runs 0 and 1 does)."""
        local_replica = self.data_parallel_rank - self.data_parallel_start_rank
        return cuda_device_index(local_replica, self.ranks_per_node, local_rank, device_count)

    def gpus_shared(self, device_count: int) -> str | None:
        """Why ranks on this machine share GPUs, when they must (more ranks here than GPUs), else None."""
        ranks_here = len(self.local_replicas) * self.ranks_per_node
        if ranks_here <= device_count:
            return None
        return (f"{len(self.local_replicas)} replica(s) of {self.ranks_per_node} rank(s) on this machine share its "
                f"{device_count} GPU(s): ranks wrap around onto GPUs already in use")

    @property
    def world_size(self) -> int:
        """Ranks of one engine (data-parallel replicas each have this many)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    def node_ranks(self, node: int) -> range:
        """The engine ranks that run on machine `node` (consecutive, so that a tensor-parallel group stays on one
        machine wherever the layout allows)."""
        return range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)

    @property
    def executor_backend(self) -> str:
        return self.distributed_executor_backend or ("uni" if self.world_size == 1 else "mp")


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        if self.scheduler.async_scheduling and self.parallel.world_size > 1:
            # Only the driver rank samples, so other tensor ranks could not fill in the token planned ahead; pipeline
            # stages already keep one batch in flight per stage.
            raise ValueError(
                f"async_scheduling needs one rank per engine, got tensor_parallel_size="
                f"{self.parallel.tensor_parallel_size} x pipeline_parallel_size={self.parallel.pipeline_parallel_size}"
                " (data parallel replicas may each schedule asynchronously)")
        spec = self.scheduler.speculative_config
        if self.cache.kv_transfer_config is not None and spec is not None and spec.model is not None:
            raise ValueError("kv_transfer_config with a draft model: the draft's own KV cache is not transferred")
        transfer = self.cache.kv_transfer_config
        if transfer is not None and transfer.over_network and self.parallel.data_parallel_size > 1:
            # Every replica's ranks would listen on (or join) the same ports: one link, several ends.
            raise ValueError(f"PyNcclConnector links one kv_producer instance to one kv_consumer instance, got "
                             f"data_parallel_size={self.parallel.data_parallel_size}: run one pair per replica, each "
                             "with its own kv_port, or use SharedStorageConnector")
        if spec is not None and spec.model is not None and self.parallel.world_size > 1:
            # The draft fills its guesses in on the rank that samples; the others could not know them.
            raise ValueError("speculative decoding with a draft model runs on one rank per engine, got "
                             f"tensor_parallel_size={self.parallel.tensor_parallel_size} x pipeline_parallel_size="
                             f"{self.parallel.pipeline_parallel_size}")


SECTIONS: dict[str, type] = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
                             "placement": PlacementConfig, "parallel": ParallelConfig}


def engine_settings() -> Iterator[tuple[str, str, dataclasses.Field, type]]:
    """(section, flat name, field, field type) of every engine setting, in declaration order."""
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            yield section, f.metadata.get("flat") or f.name, f, hints[f.name]


def make_engine_config(model: str = DEFAULT_MODEL, **kwargs: Any) -> EngineConfig:
    """The flat keyword form that LLM(...) and the command line share: every setting by its flat name."""
    kwargs["model"] = model
    sections: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    for section, flat, f, _ in engine_settings():
        if flat in kwargs:
            value = kwargs.pop(flat)
            parse = f.metadata.get("parse")
            sections[section][f.name] = parse(value) if parse is not None and value is not None else value
    if kwargs:
        known = ", ".join(flat for _, flat, _, _ in engine_settings())
        raise TypeError(f"unknown engine setting(s) {', '.join(sorted(kwargs))}; known: {known}")
    return EngineConfig(**{name: SECTIONS[name](**values) for name, values in sections.items()})


def _flag_type(hint: Any) -> type:
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    base = typing.get_origin(args[0]) or args[0]
    return str if base is list else base


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per engine setting (--flat-name), with the setting's default, help and choices."""
    for _, flat, f, hint in engine_settings():
        if not f.metadata.get("flag", True):
            continue
        names = [f"--{flat.replace('_', '-')}"] + ([f.metadata["short"]] if f.metadata.get("short") else [])
        # argparse formats help with %: a setting's text ("+0.06% on ...") must not be read as a format.
        help_text = (f.metadata.get("help") or "").replace("%", "%%") or None
        kwargs: dict[str, Any] = {"default": f.default, "help": help_text, "dest": flat}
        flag_type = str if f.metadata.get("parse") else _flag_type(hint)  # parse() reads the text
        if flag_type is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = flag_type
            if f.metadata.get("choices"):
                kwargs["choices"] = list(f.metadata["choices"])
        parser.add_argument(*names, **kwargs)


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    """`lmserve serve MODEL`, as `vllm serve MODEL`; --model stays (engine_kwargs takes the positional first)."""
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the model to serve (the same as --model)")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine settings among parsed flags, by flat name (what make_engine_config and LLM take)."""
    kwargs = {flat: getattr(args, flat) for _, flat, f, _ in engine_settings() if f.metadata.get("flag", True)}
    if getattr(args, "model_tag", None) is not None:
        kwargs["model"] = args.model_tag
    return kwargs
