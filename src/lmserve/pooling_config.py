"""How an embedding model turns its hidden states into one vector, as its files say (no torch).

A sentence-transformers directory lists its modules in `modules.json`: the transformer, a Pooling module whose
`config.json` names the pooling (mean, CLS token, last token, max), optional Dense modules (EmbeddingGemma's 2_Dense and
3_Dense projections) and an optional Normalize module. A directory without those files is pooled as vLLM pools a bare
encoder: CLS token, normalised. A decoder (Qwen3-Embedding, EmbeddingGemma) is an embedding model when its directory
is in that layout; its `config_sentence_transformers.json` names the instruction prompts texts are prefixed with. `dimensions` are the Matryoshka
sizes the model declares in config.json (`matryoshka_dimensions`, or `is_matryoshka` for any size), as vLLM reads them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmserve.models import ModelSource, read_config_dict

POOLING_TYPES = ("mean", "cls", "last", "max")
# sentence-transformers' Pooling config keys -> lmserve's pooling names (its own precedence: CLS, max, mean, last).
_ST_POOLING_KEYS = (("pooling_mode_cls_token", "cls"), ("pooling_mode_max_tokens", "max"),
                    ("pooling_mode_mean_tokens", "mean"), ("pooling_mode_lasttoken", "last"))
_NORMALIZE_MODULE = "sentence_transformers.models.Normalize"
_POOLING_MODULE = "sentence_transformers.models.Pooling"
_DENSE_MODULE = "sentence_transformers.models.Dense"
# sentence-transformers' Dense activations lmserve applies (its config names the torch class).
DENSE_ACTIVATIONS = ("torch.nn.modules.linear.Identity", "torch.nn.modules.activation.Tanh")


@dataclass(frozen=True)
class DenseLayer:
    """A sentence-transformers Dense module after the pooling: activation(linear(vector)); its weights are
    `linear.weight` (and `linear.bias`) in its folder's model.safetensors."""

    path: str  # the module's folder, relative to the model's directory
    in_features: int
    out_features: int
    bias: bool
    activation: str  # one of DENSE_ACTIVATIONS


@dataclass(frozen=True)
class PoolingConfig:
    pooling: str = "cls"  # one of POOLING_TYPES
    normalize: bool = True
    # Matryoshka sizes the model was trained for: () none (a `dimensions` request is refused), ("any",) any size.
    matryoshka_dimensions: tuple[int, ...] = field(default_factory=tuple)
    any_dimensions: bool = False
    # "embed": a vector per text (/v1/embeddings); "score": a cross-encoder's relevance per pair (/v1/rerank, /v1/score).
    task: str = "embed"
    # sentence_bert_config.json's max_seq_length: the length the model was trained for, which sentence-transformers
    # cuts every text to; the server's max_model_len (as vLLM takes it). None: the model's positions decide.
    max_seq_length: int | None = None
    # sentence-transformers' Dense modules after the pooling, in order (their output is the embedding's size).
    dense: tuple[DenseLayer, ...] = ()
    # config_sentence_transformers.json's prompts: name -> the text put before an input (Qwen3-Embedding's "query"
    # instruction), and the one used when a request names none (None: no prefix).
    prompts: tuple[tuple[str, str], ...] = ()
    default_prompt_name: str | None = None
    # A decoder scoring pairs by the logits of "yes" and "no" at its prompt's last token (Qwen3-Reranker, --task
    # score): the pair is written into YES_NO_PAIR between YES_NO_PREFIX and YES_NO_SUFFIX, and relevance = sigmoid(logit(yes) - logit(no)).
    yes_no: bool = False

    def prompt(self, name: str | None) -> str:
        """The prefix for prompt `name` (None: the model's default prompt, or none). KeyError for a name the model
        does not declare."""
        name = name if name is not None else self.default_prompt_name
        return "" if name is None else dict(self.prompts)[name]

    def output_size(self, hidden_size: int) -> int:
        """The embedding's size: the last Dense module's outputs, or the model's hidden size."""
        return self.dense[-1].out_features if self.dense else hidden_size

    def accepts_dimensions(self, dimensions: int, hidden_size: int) -> bool:
        if not 1 <= dimensions <= hidden_size:
            return False
        return self.any_dimensions or dimensions in self.matryoshka_dimensions


def _st_modules(directory: Path) -> list[dict[str, Any]] | None:
    path = directory / "modules.json"
    if not path.is_file():
        return None
    modules = json.loads(path.read_text())
    if not isinstance(modules, list):
        raise ValueError(f"{path}: expected a list of modules")  # noqa: TRY004 - a bad model file, as any other
    return modules


