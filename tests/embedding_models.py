"""Tiny random encoders saved as real model directories (sentence-transformers' layout), and the reference that
embeds with transformers and the pooling the files declare (sentence-transformers itself is not a test dependency)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

# A WordPiece vocabulary of whole words, enough for the tests' texts (anything else is [UNK]).
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "a", "an", "of", "to", "in", "is", "it", "on", "and", "or", "cat", "sat", "mat", "hello", "world", "embedding", "vector", "search", "query", "document", "retrieval", "server", "model", "text", "short", "long"]
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
TINY_BERT = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
             "max_position_embeddings": 128}
ST_POOLING_KEYS = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token",
                   "last": "pooling_mode_lasttoken", "max": "pooling_mode_max_tokens"}


def bert_tokenizer() -> transformers.PreTrainedTokenizerBase:
    tokens = SPECIALS + list(WORDS) + ["##" + chr(c) for c in range(ord("a"), ord("z") + 1)]
    return transformers.BertTokenizer(vocab={token: i for i, token in enumerate(dict.fromkeys(tokens))})


def save_tiny_bert(directory: Path, pooling: str = "mean", normalize: bool = True, seed: int = 0,
                   **config_extra: object) -> Path:
    """A random BertModel with a WordPiece tokenizer, in sentence-transformers' layout: modules.json,
    1_Pooling/config.json and (with `normalize`) a Normalize module."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = bert_tokenizer()
    config = transformers.BertConfig(vocab_size=len(tokenizer), **TINY_BERT, **config_extra)
    torch.manual_seed(seed)
    model = transformers.BertModel(config)
    with torch.no_grad():  # transformers initialises norms to 1 and biases to 0, which would hide a misplaced one
        for name, param in model.named_parameters():
            if "LayerNorm" in name or name.endswith(".bias"):
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (directory / "2_Normalize").mkdir(exist_ok=True)
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_Pooling").mkdir(exist_ok=True)
    settings = {"word_embedding_dimension": config.hidden_size, **{key: False for key in ST_POOLING_KEYS.values()}}
    settings[ST_POOLING_KEYS[pooling]] = True
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(settings))
    return directory


@torch.inference_mode()
def reference_embeddings(directory: Path, texts: list[str] | list[list[int]], pooling: str = "mean",
                         normalize: bool = True) -> torch.Tensor:
    """transformers' BertModel over each text alone (no padding), pooled as sentence-transformers pools."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.BertModel.from_pretrained(directory, torch_dtype=torch.float32).eval()
    vectors = []
    for text in texts:
        ids = tokenizer(text)["input_ids"] if isinstance(text, str) else text
        hidden = model(input_ids=torch.tensor([ids])).last_hidden_state[0]
        vector = {"mean": lambda h: h.mean(0), "cls": lambda h: h[0], "last": lambda h: h[-1],
                  "max": lambda h: h.max(0).values}[pooling](hidden)
        vectors.append(torch.nn.functional.normalize(vector, dim=0) if normalize else vector)
    return torch.stack(vectors)


def save_tiny_cross_encoder(directory: Path, seed: int = 0) -> Path:
    """A random BertForSequenceClassification with one label (a reranker), as sentence-transformers' CrossEncoder
    saves one (no modules.json)."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = bert_tokenizer()
    config = transformers.BertConfig(vocab_size=len(tokenizer), **TINY_BERT, num_labels=1)
    torch.manual_seed(seed)
    model = transformers.BertForSequenceClassification(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "LayerNorm" in name or name.endswith(".bias"):
                param.add_(torch.randn_like(param) * 0.1)
            if "token_type" in name:  # make the second segment's type matter
                param.normal_(0.0, 0.5)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@torch.inference_mode()
def reference_scores(directory: Path, pairs: list[tuple[str, str]]) -> torch.Tensor:
    """sigmoid of transformers' BertForSequenceClassification logit for each pair alone (CrossEncoder's score)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.BertForSequenceClassification.from_pretrained(directory, torch_dtype=torch.float32).eval()
    return torch.stack([torch.sigmoid(model(**tokenizer(a, b, return_tensors="pt")).logits[0, 0]) for a, b in pairs])
