"""What the planner knows of a model and of a split of it: the config's sizes (no weights read), from a local model, a
config file or one of the shipped configs (plan/configs/), so that planning works offline and without torch; the
splits the engine runs (check_layout, which `lmserve serve` uses too) and what one rank of a layout holds."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from lmserve.config import (
    FULL_QK_NORM_MODEL_TYPES,
    GEMMA_MODEL_TYPES,
    HYBRID_MODEL_TYPES,
    QK_NORM_MODEL_TYPES,
    QKV_BIAS_MODEL_TYPES,
    SUPPORTED_MODEL_TYPES,
    default_layer_types,
)
from lmserve.kv_groups import KVCacheGroups, kv_cache_groups
from lmserve.kv_sizing import INT8_KV, blocks_needed
from lmserve.moe_shape import MoeShape, moe_shape

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
LINEAR_ATTENTION = "linear_attention"
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


# The engine's 8-bit KV caches: int8, and vLLM's fp8 names, which it stores as int8 (worker/attention.py).
INT8_KV_NAMES = ("int8", "fp8", "fp8_e4m3", "fp8_e5m2")


def kv_dtype_bytes(name: str) -> int | str:
    """What lmserve.kv_sizing takes for a KV cache dtype: its bytes per value, or INT8_KV (values and scales)."""
    if name in INT8_KV_NAMES:
        return INT8_KV
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown KV cache dtype {name!r}: use one of {', '.join(DTYPE_BYTES)}, int8 (or vLLM's "
                         f"{', '.join(INT8_KV_NAMES[1:])}, stored as int8)")
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
    # A mixture of experts' routing (lmserve.moe_shape): memory counts every expert, time the ones a token reads.
    moe: MoeShape | None = None

    # A hybrid model's linear-attention layers (Qwen3.5, Qwen3-Next): no KV, but a state of these bytes per request
    # (float32 conv and recurrent states of every linear layer, constant in the request's length), and the sizes of
    # one linear layer's weights: (key heads, value heads, key head dim, value head dim, conv kernel).
    linear_state_bytes: int = 0
    linear_shape: tuple[int, int, int, int, int] | None = None

    @property
    def kv_layers(self) -> int:
        """Layers that keep KV (all but a hybrid model's linear-attention layers)."""
        return sum(1 for kind in self.layer_types if kind != LINEAR_ATTENTION) if self.layer_types else self.num_layers

    def kv_groups(self, hybrid: bool = True) -> KVCacheGroups:
        kinds = [kind for kind in self.layer_types if kind != LINEAR_ATTENTION] or ["full_attention"] * self.kv_layers
        return kv_cache_groups(kinds, self.sliding_window, hybrid)
    # Bits a parameter as the engine holds a GGUF's weights (a Q4_K_M file: ~5, its stored size; an IQ4_NL file more:
    # q8_0 blocks, gguf_file.gguf_held_bits); None for float checkpoints, whose weights take the plan's dtype.
    stored_bits: float | None = None
    # The GGUF file itself, where stored_bits came from one: under tensor parallel some matrices' slices no longer
    # split into whole blocks and load as float16, so the bits a parameter depend on -tp (gguf_held_bits(path, tp)).
    gguf_path: str | None = None

    def weight_bytes(self, params: int, dtype_bytes: int, tp: int = 1) -> int:
        """What `params` of this model's parameters take in memory with weights of `dtype_bytes` (a file's stored
        size where it has one, as `tp` ranks hold it)."""
        if not self.stored_bits:
            return params * dtype_bytes
        bits = self.stored_bits
        if tp > 1 and self.gguf_path is not None:
            from lmserve.formats.gguf_file import gguf_held_bits

            bits = gguf_held_bits(Path(self.gguf_path), tp)
        return int(params * bits / 8)

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
            qkv_bias=model_type in QKV_BIAS_MODEL_TYPES or bool(cfg.get("attention_bias", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 2048),
            qk_norm=model_type in QK_NORM_MODEL_TYPES,
            norms_per_layer=4 if model_type in GEMMA_MODEL_TYPES else 2,
            layer_types=tuple(cfg.get("layer_types") or default_layer_types(
                model_type, int(cfg["num_hidden_layers"]), cfg.get("sliding_window"))),
            sliding_window=cfg.get("sliding_window"),
            moe=moe_shape(cfg),
            **_linear_attention(model_type, cfg),
        )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def num_params(self) -> int:
        return sum(stage_params(self, Layout(), 0).values())

    @property
    def decoder_linear_weights(self) -> int:
        """The whole model's q, k, v, o, gate, up and down weights: what --block-activations auto decides by
        (worker/models/llama.decoder_linear_weights, from the same config)."""
        kv_size = self.num_kv_heads * self.head_dim
        attention = self.hidden_size * (2 * self.q_size + 2 * kv_size)
        return sum(attention + 3 * self.hidden_size * self.mlp_width(i, active=True) for i in range(self.num_layers))

    def mlp_width(self, layer: int, active: bool = False) -> int:
        """Layer `layer`'s MLP columns: a dense layer's; a MoE layer's every expert's (active: the top-k and the
        shared expert's, what one token reads)."""
        if self.moe is None:
            return self.intermediate_size
        if not self.moe.is_moe_layer(layer):
            return self.moe.dense_intermediate
        experts = self.moe.top_k if active else self.moe.num_experts
        return experts * self.moe.expert_intermediate + self.moe.shared_intermediate

    @property
    def active_params(self) -> int:
        """The parameters one token reads: all of a dense model's; a MoE's attention, top-k and shared experts,
        routers, embedding and head (what a decode step's time scales with)."""
        if self.moe is None:
            return self.num_params
        return self.num_params - 3 * self.hidden_size * sum(
            self.mlp_width(i) - self.mlp_width(i, active=True) for i in range(self.num_layers))


def _linear_attention(model_type: str, cfg: dict) -> dict:
    """A hybrid model's linear layers' per-request state bytes and weight shape (worker/models/gated_deltanet.py)."""
    if model_type not in HYBRID_MODEL_TYPES:
        return {}
    k_heads, v_heads = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
    k_dim, v_dim = int(cfg["linear_key_head_dim"]), int(cfg["linear_value_head_dim"])
    kernel = int(cfg.get("linear_conv_kernel_dim") or 4)
    kinds = cfg.get("layer_types") or []
    num_linear = sum(1 for kind in kinds if kind == LINEAR_ATTENTION)
    conv_channels = 2 * k_heads * k_dim + v_heads * v_dim
    state = 4 * num_linear * (conv_channels * (kernel - 1) + v_heads * k_dim * v_dim)
    return {"linear_state_bytes": state, "linear_shape": (k_heads, v_heads, k_dim, v_dim, kernel)}


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
        from lmserve.formats.gguf_file import gguf_held_bits

        source = resolve_model(model)
        spec = ModelSpec.from_hf_dict(model, read_config_dict(source))
        return replace(spec, stored_bits=gguf_held_bits(source.path), gguf_path=str(source.path)) \
            if source.kind == "gguf" else spec
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
    with this same function, plan/layout.py): TP divides the attention heads and the MLP's intermediate size, and
    divides the KV heads (each rank caches whole heads of its own) or is a multiple of them (each KV head replicated
    on TP / KV heads ranks, as vLLM does); PP gives every stage at least one layer."""
    tp, pp = layout.tp, layout.pp
    if min(tp, pp, layout.replicas) < 1:
        raise ValueError(f"-tp, -pp and -dp must be >= 1, got {tp}, {pp} and {layout.replicas}")
    if spec.linear_state_bytes and (tp > 1 or pp > 1):
        raise ValueError(f"{spec.name} is a hybrid linear-attention model ({spec.model_type}): it runs on one rank "
                         "(-tp 1 -pp 1) for now; use -dp for more")
    sizes = {"attention heads": spec.num_heads, "KV heads": spec.num_kv_heads,
             "MLP intermediate size": spec.intermediate_size if spec.moe is None else spec.moe.expert_intermediate}
    if spec.moe is not None and spec.moe.shared_intermediate:
        sizes["shared expert intermediate size"] = spec.moe.shared_intermediate

    def splits(size: int) -> list[str]:
        return [f"{n} {what}" if what.endswith("heads") else f"{what} {n}" for what, n in sizes.items()
                if n % size and not (what == "KV heads" and size % n == 0)]

    undivided = splits(tp)
    if undivided:
        common = math.gcd(spec.num_heads, spec.intermediate_size)
        fitting = ", ".join(str(d) for d in range(1, common + 1) if common % d == 0 and not splits(d))
        raise ValueError(f"-tp {tp} does not divide the {' / '.join(undivided)} of {spec.name}; "
                         f"sizes that do: {fitting}")
    if pp > spec.num_layers:
        raise ValueError(f"-pp {pp} is more stages than the {spec.num_layers} layers of {spec.name}; "
                         f"at most {spec.num_layers}")


def _linear_layer_params(spec: ModelSpec) -> int:
    """One Gated DeltaNet layer: in_proj (q, k, v, z, b, a), the depthwise conv, out_proj, the gated norm, A and dt."""
    k_heads, v_heads, k_dim, v_dim, kernel = spec.linear_shape
    conv = 2 * k_heads * k_dim + v_heads * v_dim
    value = v_heads * v_dim
    return spec.hidden_size * (conv + value + 2 * v_heads) + conv * kernel + value * spec.hidden_size + v_dim \
        + 2 * v_heads


def kv_heads_per_rank(spec: ModelSpec, tp: int) -> int:
    # A TP that the KV heads do not divide is a multiple of them (check_layout): each rank holds one, replicated.
    return max(1, spec.num_kv_heads // tp)


def layers_in_stage(num_layers: int, pp: int, stage: int) -> int:
    return num_layers // pp + (1 if stage < num_layers % pp else 0)


def stage_params(spec: ModelSpec, layout: Layout, stage: int) -> dict[str, int]:
    """Parameters held by one tensor-parallel rank of a pipeline stage, by part."""
    tp, h = layout.tp, spec.hidden_size
    q = spec.q_size // tp
    kv = kv_heads_per_rank(spec, tp) * spec.head_dim
    attention = h * (q + 2 * kv) + q * h + ((q + 2 * kv) if spec.qkv_bias else 0)
    qk_norms = 2 * spec.head_dim if spec.qk_norm else 0  # replicated on every rank, as the other norms
    if spec.model_type in FULL_QK_NORM_MODEL_TYPES:  # OLMoE: one weight over all of q's heads and all of k's
        qk_norms = q + kv
    first_layer = sum(layers_in_stage(spec.num_layers, layout.pp, s) for s in range(stage))
    layers = 0
    for index in range(first_layer, first_layer + layers_in_stage(spec.num_layers, layout.pp, stage)):
        # q/k/v/o, gate/up/down (every expert's, each split by columns), norms, a MoE layer's router and shared gate
        mlp = 3 * h * blocks_needed(spec.mlp_width(index), tp)
        if spec.moe is not None and spec.moe.is_moe_layer(index):
            mlp += h * spec.moe.num_experts + (h if spec.moe.shared_intermediate else 0)
        if spec.linear_shape is not None:  # a hybrid model: one tensor rank (check_layout)
            mixer = (_linear_layer_params(spec) if spec.layer_types[index] == LINEAR_ATTENTION
                     else attention + q * h + qk_norms)  # full attention: q_proj also gives each head's output gate
        else:
            mixer = attention + qk_norms
        layers += mixer + mlp + spec.norms_per_layer * h
    embedding = blocks_needed(spec.vocab_size, tp) * h  # vocabulary-parallel under TP
    first, last = stage == 0, stage == layout.pp - 1
    # Tied embeddings under PP: the last stage keeps its own copy of the embedding to serve as the head.
    head = embedding if last and (not spec.tie_word_embeddings or not first) else 0
    return {
        "embedding": embedding if first else 0,
        "layers": layers,
        "final_norm_and_head": (h + head) if last else 0,
    }
