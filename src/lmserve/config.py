"""Engine configuration: one dataclass per concern, bundled in EngineConfig."""

from __future__ import annotations

from dataclasses import dataclass, field

GiB = 1 << 30
DEFAULT_MODEL = "smollm2-135m-instruct"
# `lmserve serve --max-request-body-bytes`: a larger HTTP body gets 413 before it is read.
DEFAULT_MAX_REQUEST_BODY_BYTES = 8 << 20


def parse_memory(value: float | str | None) -> int | None:
    """Bytes from an int, a float meaning GiB, or a string such as '2GiB', '512MiB', '1e9'."""
    if value is None or isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value * GiB)
    text = value.strip().lower().replace(" ", "")
    for suffix, mult in (("gib", GiB), ("gb", 10**9), ("mib", 1 << 20), ("mb", 10**6), ("kib", 1024), ("g", GiB)):
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * mult)
    number = float(text)
    # A bare small number is GiB (as in VLLM_CPU_KVCACHE_SPACE); a large one is bytes.
    return int(number * GiB) if number < 4096 else int(number)


@dataclass
class ModelConfig:
    model: str = DEFAULT_MODEL
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    quantization: str = "auto"  # auto | none | fp16 | q8_0 | q4_1 (weights after loading; worker/quantization.py)
    attention_backend: str = "auto"  # auto | sdpa | paged-cpu (worker/attention.py)
    fused_ops: str = "auto"  # auto | none | cpu (worker/kernels/fused_ops.cpp)
    device: str = "auto"  # auto | cpu | cuda
    max_model_len: int | None = None  # None: the model's own context length
    seed: int = 0


@dataclass
class CacheConfig:
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; None: a default sized for the machine
    num_blocks: int | None = None  # overrides kv_cache_memory (tests use tiny pools)
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # auto | float32 | float16 (worker/attention.py: check_kv_cache_dtype)


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    long_prefill_token_threshold: int = 0  # 0: no cap beyond the budget
    policy: str = "fcfs"  # fcfs | priority

    def __post_init__(self) -> None:
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {self.policy!r}: use 'fcfs' or 'priority'")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")


def parse_cpus(value: str | None) -> list[int] | None:
    """CPU ids from a list such as '1', '0-3' or '0,2-3' (as taskset -c takes them)."""
    if value is None or value == "":
        return None
    cpus: list[int] = []
    try:
        for part in value.split(","):
            first, dash, last = part.strip().partition("-")
            cpus.extend(range(int(first), int(last if dash else first) + 1))
    except ValueError:
        cpus = []
    if not cpus:
        raise ValueError(f"bad CPU list {value!r}: use e.g. '1', '0-3' or '0,2'")
    return sorted(set(cpus))


@dataclass
class PlacementConfig:
    """Where the engine's compute runs. On a small CPU machine the API process, the engine loop and the compute
    threads share a few cores, and busy-waiting BLAS threads fight whatever else runs there."""

    engine_threads: int | None = None  # compute threads in the engine process; None: one per CPU it may use
    engine_cpus: list[int] | None = None  # CPUs the engine process may run on; None: all


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)


def make_engine_config(
    model: str = DEFAULT_MODEL,
    *,
    dtype: str = "auto",
    quantization: str = "auto",
    attention_backend: str = "auto",
    fused_ops: str = "auto",
    device: str = "auto",
    max_model_len: int | None = None,
    seed: int = 0,
    kv_cache_memory: float | str | None = None,
    kv_cache_dtype: str = "auto",
    num_blocks: int | None = None,
    enable_prefix_caching: bool = True,
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 64,
    long_prefill_token_threshold: int = 0,
    scheduling_policy: str = "fcfs",
    engine_threads: int | None = None,
    engine_cpus: str | list[int] | None = None,
) -> EngineConfig:
    """The flat keyword form that LLM(...) and the command line share."""
    return EngineConfig(
        model=ModelConfig(
            model=model, dtype=dtype, quantization=quantization, attention_backend=attention_backend,
            fused_ops=fused_ops, device=device, max_model_len=max_model_len, seed=seed,
        ),
        cache=CacheConfig(
            kv_cache_memory=parse_memory(kv_cache_memory), num_blocks=num_blocks,
            enable_prefix_caching=enable_prefix_caching, kv_cache_dtype=kv_cache_dtype,
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
            long_prefill_token_threshold=long_prefill_token_threshold, policy=scheduling_policy,
        ),
        placement=PlacementConfig(
            engine_threads=engine_threads,
            engine_cpus=parse_cpus(engine_cpus) if isinstance(engine_cpus, str) else engine_cpus,
        ),
    )
