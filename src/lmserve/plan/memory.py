"""Memory planner: will a model and a target concurrency fit, and how should N devices be laid out?

Everything is derived from the model's config (no weights are read): the parameter count it implies, the KV bytes
per token, and a stated runtime headroom. The engine sizes its own KV cache with the same kv_bytes_per_block
(lmserve/kv_sizing.py), so the planner and the engine cannot disagree about what one block costs. No torch here: planning must be instant
and work where torch is not installed.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from lmserve.config import (
    GEMMA_MODEL_TYPES,
    KV_BLOCK_SIZE,
    QK_NORM_MODEL_TYPES,
    SUPPORTED_MODEL_TYPES,
    GiB,
    SchedulerConfig,
    default_layer_types,
)
from lmserve.kv_groups import KVCacheGroups, kv_cache_groups, kv_capacity_tokens
from lmserve.kv_sizing import blocks_needed, kv_bytes_per_block, kv_bytes_per_token

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Stated, not measured: CUDA context, allocator fragmentation, communication buffers. Override with --overhead-gib.
DEFAULT_OVERHEAD_GIB = 1.0

CONFIG_DIR = Path(__file__).parent / "configs"
# Shipped configs so that planning works offline for models not on disk. The default engine model
# (smollm2-135m-instruct) has the same architecture as SmolLM2-135M.
SHIPPED_CONFIGS = {
    "llama-3-8b": "llama-3-8b.json",
    "llama-3-70b": "llama-3-70b.json",
    "qwen2.5-7b": "qwen2.5-7b.json",
    "mistral-7b": "mistral-7b.json",
    "smollm2-135m": "smollm2-135m.json",
    "smollm2-135m-instruct": "smollm2-135m.json",
}


# ---------------------------------------------------------------------------------------------- KV sizing


def bytes_of_dtype(name: str) -> int:
    if name not in DTYPE_BYTES:
        raise ValueError(f"unsupported dtype {name!r}: use one of {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


# ------------------------------------------------------------------------------------------------- model


@dataclass(frozen=True)
class ModelSpec:
    """The sizes of a Llama-family decoder that memory depends on."""

    name: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool
    qkv_bias: bool
    max_position_embeddings: int
    qk_norm: bool = False  # Qwen3 and Gemma 3 normalize each head's q and k (one RMSNorm weight of head_dim each)
    norms_per_layer: int = 2  # Gemma's sandwich: four
    # Each layer's attention ("full_attention" / "sliding_attention") and the window: a sliding layer's KV holds
    # its window, not the whole context (lmserve.kv_groups, as the engine groups them).
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None

    def kv_groups(self, hybrid: bool = True) -> KVCacheGroups:
        return kv_cache_groups(self.layer_types or ("full_attention",) * self.num_layers, self.sliding_window, hybrid)
    # Bits a parameter as a GGUF stores its weights (a Q4_K_M file: ~5), which the engine keeps (worker/
    # stored_formats.py); None for float checkpoints, whose weights take the plan's dtype.
    stored_bits: float | None = None

    def weight_bytes(self, params: int, dtype_bytes: int) -> int:
        """What `params` of this model's parameters take in memory with weights of `dtype_bytes` (a file's stored
        size where it has one)."""
        return int(params * self.stored_bits / 8) if self.stored_bits else params * dtype_bytes

    @classmethod
    def from_hf_dict(cls, name: str, cfg: dict) -> ModelSpec:
        required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
        missing = [key for key in required if not cfg.get(key)]
        if missing:
            raise ValueError(f"config of {name} lacks {', '.join(missing)}")
        model_type = cfg.get("model_type", "<missing>")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported architecture {model_type!r} in {name}: lmserve plans {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        heads = int(cfg["num_attention_heads"])
        vocab = cfg["vocab_size"]
        return cls(
            name=name,
            model_type=model_type,
            vocab_size=int(vocab if isinstance(vocab, int) else len(vocab)),
            hidden_size=int(cfg["hidden_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            intermediate_size=int(cfg["intermediate_size"]),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # As the model code decides it (worker/models/llama.py): Qwen2 always has q/k/v biases.
            qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 2048),
            qk_norm=model_type in QK_NORM_MODEL_TYPES,
            norms_per_layer=4 if model_type in GEMMA_MODEL_TYPES else 2,
            layer_types=tuple(cfg.get("layer_types") or default_layer_types(
                model_type, int(cfg["num_hidden_layers"]), cfg.get("sliding_window"))),
            sliding_window=cfg.get("sliding_window"),
        )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def num_params(self) -> int:
        return sum(stage_params(self, Layout(), 0).values())


def load_spec(model: str | None = None, config_file: str | None = None) -> ModelSpec:
    """A shipped config by name, an HF directory or config.json, or a GGUF file / registered name (metadata only)."""
    if config_file is not None:
        path = Path(config_file).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"no such config file: {path}")
        return ModelSpec.from_hf_dict(path.stem, _read_json(path))
    if model is None:
        raise ValueError("give --model NAME|PATH or --config FILE")
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSpec.from_hf_dict(path.name, _read_json(path / "config.json"))
    if path.is_file() and path.suffix == ".json":
        return ModelSpec.from_hf_dict(path.stem, _read_json(path))
    # "meta-llama/Meta-Llama-3-8B" and "Llama-3-8B" both name the shipped llama-3-8b.
    shipped = SHIPPED_CONFIGS.get(model.lower().rsplit("/", 1)[-1].removeprefix("meta-"))
    if shipped is not None and not path.exists():
        return ModelSpec.from_hf_dict(model, _read_json(CONFIG_DIR / shipped))
    # GGUF files and registered names: the engine's own reader of the header (imported late: it needs transformers).
    from lmserve.models import REGISTERED_MODELS, read_config_dict, resolve_model

    if path.exists() or model in REGISTERED_MODELS:
        from lmserve.gguf_file import gguf_stored_bits

        source = resolve_model(model)
        spec = ModelSpec.from_hf_dict(model, read_config_dict(source))
        return replace(spec, stored_bits=gguf_stored_bits(source.path)) if source.kind == "gguf" else spec
    names = sorted({*SHIPPED_CONFIGS, *REGISTERED_MODELS})
    raise ValueError(
        f"unknown model {model!r}: not a shipped config ({', '.join(names)}), and no such path "
        "(an HF directory, a config.json or a .gguf file)"
    )


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None


# ------------------------------------------------------------------------------------------------ layout


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    replicas: int = 1

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.replicas

    def __str__(self) -> str:
        return f"TP{self.tp}×PP{self.pp}×{self.replicas} replica{'s' if self.replicas > 1 else ''}"


def check_layout(spec: ModelSpec, layout: Layout) -> None:
    """The splits lmserve's engine runs, so that the planner never recommends one `lmserve serve` refuses (it checks
    with this same function, plan/layout.py): TP divides the attention heads, the KV heads (each rank caches whole
    heads of its own, none replicated) and the MLP's intermediate size; PP gives every stage at least one layer."""
    tp, pp = layout.tp, layout.pp
    if min(tp, pp, layout.replicas) < 1:
        raise ValueError(f"-tp, -pp and -dp must be >= 1, got {tp}, {pp} and {layout.replicas}")
    sizes = {"attention heads": spec.num_heads, "KV heads": spec.num_kv_heads,
             "MLP intermediate size": spec.intermediate_size}
    undivided = [f"{n} {what}" if what.endswith("heads") else f"{what} {n}" for what, n in sizes.items() if n % tp]
    if undivided:
        common = math.gcd(*sizes.values())
        fitting = ", ".join(str(d) for d in range(1, common + 1) if common % d == 0)
        raise ValueError(f"-tp {tp} does not divide the {' / '.join(undivided)} of {spec.name}; "
                         f"sizes that do: {fitting}")
    if pp > spec.num_layers:
        raise ValueError(f"-pp {pp} is more stages than the {spec.num_layers} layers of {spec.name}; "
                         f"at most {spec.num_layers}")


