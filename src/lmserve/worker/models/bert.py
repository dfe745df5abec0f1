"""BERT as an encoder for embeddings (sentence-transformers' all-MiniLM, BGE, E5...): bidirectional attention over each
sequence, post-norm layers, learned absolute positions. Module names are transformers' BertModel's, so a checkpoint
(a bare BertModel, or the `bert.` of a BertFor... head) loads by name.

Two more families are this same encoder, and run here rather than in copies of it:
- XLM-RoBERTa (multilingual-e5, bge-m3, bge-reranker): BERT whose learned positions start after the padding id
  (transformers' create_position_ids_from_input_ids: position i of an unpadded sequence is pad_token_id + 1 + i), with
  one token type. Its checkpoints use BERT's names under `roberta.`.
- MPNet (all-mpnet-base-v2): the same, with positions from padding id 1 and no token types, and T5's bucketed relative
  position bias added to every layer's attention scores (one table of buckets x heads, shared by the layers). Its
  module names differ (attention.attn.q/k/v/o, attention.LayerNorm) and are renamed to BERT's on load.

The batch is flat, as the decoder's: one row per token of every sequence, the linear layers over all rows at once,
attention within each sequence on its own (no padding, and a row's result does not depend on its neighbours). No KV
cache: an encoder computes each request once (worker/pooling_runner.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from lmserve.formats.gguf_file import ggml_type_name, read_gguf_header, read_gguf_tensor
from lmserve.worker.models.layers import (
    Linear,  # nn.Linear whose float32 CPU products go through NumPy's BLAS
)

GGUF_FLOAT_TYPES = frozenset({"F32", "F16", "BF16"})
# llama.cpp's names of a bert's tensors (its LLM_ARCH_BERT) -> BertModel's.
_GGUF_BERT_TOP = {"token_embd": "embeddings.word_embeddings", "position_embd": "embeddings.position_embeddings",
                  "token_types": "embeddings.token_type_embeddings", "token_embd_norm": "embeddings.LayerNorm"}
_GGUF_BERT_LAYER = {"attn_q": "attention.self.query", "attn_k": "attention.self.key", "attn_v": "attention.self.value",
                    "attn_output": "attention.output.dense", "attn_output_norm": "attention.output.LayerNorm",
                    "ffn_up": "intermediate.dense", "ffn_down": "output.dense",
                    "layer_output_norm": "output.LayerNorm"}


def load_gguf_floats(module: nn.Module, path: Path, our_name: Callable[[str], str | None], what: str) -> None:
    """Every parameter of `module` from a GGUF file, each tensor under the name our_name gives it (None: not one of
    ours); a missing or mis-shaped one raises. Float weights only (F32, F16, BF16): a block-format tensor is refused
    rather than turned into a float copy several times its stored size, until the encoders run block formats in
    their stored bytes as the decoders do."""
    params = dict(module.named_parameters())
    loaded = set()
    for info in read_gguf_header(path).tensors:
        name = our_name(info.name)
        param = None if name is None else params.get(name)
        if param is None:
            continue
        stored = ggml_type_name(info.ggml_type)
        if stored not in GGUF_FLOAT_TYPES:
            raise ValueError(f"{path}: {info.name} is stored as {stored}; lmserve runs embedding models from "
                             "float GGUF files (F32, F16, BF16) only so far: use the model's F16 file")
        values = torch.from_numpy(read_gguf_tensor(path, info).copy())
        if tuple(values.shape) != tuple(param.shape):
            raise ValueError(f"{path}: {info.name} has shape {tuple(values.shape)}, expected {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(values)
        loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"{path} lacks {len(missing)} {what} tensor(s): {', '.join(missing[:5])}")


def gguf_bert_name(name: str) -> str | None:
    """BertModel's name of a llama.cpp bert tensor ("blk.3.attn_q.weight" -> "encoder.layer.3.attention.self.query.
    weight"), or None."""
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _GGUF_BERT_LAYER:
        return f"encoder.layer.{parts[1]}.{_GGUF_BERT_LAYER[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GGUF_BERT_TOP:
        return f"{_GGUF_BERT_TOP[parts[0]]}.{parts[1]}"
    return None

# transformers' names for the activations BERT configs use (its ACT2FN), without importing transformers in the engine.
ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}

# The weights a BertModel checkpoint holds that an embedding does not use: the [CLS] pooler head (sentence-
# transformers pools by its own module), a masked-LM head, the position ids buffer some checkpoints save.
UNUSED_PREFIXES = ("pooler.", "cls.", "lm_head.", "embeddings.position_ids", "embeddings.token_type_ids")
# The encoder families this module runs (config model_type), and the prefix their BertFor... heads put on its names.
ENCODER_PREFIXES = {"bert": "bert.", "xlm-roberta": "roberta.", "roberta": "roberta.", "mpnet": "mpnet."}
# MPNet's names for BERT's modules (transformers' MPNetLayer).
_MPNET_NAMES = ((".attention.attn.q.", ".attention.self.query."), (".attention.attn.k.", ".attention.self.key."),
                (".attention.attn.v.", ".attention.self.value."), (".attention.attn.o.", ".attention.output.dense."),
                (".attention.LayerNorm.", ".attention.output.LayerNorm."))


