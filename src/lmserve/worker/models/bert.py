"""BERT as an encoder for embeddings (sentence-transformers' all-MiniLM, BGE, E5...): bidirectional attention over each
sequence, post-norm layers, learned absolute positions. Module names are transformers' BertModel's, so a checkpoint
(a bare BertModel, or the `bert.` of a BertFor... head) loads by name.

The batch is flat, as the decoder's: one row per token of every sequence, the linear layers over all rows at once,
attention within each sequence on its own (no padding, and a row's result does not depend on its neighbours). No KV
cache: an encoder computes each request once (worker/pooling_runner.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from lmserve.worker.models.layers import (
    Linear,  # nn.Linear whose float32 CPU products go through NumPy's BLAS
)

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
UNUSED_PREFIXES = ("pooler.", "cls.", "embeddings.position_ids")


class BertEmbeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_types: torch.Tensor | None = None) -> torch.Tensor:
        # One text: token type 0 everywhere (sentence-transformers encodes one text at a time); a cross-encoder's
        # pair: 1 for the second text's rows.
        hidden = self.word_embeddings(input_ids) + self.position_embeddings(positions)
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

    def forward(self, hidden: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        return encoder_attention(self.query(hidden), self.key(hidden), self.value(hidden), seq_lens, self.num_heads)


def encoder_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: list[int],
                      num_heads: int) -> torch.Tensor:
    """Bidirectional attention of each sequence's rows over its own rows: q, k, v [rows, heads * head_dim]."""
    out = torch.empty_like(q)
    start = 0
    for n in seq_lens:
        rows = slice(start, start + n)
        # [n, heads * d] -> [heads, n, d]
        qs, ks, vs = (t[rows].view(n, num_heads, -1).transpose(0, 1) for t in (q, k, v))
        out[rows] = F.scaled_dot_product_attention(qs, ks, vs).transpose(0, 1).reshape(n, -1)
        start += n
    return out


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

    def forward(self, hidden: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        return self.output(self.self(hidden, seq_lens), hidden)


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

    def forward(self, hidden: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        attended = self.attention(hidden, seq_lens)
        return self.output(self.intermediate(attended), attended)


class BertEncoder(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))


class BertModel(nn.Module):
    """Hidden states [rows, hidden] of a flat batch of whole sequences (input_ids, positions: [rows]; seq_lens: the
    sequences' lengths in row order)."""

    def __init__(self, config) -> None:
        super().__init__()
        if getattr(config, "position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"BERT with {config.position_embedding_type} position embeddings is not supported")
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, seq_lens: list[int],
                token_types: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.embeddings(input_ids, positions, token_types)
        for layer in self.encoder.layer:
            hidden = layer(hidden, seq_lens)
        return hidden

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """By transformers' names; a BertFor... checkpoint's `bert.` prefix is dropped and its heads skipped. Every
        parameter must come: a missing one raises."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("bert.")
            if name.startswith(UNUSED_PREFIXES) or name not in params:
                continue
            with torch.no_grad():
                params[name].copy_(tensor)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} BERT weight(s): {', '.join(missing[:5])}")


class BertCrossEncoder(nn.Module):
    """BertForSequenceClassification with one label (a reranker: ms-marco MiniLM, BGE-reranker of the BERT kind): the
    [CLS] row through the pooler (dense, tanh) and the classifier; relevance = sigmoid(logit), as sentence-transformers'
    CrossEncoder and vLLM's score give it."""

    def __init__(self, config) -> None:
        super().__init__()
        if getattr(config, "num_labels", 1) != 1:
            raise ValueError(f"a sequence classifier with {config.num_labels} labels: lmserve serves rerankers (one "
                             "label, a relevance score)")
        self.bert = BertModel(config)
        self.pooler_dense = Linear(config.hidden_size, config.hidden_size)
        self.classifier = Linear(config.hidden_size, 1)

    def scores(self, hidden: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        """One relevance in [0, 1] per sequence, from hidden [rows, hidden] of sequences one after another."""
        starts = torch.tensor([0, *seq_lens[:-1]], device=hidden.device).cumsum(0)
        cls_rows = hidden[starts]
        return torch.sigmoid(self.classifier(torch.tanh(self.pooler_dense(cls_rows))).float())

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        head = {"bert.pooler.dense.weight": self.pooler_dense.weight, "bert.pooler.dense.bias": self.pooler_dense.bias,
                "classifier.weight": self.classifier.weight, "classifier.bias": self.classifier.bias}
        found: set[str] = set()

        def encoder_weights() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name in head:
                    with torch.no_grad():
                        head[name].copy_(tensor)
                    found.add(name)
                else:
                    yield name, tensor

        self.bert.load_weights(encoder_weights())
        if missing := sorted(set(head) - found):
            raise ValueError(f"the checkpoint lacks the classification head's {', '.join(missing)}")
