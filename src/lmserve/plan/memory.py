"""Memory planner: will a model and a target concurrency fit, and how should N devices be laid out?

Everything is derived from the model's config (no weights are read; plan/model_spec.py: its sizes and what one rank
of a layout holds): the parameter count it implies, the KV bytes per token, and a stated runtime headroom. The engine sizes its own KV cache with the same kv_bytes_per_block
(lmserve/kv_sizing.py), so the planner and the engine cannot disagree about what one block costs. No torch here: planning must be instant
and work where torch is not installed.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, replace

from lmserve.config import INT8_ACTIVATIONS_FROM_WEIGHTS, KV_BLOCK_SIZE, SchedulerConfig
from lmserve.config_values import GiB
from lmserve.kv_groups import kv_capacity_tokens
from lmserve.kv_sizing import blocks_needed, kv_bytes_per_block, kv_bytes_per_token
from lmserve.plan.model_spec import (
    Layout,
    ModelSpec,
    bytes_of_dtype,
    check_layout,
    kv_dtype_bytes,
    kv_heads_per_rank,
    layers_in_stage,
    stage_params,
)

# Stated, not measured: CUDA context, allocator fragmentation, communication buffers. Override with --overhead-gib.
DEFAULT_OVERHEAD_GIB = 1.0

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
    active_params: int  # what one token reads (a mixture of experts: its top-k experts, not all)
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
    stored_bits: float | None = None  # a GGUF's weights as the engine holds them (ModelSpec.stored_bits)

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
    inter = blocks_needed(max(spec.mlp_width(i, active=True) for i in range(spec.num_layers)), tp)
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
    kv_nbytes = kv_dtype_bytes(kv_dtype)
    memory = settings.device_memory if settings.device_memory is not None else machine_memory()
    for name in ("max_model_len", "context"):  # None: the model's own; 0 is no length (it was taken for None)
        if getattr(settings, name) is not None and getattr(settings, name) < 1:
            raise ValueError(f"{name} must be >= 1 (leave it out for the model's own), got {getattr(settings, name)}")
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
        notes.append(f"weights as the engine holds the file's blocks ({spec.stored_bits:.2f} bits a parameter: their "
                     "stored size, or the kernel format they convert into); on CPU a model below "
                     f"{INT8_ACTIVATIONS_FROM_WEIGHTS / 1e6:.0f} M decoder weights may also keep a 2-byte copy of "
                     "its decoder layers for prompt rows (AVX2, AMX) unless --batched-weights none")

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
        # A block holds `slots` layers where sliding layers have groups of their own; else every KV layer of the
        # stage (a hybrid linear-attention model, on one stage, only its full-attention layers).
        block_layers = groups.slots if groups.is_hybrid else (spec.kv_layers if layout.pp == 1 else layers)
        heads = kv_heads_per_rank(spec, layout.tp)
        weights = spec.weight_bytes(sum(stage_params(spec, layout, stage).values()), nbytes, layout.tp)
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
    state = spec.linear_state_bytes
    if state:
        # A hybrid model's request also holds a state slot of constant size, from the same memory as its KV.
        per_request = request_blocks(context) * devices[0].kv_bytes_per_token * bs + state
        max_concurrency = max(0, devices[0].kv_bytes) // per_request
        notes.append(f"linear-attention layers: {state / 2**20:.2f} MiB of state per request whatever its length "
                     f"(KV only for the {spec.kv_layers} full-attention layers of {spec.num_layers}); the engine "
                     f"sets aside up to --max-num-seqs ({settings.max_num_seqs}) such slots from the KV memory")
    max_context = min(max_model_len, kv_capacity_tokens(min_blocks // settings.concurrency, bs, max_model_len,
                                                        groups, settings.max_num_batched_tokens))
    return Plan(
        model=spec.name,
        num_params=spec.num_params,
        active_params=spec.active_params,
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
        kv_bytes_per_token=kv_bytes_per_token(spec.kv_layers, spec.num_kv_heads, spec.head_dim, kv_nbytes),
        devices=devices,
        max_concurrency=max_concurrency,
        max_context=max_context,
        shortage=_shortage(devices, settings.concurrency * request_blocks(context), context, settings,
                           settings.concurrency * state),
        notes=notes,
        stored_bits=spec.stored_bits,
    )


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def _shortage(
    devices: list[DeviceBudget], blocks: int, context: int, settings: PlanSettings, state_bytes: int = 0,
) -> Shortage | None:
    """The first resource that runs out on the worst device, and the bytes per device missing for the target
    (state_bytes: a hybrid model's requests' state slots, paid from the KV memory)."""
    found = []
    for d in devices:
        kv_needed = blocks * d.kv_bytes_per_token * settings.block_size + state_bytes
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
        spec.num_layers, spec.num_kv_heads, spec.head_dim, kv_dtype_bytes(settings.kv_dtype or settings.dtype)
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
        f"model        {plan.model}: {plan.num_params / 1e9:.3f} B parameters"
        + (f" ({plan.active_params / 1e9:.3f} B active a token)" if plan.active_params != plan.num_params else "")
        + f", weights {plan.dtype}, KV {plan.kv_dtype}",
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