def position_offset(config) -> int:
    """The learned position row of a sequence's first token: 0 for BERT; pad_token_id + 1 for XLM-RoBERTa and MPNet
    (MPNet's padding id is 1 whatever its config says), whose position tables keep rows for the padding id."""
    if config.model_type == "mpnet":
        return 2
    if config.model_type in ("xlm-roberta", "roberta"):
        return int(config.pad_token_id) + 1
    return 0


def max_sequence_length(config) -> int:
    """Tokens a sequence may hold: the learned positions after the offset (XLM-R's 514 rows hold 512 tokens)."""
    return int(config.max_position_embeddings) - position_offset(config)


class BertEmbeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        # MPNet has no token types.
        types = getattr(config, "type_vocab_size", 0) if config.model_type != "mpnet" else 0
        self.token_type_embeddings = nn.Embedding(types, config.hidden_size) if types else None
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.position_offset = position_offset(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_types: torch.Tensor | None = None) -> torch.Tensor:
        # One text: token type 0 everywhere (sentence-transformers encodes one text at a time); a cross-encoder's
        # pair: 1 for the second text's rows.
        hidden = self.word_embeddings(input_ids) + self.position_embeddings(positions + self.position_offset)
        if self.token_type_embeddings is None:
            return self.LayerNorm(hidden)
        types = self.token_type_embeddings.weight[0] if token_types is None else self.token_type_embeddings(token_types)
        return self.LayerNorm(hidden + types)


class BertSelfAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.query = Linear(config.hidden_size, config.hidden_size)
        self.key = Linear(config.hidden_size, config.hidden_size)
        self.value = Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden: torch.Tensor, seq_lens: list[int],
                biases: list[torch.Tensor] | None = None) -> torch.Tensor:
        return encoder_attention(self.query(hidden), self.key(hidden), self.value(hidden), seq_lens, self.num_heads,
                                 biases)


def encoder_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: list[int],
                      num_heads: int, biases: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Bidirectional attention of each sequence's rows over its own rows: q, k, v [rows, heads * head_dim]; biases:
    per sequence, [heads, n, n] added to its scores (MPNet's relative positions), or None."""
    out = torch.empty_like(q)
    start = 0
    for i, n in enumerate(seq_lens):
        rows = slice(start, start + n)
        # [n, heads * d] -> [heads, n, d]
        qs, ks, vs = (t[rows].view(n, num_heads, -1).transpose(0, 1) for t in (q, k, v))
        bias = None if biases is None else biases[i].to(q.dtype)
        out[rows] = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=bias).transpose(0, 1).reshape(n, -1)
        start += n
    return out


def relative_position_buckets(length: int, num_buckets: int, max_distance: int = 128) -> torch.Tensor:
    """[length, length] T5's bidirectional bucket of each (query, key) pair, as transformers' MPNet computes it: half
    the buckets for keys after the query, exact distances below a quarter of the buckets, logarithmic ones up to
    max_distance beyond."""
    position = torch.arange(length)
    relative = position[None, :] - position[:, None]  # key - query
    n = -relative
    half = num_buckets // 2
    bucket = (n < 0).long() * half
    n = n.abs()
    max_exact = half // 2
    large = max_exact + (torch.log(n.float() / max_exact) / math.log(max_distance / max_exact)
                         * (half - max_exact)).long()
    large = torch.minimum(large, torch.full_like(large, half - 1))
    return bucket + torch.where(n < max_exact, n, large)


class BertSelfOutput(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.dense = Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(hidden) + residual)


class BertAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config)

    def forward(self, hidden: torch.Tensor, seq_lens: list[int],
                biases: list[torch.Tensor] | None = None) -> torch.Tensor:
        return self.output(self.self(hidden, seq_lens, biases), hidden)


class BertIntermediate(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.dense = Linear(config.hidden_size, config.intermediate_size)
        if config.hidden_act not in ACTIVATIONS:
            raise ValueError(f"BERT with hidden_act {config.hidden_act!r} is not supported ({', '.join(ACTIVATIONS)})")
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(hidden))


class BertOutput(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.dense = Linear(config.intermediate_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(hidden) + residual)


class BertLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config)

    def forward(self, hidden: torch.Tensor, seq_lens: list[int],
                biases: list[torch.Tensor] | None = None) -> torch.Tensor:
        attended = self.attention(hidden, seq_lens, biases)
        return self.output(self.intermediate(attended), attended)