def _st_pooling(directory: Path, module: dict[str, Any]) -> str:
    path = directory / str(module.get("path", "")) / "config.json"
    settings = json.loads(path.read_text())
    if isinstance(settings.get("pooling_mode"), str):  # newer sentence-transformers write the name itself
        name = {"lasttoken": "last", "max_tokens": "max", "mean_tokens": "mean"}.get(settings["pooling_mode"],
                                                                                    settings["pooling_mode"])
        if name in POOLING_TYPES:
            return name
    if settings.get("include_prompt") is False:
        raise ValueError(f"{path}: include_prompt false (pooling without the instruction prompt's tokens) is not "
                         "supported; lmserve pools every token of the input")
    chosen = [name for key, name in _ST_POOLING_KEYS if settings.get(key)]
    others = [key for key in ("pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
              if settings.get(key)]
    # sentence-transformers concatenates the vectors of several modes; no model people serve asks for that.
    if len(chosen) != 1 or others:
        raise ValueError(f"{path}: lmserve runs one pooling mode of {', '.join(POOLING_TYPES)}; this asks for "
                         f"{', '.join(chosen + others) or 'none'}")
    return chosen[0]


# llama.cpp's enum llama_pooling_type, which a GGUF header writes as ARCH.pooling_type (4, rank: a reranker's head).
GGUF_POOLING_TYPES = {1: "mean", 2: "cls", 3: "last"}
GGUF_RANK_POOLING = 4


# Qwen3-Reranker's prompt, as its model card builds it (vLLM's examples/offline_inference/qwen3_reranker.py too): the
# prefix's tokens, the pair's text tokenized as one string, the suffix's tokens; the score is P(yes) of the next
# token against "no".
YES_NO_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
                 "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
YES_NO_PAIR = "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"
YES_NO_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
YES_NO_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
YES_NO_TOKENS = ("no", "yes")


def load_pooling_config(source: ModelSource, task: str = "auto") -> PoolingConfig:
    """The model's pooling: sentence-transformers' modules in an HF directory, the header's pooling_type in a GGUF
    (normalised, as llama.cpp's embeddings are by default). task: ModelConfig.task (score: a Qwen3 decoder is a
    yes/no reranker)."""
    config = read_config_dict(source)
    if _is_yes_no_reranker(source, config, task):
        return PoolingConfig("last", normalize=False, task="score", yes_no=True)
    if any(str(a).endswith("ForSequenceClassification") for a in config.get("architectures") or ()):
        return PoolingConfig("cls", normalize=False, task="score")  # the [CLS] row through the classifier head
    dims = config.get("matryoshka_dimensions") or ()
    matryoshka = tuple(int(d) for d in dims) if isinstance(dims, list) else ()
    any_dims = bool(config.get("is_matryoshka")) and not matryoshka
    if source.kind != "hf":
        pooling = GGUF_POOLING_TYPES.get(int(config.get("pooling_type", 2)))
        if pooling is None:
            raise ValueError(f"{source.path}: pooling_type {config.get('pooling_type')} is not one lmserve runs "
                             f"(llama.cpp's {', '.join(f'{k} {v}' for k, v in GGUF_POOLING_TYPES.items())})")
        return PoolingConfig(pooling, True, matryoshka, any_dims)
    modules = _st_modules(source.path)
    if modules is None:
        return PoolingConfig("cls", True, matryoshka, any_dims)
    max_seq_length = _st_max_seq_length(source.path)
    kinds = [str(m.get("type", "")) for m in modules]
    unknown = [k for k in kinds if k.startswith("sentence_transformers.models.") and k not in (
        _POOLING_MODULE, _NORMALIZE_MODULE, _DENSE_MODULE, "sentence_transformers.models.Transformer")]
    if unknown:
        raise ValueError(f"{source.path}/modules.json: lmserve does not run the module(s) {', '.join(unknown)}")
    if _NORMALIZE_MODULE in kinds and kinds.index(_NORMALIZE_MODULE) != len(kinds) - 1:
        raise ValueError(f"{source.path}/modules.json: a module after Normalize is not supported")
    pooling = next((_st_pooling(source.path, m) for m in modules if m.get("type") == _POOLING_MODULE), "cls")
    dense = tuple(_st_dense(source.path, m) for m in modules if m.get("type") == _DENSE_MODULE)
    prompts, default_prompt = _st_prompts(source.path)
    return PoolingConfig(pooling, _NORMALIZE_MODULE in kinds, matryoshka, any_dims, max_seq_length=max_seq_length,
                         dense=dense, prompts=prompts, default_prompt_name=default_prompt)


def _st_dense(directory: Path, module: dict[str, Any]) -> DenseLayer:
    folder = str(module.get("path", ""))
    path = directory / folder / "config.json"
    settings = json.loads(path.read_text())
    activation = str(settings.get("activation_function", DENSE_ACTIVATIONS[0]))
    if activation not in DENSE_ACTIVATIONS:
        raise ValueError(f"{path}: the Dense activation {activation} is not one lmserve runs "
                         f"({', '.join(DENSE_ACTIVATIONS)})")
    return DenseLayer(folder, int(settings["in_features"]), int(settings["out_features"]),
                      bool(settings.get("bias", True)), activation)


def _st_prompts(directory: Path) -> tuple[tuple[tuple[str, str], ...], str | None]:
    """config_sentence_transformers.json's prompts (name -> prefix) and default_prompt_name."""
    path = directory / "config_sentence_transformers.json"
    if not path.is_file():
        return (), None
    settings = json.loads(path.read_text())
    prompts = settings.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(isinstance(v, str) for v in prompts.values()):
        raise ValueError(f"{path}: prompts must map names to texts")
    default = settings.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise ValueError(f"{path}: default_prompt_name {default!r} is not one of its prompts")
    return tuple((str(k), v) for k, v in prompts.items()), default


def _st_max_seq_length(directory: Path) -> int | None:
    path = directory / "sentence_bert_config.json"
    if not path.is_file():
        return None
    value = json.loads(path.read_text()).get("max_seq_length")
    return value if isinstance(value, int) and value > 0 else None


def _is_yes_no_reranker(source: ModelSource, config: dict[str, Any], task: str) -> bool:
    """A Qwen3 decoder that is not an embedding model is a yes/no reranker under --task score, or, under auto, where
    its files say so as llama.cpp's converter reads them (Qwen3Model._is_qwen3_reranker: README.md's "# Qwen3-Reranker"
    title, or "qwen3-reranker" in the directory's or _name_or_path's name). --task score on a model that can score no
    way raises, naming it."""
    from lmserve.config import DECODER_RERANKER_MODEL_TYPES, POOLING_MODEL_TYPES

    model_type = config.get("model_type")
    st_layout = source.kind == "hf" and (source.path / "modules.json").is_file()
    # llama.cpp's converter writes a Qwen3-Reranker as a qwen3 with pooling type rank and the two rows (cls.output).
    gguf_rank = source.kind == "gguf" and config.get("pooling_type") == GGUF_RANK_POOLING
    if task != "score":
        return model_type in DECODER_RERANKER_MODEL_TYPES and not st_layout and (
            gguf_rank or _named_qwen3_reranker(source, config))
    if model_type in DECODER_RERANKER_MODEL_TYPES and not st_layout:
        if source.kind != "hf" and not gguf_rank:
            raise ValueError(f"{source.path}: a {model_type} GGUF file scores only as llama.cpp's converter writes a "
                             "Qwen3-Reranker (pooling type rank, cls.output)")
        return True
    if model_type not in POOLING_MODEL_TYPES and not st_layout:
        raise ValueError(f"{source.path}: --task score runs cross-encoders (...ForSequenceClassification of "
                         f"bert, xlm-roberta, mpnet) and Qwen3 yes/no rerankers, not {model_type}")
    return False


def _named_qwen3_reranker(source: ModelSource, config: dict[str, Any]) -> bool:
    if source.kind != "hf":
        return False
    readme = source.path / "README.md"
    if readme.is_file() and "# qwen3-reranker" in readme.read_text(errors="replace").lower():
        return True
    names = (source.path.name, str(config.get("_name_or_path", "")))
    return any("qwen3-reranker" in name.lower() for name in names)


def is_pooling_model(source: ModelSource, task: str = "auto") -> bool:
    """Whether the server runs the model as a pooling runner: an encoder (config.POOLING_MODEL_TYPES), a decoder of
    config.DECODER_EMBEDDING_MODEL_TYPES in sentence-transformers' layout (modules.json: Qwen3-Embedding,
    EmbeddingGemma), or with task "score" a Qwen3 yes/no reranker (Qwen3-Reranker)."""
    from lmserve.config import DECODER_EMBEDDING_MODEL_TYPES, POOLING_MODEL_TYPES

    config = read_config_dict(source)
    model_type = config.get("model_type")
    if model_type in POOLING_MODEL_TYPES or _is_yes_no_reranker(source, config, task):
        return True
    classifier = next((a for a in config.get("architectures") or () if str(a).endswith("ForSequenceClassification")),
                      None)
    if classifier is not None:  # a decoder's classification head (a converted Qwen3-Reranker): not served yet
        raise ValueError(f"{source.path}: {classifier} is not served yet (lmserve scores with encoder cross-encoders "
                         "and, with --task score, with the original Qwen3-Reranker's yes/no logits)")
    if model_type not in DECODER_EMBEDDING_MODEL_TYPES:
        return False
    if source.kind == "gguf":  # llama.cpp's converter writes the pooling of a sentence-transformers directory
        return int(config.get("pooling_type", 0)) in GGUF_POOLING_TYPES
    return (source.path / "modules.json").is_file()