def kv_heads_per_rank(spec: ModelSpec, tp: int) -> int:
    # check_layout admits only a TP that divides the KV heads (lmserve replicates none, unlike vLLM).
    return max(1, spec.num_kv_heads // tp)


def layers_in_stage(num_layers: int, pp: int, stage: int) -> int:
    return num_layers // pp + (1 if stage < num_layers % pp else 0)


def stage_params(spec: ModelSpec, layout: Layout, stage: int) -> dict[str, int]:
    """Parameters held by one tensor-parallel rank of a pipeline stage, by part."""
    tp, h = layout.tp, spec.hidden_size
    q = spec.q_size // tp
    kv = kv_heads_per_rank(spec, tp) * spec.head_dim
    inter = blocks_needed(spec.intermediate_size, tp)
    attention = h * (q + 2 * kv) + q * h + ((q + 2 * kv) if spec.qkv_bias else 0)
    qk_norms = 2 * spec.head_dim if spec.qk_norm else 0  # replicated on every rank, as the other norms
    per_layer = attention + 3 * h * inter + spec.norms_per_layer * h + qk_norms  # q/k/v/o, gate/up/down, norms
    embedding = blocks_needed(spec.vocab_size, tp) * h  # vocabulary-parallel under TP
    first, last = stage == 0, stage == layout.pp - 1
    # Tied embeddings under PP: the last stage keeps its own copy of the embedding to serve as the head.
    head = embedding if last and (not spec.tie_word_embeddings or not first) else 0
    return {
        "embedding": embedding if first else 0,
        "layers": layers_in_stage(spec.num_layers, layout.pp, stage) * per_layer,
        "final_norm_and_head": (h + head) if last else 0,
    }


# --------------------------------------------------------------------------------------------------- plan


@dataclass
class PlanSettings:
    dtype: str = "bfloat16"
    kv_dtype: str | None = None  # None: the weights' dtype
    max_model_len: int | None = None  # None: the model's own context length
    context: int | None = None  # tokens per request (prompt + output); None: max_model_len
    concurrency: int = 1
    device_memory: int | None = None  # bytes per device; None: this machine's RAM
    layout: Layout = field(default_factory=Layout)
    max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens
    max_num_seqs: int = SchedulerConfig.max_num_seqs
    block_size: int = KV_BLOCK_SIZE
    overhead: int = int(DEFAULT_OVERHEAD_GIB * GiB)


@dataclass
class DeviceBudget:
    """One device (one TP rank of one pipeline stage); the ranks of a stage are alike."""

    stage: int
    memory: int
    weights: int
    activations: int
    logits: int
    overhead: int
    num_layers: int
    num_kv_heads: int
    kv_bytes_per_token: int
    kv_bytes: int  # what is left for the KV cache; negative when even the rest does not fit
    kv_blocks: int
    kv_tokens: int

    @property
    def headroom(self) -> int:
        return self.activations + self.logits + self.overhead


@dataclass
class Shortage:
    resource: str  # "weights" | "runtime headroom" | "KV cache"
    short_by: int  # bytes per device missing to meet the target
    message: str


@dataclass
class Plan:
    model: str
    num_params: int
    dtype: str
    kv_dtype: str
    layout: Layout
    device_memory: int
    max_model_len: int
    context: int
    concurrency: int
    block_size: int
    token_budget: int  # max_num_batched_tokens, what the activations are sized for
    max_num_seqs: int
    weight_bytes: int  # the whole model, one copy
    kv_bytes_per_token: int  # the whole model, one copy
    devices: list[DeviceBudget]  # one per pipeline stage
    max_concurrency: int  # per replica, at `context` tokens each
    max_context: int  # per request, with `concurrency` requests per replica
    shortage: Shortage | None
    notes: list[str]

    @property
    def fits(self) -> bool:
        return self.shortage is None

    @property
    def binding(self) -> DeviceBudget:
        """The device with the least KV room: it decides the capacity of the whole replica."""
        return min(self.devices, key=lambda d: d.kv_tokens)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["layout"] = {**asdict(self.layout), "gpus": self.layout.gpus}
        out["fits"] = self.fits
        out["max_concurrency_total"] = self.max_concurrency * self.layout.replicas
        return out


def machine_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def activation_bytes(spec: ModelSpec, tp: int, num_tokens: int, nbytes: int) -> int:
    """The widest tensors alive at once while one layer runs over num_tokens positions.

    Layers run one after another, so this does not grow with depth: residual, hidden and norm output, fused q/k/v,
    attention output, fused gate/up and its activation, plus the norms' float32 temporaries. Assumes fused attention
    (no positions × context score matrix).
    """
    q = spec.q_size // tp
    kv = kv_heads_per_rank(spec, tp) * spec.head_dim
    inter = blocks_needed(spec.intermediate_size, tp)
    per_token = nbytes * (3 * spec.hidden_size + (q + 2 * kv) + q + 3 * inter) + 4 * 2 * spec.hidden_size
    return num_tokens * per_token


def logits_bytes(spec: ModelSpec, settings: PlanSettings) -> int:
    # float32 logits for every sampling row (at most one per sequence), and one sampler temporary of the same size.
    rows = min(settings.max_num_seqs, settings.max_num_batched_tokens)
    return 2 * rows * spec.vocab_size * 4


def make_plan(spec: ModelSpec, settings: PlanSettings) -> Plan:
    layout = settings.layout
    check_layout(spec, layout)
    nbytes, kv_dtype = bytes_of_dtype(settings.dtype), settings.kv_dtype or settings.dtype
    kv_nbytes = bytes_of_dtype(kv_dtype)
    memory = settings.device_memory if settings.device_memory is not None else machine_memory()
    max_model_len = settings.max_model_len or spec.max_position_embeddings
    context = settings.context or max_model_len
    bs = settings.block_size
    if min(context, settings.concurrency, bs, settings.max_num_batched_tokens, settings.max_num_seqs) < 1:
        raise ValueError("context, concurrency, block size, token budget and max_num_seqs must be >= 1")
    if context > max_model_len:
        raise ValueError(f"context {context} exceeds max_model_len {max_model_len}")
    notes = []
    if max_model_len > spec.max_position_embeddings:
        notes.append(f"max_model_len {max_model_len} exceeds the model's {spec.max_position_embeddings} positions")
    if spec.stored_bits:
        notes.append(f"weights at the file's stored size ({spec.stored_bits:.2f} bits a parameter); on CPU the "
                     "engine also keeps a 2-byte copy of the decoder layers for prompt rows unless "
                     "--batched-weights none")

    groups = spec.kv_groups()
    if groups.is_hybrid or groups.windows[0]:
        notes.append(f"sliding-window layers hold at most their window ({spec.sliding_window} positions) and a "
                     f"step's chunk; a {context}-token request holds "
                     f"{groups.request_blocks(context, bs, settings.max_num_batched_tokens)} blocks of "
                     f"{groups.slots if groups.is_hybrid else spec.num_layers} layers")

    def request_blocks(tokens: int) -> int:
        return groups.request_blocks(tokens, bs, settings.max_num_batched_tokens)

    devices = []
    for stage in range(layout.pp):
        layers = layers_in_stage(spec.num_layers, layout.pp, stage)
        block_layers = groups.slots if groups.is_hybrid else layers  # a hybrid block holds `slots` layers
        heads = kv_heads_per_rank(spec, layout.tp)
        weights = spec.weight_bytes(sum(stage_params(spec, layout, stage).values()), nbytes)
        activations = activation_bytes(spec, layout.tp, settings.max_num_batched_tokens, nbytes)
        logits = logits_bytes(spec, settings) if stage == layout.pp - 1 else 0
        kv_bytes = memory - weights - activations - logits - settings.overhead
        per_block = kv_bytes_per_block(block_layers, heads, spec.head_dim, bs, kv_nbytes)
        blocks = max(0, kv_bytes // per_block)
        devices.append(DeviceBudget(
            stage, memory, weights, activations, logits, settings.overhead, layers, heads,
            per_block // bs, kv_bytes, blocks, blocks * bs,
        ))

    min_blocks = min(d.kv_blocks for d in devices)
    # The engine hands out whole blocks, so a request of `context` tokens costs ceil(context / bs) of them (per
    # KV-cache group: a sliding one holds its window).
    max_concurrency = min_blocks // request_blocks(context)
    max_context = min(max_model_len, kv_capacity_tokens(min_blocks // settings.concurrency, bs, max_model_len,
                                                        groups, settings.max_num_batched_tokens))
    return Plan(
        model=spec.name,
        num_params=spec.num_params,
        dtype=settings.dtype,
        kv_dtype=kv_dtype,
        layout=layout,
        device_memory=memory,
        max_model_len=max_model_len,
        context=context,
        concurrency=settings.concurrency,
        block_size=bs,
        token_budget=settings.max_num_batched_tokens,
        max_num_seqs=settings.max_num_seqs,
        weight_bytes=spec.weight_bytes(spec.num_params, nbytes),
        kv_bytes_per_token=kv_bytes_per_token(spec.num_layers, spec.num_kv_heads, spec.head_dim, kv_nbytes),
        devices=devices,
        max_concurrency=max_concurrency,
        max_context=max_context,
        shortage=_shortage(devices, settings.concurrency * request_blocks(context), context, settings),
        notes=notes,
    )


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def _shortage(
    devices: list[DeviceBudget], blocks: int, context: int, settings: PlanSettings
) -> Shortage | None:
    """The first resource that runs out on the worst device, and the bytes per device missing for the target."""
    found = []
    for d in devices:
        kv_needed = blocks * d.kv_bytes_per_token * settings.block_size
        total = d.weights + d.headroom + kv_needed
        where = f" (pipeline stage {d.stage})" if len(devices) > 1 else ""
        target = f"{settings.concurrency} × {context} tokens"
        if d.weights > d.memory:
            found.append(Shortage("weights", total - d.memory, (
                f"weights need {gib(d.weights)} per device{where}, {gib(d.weights - d.memory)} more than the "
                f"device's {gib(d.memory)}; with runtime headroom and KV for {target} the device is "
                f"{gib(total - d.memory)} short"
            )))
        elif d.weights + d.headroom > d.memory:
            found.append(Shortage("runtime headroom", total - d.memory, (
                f"weights ({gib(d.weights)}) fit{where} but runtime headroom ({gib(d.headroom)}) does not: "
                f"{gib(d.weights + d.headroom - d.memory)} short before any KV cache, "
                f"{gib(total - d.memory)} short with KV for {target}"
            )))
        elif d.kv_bytes < kv_needed:
            found.append(Shortage("KV cache", kv_needed - d.kv_bytes, (
                f"KV for {target} needs {gib(kv_needed)} per device{where}, {gib(d.kv_bytes)} is left: "
                f"{gib(kv_needed - d.kv_bytes)} short"
            )))
    return max(found, key=lambda s: s.short_by, default=None)


# ------------------------------------------------------------------------------------- N devices compared


@dataclass
class LayoutOption:
    name: str
    layout: Layout
    plan: Plan | None  # None when the model cannot be split this way
    comm_bytes_per_token: int  # per device, per generated or prefilled token
    comm: str
    note: str
    error: str | None = None
    concurrency_groups: int = 0  # replicas whose KV holds decoding requests

    @property
    def max_concurrency(self) -> int:
        return self.plan.max_concurrency * self.concurrency_groups if self.plan else 0

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "layout": {**asdict(self.layout), "gpus": self.layout.gpus},
            "fits": bool(self.plan and self.plan.fits),
            "weights_per_device": max(d.weights for d in self.plan.devices) if self.plan else None,
            "kv_tokens_per_replica": self.plan.binding.kv_tokens if self.plan else None,
            "max_concurrency": self.max_concurrency,
            "comm_bytes_per_token": self.comm_bytes_per_token,
            "comm": self.comm,
            "note": self.note,
            "shortage": asdict(self.plan.shortage) if self.plan and self.plan.shortage else None,
            "error": self.error,
        }


def compare_layouts(spec: ModelSpec, settings: PlanSettings, gpus: int) -> list[LayoutOption]:
    """Independent replicas, TP, PP, TP×PP and prefill/decode separation on `gpus` devices, side by side."""
    act = bytes_of_dtype(settings.dtype) * spec.hidden_size  # one hidden vector, what every collective moves
    kv_token = kv_bytes_per_token(
        spec.num_layers, spec.num_kv_heads, spec.head_dim, bytes_of_dtype(settings.kv_dtype or settings.dtype)
    )

    def allreduce(tp: int, pp: int) -> int:
        # Two all-reduces per layer (after attention, after the MLP); a ring moves 2(t-1)/t of the data per device.
        return 2 * blocks_needed(spec.num_layers, pp) * act * 2 * (tp - 1) // tp

    options = [(
        "replicas", Layout(1, 1, gpus), 0, "none",
        "every device holds all weights; no communication; throughput scales with N when one device fits",
    ), (
        "tensor parallel", Layout(gpus, 1, 1), allreduce(gpus, 1), "2 all-reduces per layer per step",
        "weights and KV split N ways; all-reduces on the critical path of every step (needs NVLink-class links)",
    ), (
        "pipeline parallel", Layout(1, gpus, 1), act, "one hidden vector per token per stage boundary",
        "layers split N ways; little traffic; per-token latency not reduced and stages idle without micro-batches",
    )]
    for tp in range(2, gpus):
        if gpus % tp == 0 and gpus // tp > 1:
            options.append((
                "TP×PP", Layout(tp, gpus // tp, 1), allreduce(tp, gpus // tp) + act,
                "all-reduces inside a stage, hand-offs between",
                "TP within a node, PP across nodes: all-reduces stay on fast links",
            ))
    out = [_option(spec, settings, *o, groups=o[1].replicas) for o in options]
    if gpus >= 2 and gpus % 2 == 0:
        half = gpus // 2
        out.append(_option(
            spec, settings, "prefill/decode split", Layout(half, 1, 1), allreduce(half, 1),
            f"TP all-reduces, plus the prompt's KV ({kv_token:,} B per prompt token) moved once per request",
            f"{half} devices prefill, {half} decode (each a TP{half} group): prefills never stall decodes, "
            "but only the decode group's KV holds running requests",
            groups=1,
        ))
    return out


def _option(
    spec: ModelSpec, settings: PlanSettings, name: str, layout: Layout, comm_bytes: int, comm: str, note: str,
    groups: int,
) -> LayoutOption:
    try:
        plan = make_plan(spec, replace(settings, layout=layout))
    except ValueError as exc:
        return LayoutOption(name, layout, None, comm_bytes, comm, note, error=str(exc))
    return LayoutOption(name, layout, plan, comm_bytes, comm, note, concurrency_groups=groups)


# ------------------------------------------------------------------------------------------------ output


def render_plan(plan: Plan, options: list[LayoutOption]) -> str:
    d = plan.binding
    lay = plan.layout
    lines = [
        f"model        {plan.model}: {plan.num_params / 1e9:.3f} B parameters, weights {plan.dtype}, KV {plan.kv_dtype}",
        (f"layout       TP {lay.tp} × PP {lay.pp} × {lay.replicas} replica(s) = {lay.gpus} device(s) of "
         f"{gib(plan.device_memory)}"),
        f"target       {plan.concurrency} request(s) × {plan.context} tokens (max_model_len {plan.max_model_len})",
        "",
        f"{'per device' + (f' (stage {d.stage}: least KV room)' if lay.pp > 1 else ''):<42}{'bytes':>18}{'GiB':>10}",
    ]
    rows = [
        ("weights", d.weights),
        (f"activations ({plan.token_budget} tokens)", d.activations),
        (f"logits buffer ({plan.max_num_seqs} rows, fp32, x2)", d.logits),
        ("framework overhead (stated)", d.overhead),
        ("left for the KV cache", d.kv_bytes),
    ]
    lines += [f"  {label:<40}{value:>18,}{value / GiB:>10.2f}" for label, value in rows]
    lines += [
        "",
        (f"KV bytes per token   {plan.kv_bytes_per_token:,} for the whole model; {d.kv_bytes_per_token:,} per "
         f"device ({d.num_layers} layers × {d.num_kv_heads} KV heads)"),
        f"KV blocks            {d.kv_blocks:,} of {plan.block_size} tokens = {d.kv_tokens:,} tokens per replica",
        (f"max concurrency      {plan.max_concurrency:,} per replica at {plan.context} tokens"
         f" ({plan.max_concurrency * lay.replicas:,} over {lay.replicas} replica(s))"),
        f"max context          {plan.max_context:,} tokens per request at {plan.concurrency} concurrent",
    ]
    lines += [f"note                 {n}" for n in plan.notes]
    if plan.shortage is None:
        lines.append("fits                 yes")
    else:
        lines.append(f"DOES NOT FIT         short resource: {plan.shortage.resource}; {plan.shortage.message}")
    if options:
        lines += ["", f"{lay.gpus} devices compared (per device; concurrency at {plan.context} tokens, all replicas)"]
        lines.append(
            f"  {'layout':<22}{'devices':<16}{'fits':<6}{'weights/dev':>13}{'KV tok/replica':>16}"
            f"{'concurrency':>13}{'comm B/token/dev':>18}  what it costs and buys"
        )
        for o in options:
            shape = f"TP{o.layout.tp}×PP{o.layout.pp}×{o.layout.replicas}"
            if o.plan is None:
                lines.append(f"  {o.name:<22}{shape:<16}{'-':<6}  {o.error}")
                continue
            w = max(dev.weights for dev in o.plan.devices)
            fits = "yes" if o.plan.fits else "no"
            lines.append(
                f"  {o.name:<22}{shape:<16}{fits:<6}{gib(w):>13}{o.plan.binding.kv_tokens:>16,}"
                f"{o.max_concurrency:>13,}{o.comm_bytes_per_token:>18,}  {o.note}; comm: {o.comm}"
            )
    return "\n".join(lines)
