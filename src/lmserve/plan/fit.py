"""Will every rank of an engine configuration fit this machine's memory? The planner's numbers, checked at start.

An engine of -tp × -pp ranks, -dp times over, on one CPU machine: every rank is a process holding its share of the
weights, its own KV cache (--kv-cache-memory is per rank), its activations and a Python + torch runtime. The sum is
compared with what the machine has available now, so that a layout that would swap or be OOM-killed is refused
before any rank starts, with the numbers that say what to lower. No torch here: the check must cost nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from lmserve.config import INT8_ACTIVATIONS_FROM_WEIGHTS, EngineConfig
from lmserve.config_values import MiB, parse_memory
from lmserve.kv_sizing import kv_bytes_per_block
from lmserve.plan.memory import GiB, PlanSettings, activation_bytes, gib, logits_bytes, machine_memory
from lmserve.plan.model_spec import (
    Layout,
    ModelSpec,
    bytes_of_dtype,
    kv_dtype_bytes,
    kv_heads_per_rank,
    layers_in_stage,
    stage_params,
)

# As lmserve.worker.model_runner's (not imported: it needs torch); tests/plan/test_fit.py holds them equal.
DEFAULT_KV_CACHE_MEMORY = "2GiB"
DEFAULT_CPU_DTYPE = "float32"
# Stated, not measured closely: one rank process with Python, torch and lmserve's worker imported holds ~0.25 GiB
# resident before any weight; twice that leaves room for the allocator and the C++ kernels.
CPU_RANK_OVERHEAD = GiB // 2


@dataclass(frozen=True)
class RankMemory:
    """One rank of a pipeline stage (the tensor-parallel ranks of a stage are alike), in bytes."""

    stage: int
    weights: int
    kv_cache: int
    activations: int  # one layer's widest tensors over the token budget, plus the last stage's logits
    overhead: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.activations + self.overhead


@dataclass(frozen=True)
class LayoutMemory:
    layout: Layout
    dtype: str
    ranks: list[RankMemory]  # one per pipeline stage

    @property
    def num_ranks(self) -> int:
        return self.layout.gpus

    @property
    def total(self) -> int:
        """Every rank of every data-parallel replica."""
        return sum(r.total for r in self.ranks) * self.layout.tp * self.layout.replicas

    @property
    def largest(self) -> RankMemory:
        return max(self.ranks, key=lambda r: r.total)


def engine_layout(config: EngineConfig) -> Layout:
    p = config.parallel
    return Layout(p.tensor_parallel_size, p.pipeline_parallel_size, p.data_parallel_size)


def compute_dtype(config: EngineConfig) -> str:
    """The dtype the weights load in: on CPU float32 (the engine's default), quantized only after loading, so
    float32 is also the conservative size of q4_1 / fp16 weights."""
    return DEFAULT_CPU_DTYPE if config.model.dtype == "auto" else config.model.dtype


def layout_memory(spec: ModelSpec, config: EngineConfig) -> LayoutMemory:
    """The planner's per-rank bytes for the configuration: weights / (tp × pp) (plan.model_spec.stage_params), the KV
    budget each rank allocates, the planner's activation and logits model, and CPU_RANK_OVERHEAD."""
    layout, dtype = engine_layout(config), compute_dtype(config)
    nbytes = bytes_of_dtype(dtype)
    cache, scheduler = config.cache, config.scheduler
    settings = PlanSettings(dtype=dtype, max_num_batched_tokens=scheduler.max_num_batched_tokens,
                            max_num_seqs=scheduler.max_num_seqs, block_size=cache.block_size)
    ranks = []
    for stage in range(layout.pp):
        if cache.num_blocks:
            # The KV dtype 'auto' may pick float16; the model's dtype is the larger, hence conservative, size.
            kv_nbytes = nbytes if cache.kv_cache_dtype == "auto" else kv_dtype_bytes(cache.kv_cache_dtype)
            kv = cache.num_blocks * kv_bytes_per_block(
                layers_in_stage(spec.num_layers, layout.pp, stage), kv_heads_per_rank(spec, layout.tp),
                spec.head_dim, cache.block_size, kv_nbytes,
            )
        else:
            kv = parse_memory(cache.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY) or 0
        last = stage == layout.pp - 1
        ranks.append(RankMemory(
            stage=stage,
            weights=stage_weight_bytes(spec, layout, stage, nbytes, config.model.batched_weights,
                                       config.model.block_activations),
            kv_cache=kv,
            activations=activation_bytes(spec, layout.tp, scheduler.max_num_batched_tokens, nbytes)
            + (logits_bytes(spec, settings) if last else 0),
            overhead=CPU_RANK_OVERHEAD,
        ))
    return LayoutMemory(layout, dtype, ranks)


# The copy of the decoder layers' weights that prompt rows may run on (weights/block_linear.py: bfloat16 for the AMX
# kernel, float16 for fbgemm), built beside a GGUF's stored blocks.
PROMPT_COPY_BYTES = 2


def takes_prompt_copy(spec: ModelSpec, batched_weights: str | None, block_activations: str | None) -> bool:
    """Whether the engine may build that copy (worker/weights/kernel_choice.batched_path): never with `none` or
    `prompt-int8`, nor under auto with 8-bit activations (asked for, or auto's choice from
    INT8_ACTIVATIONS_FROM_WEIGHTS decoder weights). Otherwise counted, whether or not this CPU's auto takes it (the
    AVX-512 VNNI kind does not): the planner reads no CPU flags, and those models are small."""
    batched_weights, block_activations = batched_weights or "auto", block_activations or "auto"
    if batched_weights in ("none", "prompt-int8"):
        return False
    if batched_weights != "auto":
        return True
    if block_activations == "auto":
        return spec.decoder_linear_weights < INT8_ACTIVATIONS_FROM_WEIGHTS
    return block_activations != "int8"


def stage_weight_bytes(spec: ModelSpec, layout: Layout, stage: int, nbytes: int, batched_weights: str | None,
                       block_activations: str | None = "auto") -> int:
    """One rank's weights: a GGUF's at their stored size plus the prompt copy of its layers where the engine may
    build one (takes_prompt_copy), a float checkpoint's in the compute dtype."""
    parts = stage_params(spec, layout, stage)
    weights = spec.weight_bytes(sum(parts.values()), nbytes, layout.tp)
    if spec.stored_bits and takes_prompt_copy(spec, batched_weights, block_activations):
        weights += parts["layers"] * PROMPT_COPY_BYTES
    return weights


def available_memory() -> int:
    """What this machine can give new processes now without swapping: MemAvailable, else all of its RAM."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return machine_memory()


def runs_on_cpu(device: str) -> bool:
    """Where the engine's `device` resolves, guessed without torch (worker/model_runner.resolve_device): 'auto' is
    CUDA when torch sees a GPU, and an NVIDIA driver on the machine is the sign of one. A wrong guess of CUDA only
    skips the check; device memory is not known without torch."""
    if device != "auto":
        return device == "cpu"
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return True
    return not Path("/proc/driver/nvidia").exists()


def check_fits(spec: ModelSpec, config: EngineConfig, available: int | None = None) -> LayoutMemory | None:
    """Raises ValueError when the ranks of `config` need more memory than this machine has available. Checked only
    for a CPU engine whose ranks all run here (not Ray, whose ranks may be on other machines); None when skipped."""
    available = available_memory() if available is None else available
    if not runs_on_cpu(config.model.device) or config.parallel.executor_backend == "ray":
        # The ranks' memory is elsewhere, but every data-parallel replica's engine process runs on this machine.
        replicas = config.parallel.data_parallel_size
        if replicas * CPU_RANK_OVERHEAD > available:
            raise ValueError(
                f"-dp {replicas} starts {replicas} engine processes here, {gib(replicas * CPU_RANK_OVERHEAD)} at "
                f"{gib(CPU_RANK_OVERHEAD)} each, and this machine has {gib(available)} available; use fewer replicas"
            )
        return None
    need = layout_memory(spec, config)
    if need.total <= available:
        return need
    layout, rank = need.layout, need.largest
    kv_total = sum(r.kv_cache for r in need.ranks) * layout.tp * layout.replicas
    kv_that_fits = (available - (need.total - kv_total)) // need.num_ranks
    if kv_that_fits >= MiB:
        remedy = f"lower --kv-cache-memory to at most {kv_that_fits // MiB}MiB per rank"
        remedy += " or use fewer ranks (-tp, -pp, -dp)" if need.num_ranks > 1 else ""
    elif need.num_ranks > 1:
        remedy = "use fewer ranks (-tp, -pp, -dp): even without KV cache the ranks do not fit"
    else:
        remedy = "use a smaller model: even without KV cache it does not fit"
    where = f" (stage {rank.stage}, the largest)" if layout.pp > 1 else ""
    held = "as the file stores them" if spec.stored_bits else f"{need.dtype}, as they load"
    raise ValueError(
        f"-tp {layout.tp} -pp {layout.pp} -dp {layout.replicas} needs {gib(need.total)} of memory, this machine has "
        f"{gib(available)} available: per rank{where} {gib(rank.weights)} weights ({held}) + "
        f"{gib(rank.kv_cache)} KV cache + {gib(rank.activations)} activations + {gib(rank.overhead)} runtime = "
        f"{gib(rank.total)}, × {need.num_ranks} rank(s); {remedy}"
    )