class BertEncoder(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))
        # MPNet: one relative position bias table for all layers.
        self.relative_attention_bias = nn.Embedding(config.relative_attention_num_buckets,
                                                    config.num_attention_heads) \
            if config.model_type == "mpnet" else None

    def position_biases(self, seq_lens: list[int]) -> list[torch.Tensor] | None:
        """Per sequence, [heads, n, n] relative position bias (MPNet's), computed once for every layer; None for BERT."""
        if self.relative_attention_bias is None:
            return None
        by_length: dict[int, torch.Tensor] = {}
        for n in dict.fromkeys(seq_lens):
            buckets = relative_position_buckets(n, self.relative_attention_bias.num_embeddings)
            by_length[n] = self.relative_attention_bias(buckets.to(self.relative_attention_bias.weight.device)
                                                        ).permute(2, 0, 1)
        return [by_length[n] for n in seq_lens]


class BertModel(nn.Module):
    """Hidden states [rows, hidden] of a flat batch of whole sequences (input_ids, positions: [rows]; seq_lens: the
    sequences' lengths in row order)."""

    def __init__(self, config) -> None:
        super().__init__()
        if config.model_type not in ENCODER_PREFIXES:
            raise ValueError(f"{config.model_type!r} is not an encoder of the BERT family ({', '.join(ENCODER_PREFIXES)})")
        if getattr(config, "position_embedding_type", "absolute") not in (None, "absolute"):
            raise ValueError(f"{config.model_type} with {config.position_embedding_type} position embeddings is not "
                             "supported")
        self.model_type = config.model_type
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, seq_lens: list[int],
                token_types: torch.Tensor | None = None) -> torch.Tensor:
        """positions: each token's place in its sequence from 0 (the embeddings add the family's offset)."""
        hidden = self.embeddings(input_ids, positions, token_types)
        biases = self.encoder.position_biases(seq_lens)
        for layer in self.encoder.layer:
            hidden = layer(hidden, seq_lens, biases)
        return hidden

    def checkpoint_name(self, name: str) -> str:
        """A checkpoint's tensor name as this module names it: the BertFor... head's prefix dropped, MPNet's module
        names turned into BERT's."""
        name = name.removeprefix(ENCODER_PREFIXES[self.model_type])
        if self.model_type == "mpnet":
            for theirs, ours in _MPNET_NAMES:
                name = name.replace(theirs, ours)
        return name

    def load_gguf(self, path: Path) -> None:
        """From a GGUF file of llama.cpp's bert (F32/F16/BF16 tensors); a classifier head (a reranker) is refused."""
        if any(t.name.startswith("cls.") for t in read_gguf_header(path).tensors):
            raise ValueError(f"{path}: a bert reranker (classification head) from GGUF is not served yet; use its "
                             "Hugging Face directory")
        load_gguf_floats(self, path, gguf_bert_name, "bert")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """By transformers' names; a BertFor... checkpoint's `bert.` prefix is dropped and its heads skipped. Every
        parameter must come: a missing one raises."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = self.checkpoint_name(name)
            if name.startswith(UNUSED_PREFIXES) or name not in params:
                continue
            with torch.no_grad():
                params[name].copy_(tensor)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} {self.model_type} weight(s): "
                             f"{', '.join(missing[:5])}")


class BertCrossEncoder(nn.Module):
    """A ...ForSequenceClassification with one label (a reranker: ms-marco MiniLM and BGE-reranker of the BERT kind,
    bge-reranker-v2-m3 of the XLM-RoBERTa kind): the first row ([CLS], <s>) through a dense layer, tanh and the
    classifier; relevance = sigmoid(logit), as sentence-transformers' CrossEncoder and vLLM's score give it. BERT's
    dense layer is its pooler; RoBERTa's and MPNet's classification head holds both (classifier.dense, .out_proj)."""

    def __init__(self, config) -> None:
        super().__init__()
        if getattr(config, "num_labels", 1) != 1:
            raise ValueError(f"a sequence classifier with {config.num_labels} labels: lmserve serves rerankers (one "
                             "label, a relevance score)")
        self.bert = BertModel(config)
        self.pooler_dense = Linear(config.hidden_size, config.hidden_size)
        self.classifier = Linear(config.hidden_size, 1)
        dense, out = ("bert.pooler.dense", "classifier") if config.model_type == "bert" \
            else ("classifier.dense", "classifier.out_proj")
        self.head_names = {f"{dense}.weight": "pooler_dense.weight", f"{dense}.bias": "pooler_dense.bias",
                           f"{out}.weight": "classifier.weight", f"{out}.bias": "classifier.bias"}

    def scores(self, hidden: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        """One relevance in [0, 1] per sequence, from hidden [rows, hidden] of sequences one after another."""
        starts = torch.tensor([0, *seq_lens[:-1]], device=hidden.device).cumsum(0)
        cls_rows = hidden[starts]
        return torch.sigmoid(self.classifier(torch.tanh(self.pooler_dense(cls_rows))).float())

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        found: set[str] = set()

        def encoder_weights() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name in self.head_names:
                    with torch.no_grad():
                        params[self.head_names[name]].copy_(tensor)
                    found.add(name)
                else:
                    yield name, tensor

        self.bert.load_weights(encoder_weights())
        if missing := sorted(set(self.head_names) - found):
            raise ValueError(f"the checkpoint lacks the classification head's {', '.join(missing)}")
