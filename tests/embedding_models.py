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


def xlm_roberta_tokenizer() -> transformers.PreTrainedTokenizerBase:
    """A Unigram tokenizer of whole words with XLM-R's special tokens (<s> 0, <pad> 1, </s> 2, <unk> 3)."""
    pieces = [("<s>", 0.0), ("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    pieces += [("\u2581" + word, -1.0) for word in WORDS] + [(chr(c), -5.0) for c in range(ord("a"), ord("z") + 1)]
    pieces.append(("<mask>", 0.0))
    return transformers.XLMRobertaTokenizer(vocab=pieces)


def mpnet_tokenizer() -> transformers.PreTrainedTokenizerBase:
    """MPNet's WordPiece tokenizer with its special tokens (<s> 0, <pad> 1: the padding id its positions skip)."""
    tokens = ["<s>", "<pad>", "</s>", "[UNK]", "<mask>", *WORDS] + ["##" + chr(c) for c in range(ord("a"), ord("z") + 1)]
    return transformers.MPNetTokenizer(vocab={token: i for i, token in enumerate(dict.fromkeys(tokens))})


# Each encoder family: its tokenizer, config class, and the model classes of an embedder and a cross-encoder.
ENCODER_FAMILIES = {
    "bert": (bert_tokenizer, transformers.BertConfig, transformers.BertModel,
             transformers.BertForSequenceClassification),
    "xlm-roberta": (xlm_roberta_tokenizer, transformers.XLMRobertaConfig, transformers.XLMRobertaModel,
                    transformers.XLMRobertaForSequenceClassification),
    "mpnet": (mpnet_tokenizer, transformers.MPNetConfig, transformers.MPNetModel,
              transformers.MPNetForSequenceClassification),
}


def _tiny_encoder(family: str, seed: int, cross_encoder: bool = False, **config_extra: object):
    make_tokenizer, config_class, model_class, classifier_class = ENCODER_FAMILIES[family]
    tokenizer = make_tokenizer()
    shape = dict(TINY_BERT)
    if family != "bert":  # positions from the padding id + 1: 128 tokens need 130 rows
        shape["max_position_embeddings"] += 2
    if family == "xlm-roberta":
        config_extra = {"type_vocab_size": 1, **config_extra}
    config = config_class(vocab_size=len(tokenizer), **shape, **config_extra)
    torch.manual_seed(seed)
    model = classifier_class(config) if cross_encoder else model_class(config)
    with torch.no_grad():  # transformers initialises norms to 1 and biases to 0, which would hide a misplaced one
        for name, param in model.named_parameters():
            if "LayerNorm" in name or name.endswith(".bias"):
                param.add_(torch.randn_like(param) * 0.1)
            if "token_type" in name and cross_encoder:  # make the second segment's type matter
                param.normal_(0.0, 0.5)
            if "relative_attention_bias" in name:  # MPNet's: large enough to matter
                param.normal_(0.0, 1.0)
    return tokenizer, config, model


def save_tiny_bert(directory: Path, pooling: str = "mean", normalize: bool = True, seed: int = 0,
                   family: str = "bert", **config_extra: object) -> Path:
    """A random BertModel (or XLMRobertaModel, MPNetModel: `family`) with its tokenizer, in sentence-transformers'
    layout: modules.json, 1_Pooling/config.json and (with `normalize`) a Normalize module."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer, config, model = _tiny_encoder(family, seed, **config_extra)
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
    """transformers' model (BertModel, XLMRobertaModel, MPNetModel) over each text alone (no padding), pooled as
    sentence-transformers pools."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModel.from_pretrained(directory, dtype=torch.float32).eval()
    vectors = []
    for text in texts:
        ids = tokenizer(text)["input_ids"] if isinstance(text, str) else text
        hidden = model(input_ids=torch.tensor([ids])).last_hidden_state[0]
        vector = {"mean": lambda h: h.mean(0), "cls": lambda h: h[0], "last": lambda h: h[-1],
                  "max": lambda h: h.max(0).values}[pooling](hidden)
        vectors.append(torch.nn.functional.normalize(vector, dim=0) if normalize else vector)
    return torch.stack(vectors)


def save_tiny_cross_encoder(directory: Path, seed: int = 0, family: str = "bert") -> Path:
    """A random BertForSequenceClassification (XLMRoberta..., MPNet...: `family`) with one label (a reranker), as
    sentence-transformers' CrossEncoder saves one (no modules.json)."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer, _, model = _tiny_encoder(family, seed, cross_encoder=True, num_labels=1)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@torch.inference_mode()
def reference_scores(directory: Path, pairs: list[tuple[str, str]]) -> torch.Tensor:
    """sigmoid of transformers' ...ForSequenceClassification logit for each pair alone (CrossEncoder's score)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(directory, dtype=torch.float32).eval()
    return torch.stack([torch.sigmoid(model(**tokenizer(a, b, return_tensors="pt")).logits[0, 0]) for a, b in pairs])


QWEN3_QUERY_PROMPT = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"


def _write_st_modules(directory: Path, pooling: str, hidden_size: int, dense: list[tuple[int, int]] = (),
                      prompts: dict[str, str] | None = None, seed: int = 0) -> None:
    """sentence-transformers' files beside a saved model: modules.json (Transformer, Pooling, Dense..., Normalize),
    1_Pooling/config.json, each Dense module's config and random weights, config_sentence_transformers.json."""
    from safetensors.torch import save_file

    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    (directory / "1_Pooling").mkdir(exist_ok=True)
    settings = {"word_embedding_dimension": hidden_size, **{key: False for key in ST_POOLING_KEYS.values()},
                "include_prompt": True}
    settings[ST_POOLING_KEYS[pooling]] = True
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(settings))
    generator = torch.Generator().manual_seed(seed + 1)
    for i, (inputs, outputs) in enumerate(dense, start=2):
        folder = directory / f"{i}_Dense"
        folder.mkdir(exist_ok=True)
        (folder / "config.json").write_text(json.dumps({
            "in_features": inputs, "out_features": outputs, "bias": False,
            "activation_function": "torch.nn.modules.linear.Identity"}))
        save_file({"linear.weight": torch.randn(outputs, inputs, generator=generator) * inputs**-0.5},
                  str(folder / "model.safetensors"))
        modules.append({"idx": i, "name": str(i), "path": folder.name, "type": "sentence_transformers.models.Dense"})
    normalize = len(modules)
    modules.append({"idx": normalize, "name": str(normalize), "path": f"{normalize}_Normalize",
                    "type": "sentence_transformers.models.Normalize"})
    (directory / f"{normalize}_Normalize").mkdir(exist_ok=True)
    (directory / "modules.json").write_text(json.dumps(modules))
    if prompts is not None:
        (directory / "config_sentence_transformers.json").write_text(json.dumps(
            {"prompts": prompts, "default_prompt_name": None, "similarity_fn_name": "cosine"}))


def save_tiny_decoder_embedder(directory: Path, family: str, tokenizer: transformers.PreTrainedTokenizerBase,
                               seed: int = 0) -> Path:
    """A random decoder embedding model in sentence-transformers' layout, saved as its base model (no `model.` prefix,
    no output layer, as the released checkpoints are): `qwen3` as Qwen3-Embedding (causal, last token, the query
    instruction prompt), `gemma3` as EmbeddingGemma (bidirectional attention with local layers, mean pooling, two
    Dense projections)."""
    from tiny_sizes import TINY_SIZES

    directory.mkdir(parents=True, exist_ok=True)
    ids = {"vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id,
           "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    torch.manual_seed(seed)
    if family == "qwen3":
        config = transformers.Qwen3Config(**TINY_SIZES, **ids, head_dim=32, rope_theta=1000000.0,
                                          tie_word_embeddings=True)
        model = transformers.Qwen3Model(config)
    else:
        # A window of 8 (transformers keeps 8 // 2 + 1 = 5: keys within 4 on either side) on five local layers of
        # six; weights large enough that attention is far from uniform.
        config = transformers.Gemma3TextConfig(**{**TINY_SIZES, "num_hidden_layers": 6}, **ids, head_dim=16,
                                               query_pre_attn_scalar=16, sliding_window=8, initializer_range=0.1,
                                               use_bidirectional_attention=True)
        model = transformers.Gemma3TextModel(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    if family == "qwen3":
        _write_st_modules(directory, "last", config.hidden_size, prompts={"query": QWEN3_QUERY_PROMPT, "document": ""})
    else:
        _write_st_modules(directory, "mean", config.hidden_size, dense=[(64, 256), (256, 64)],
                          prompts={"query": "task: search result | query: ", "document": "title: none | text: "})
    return directory


@torch.inference_mode()
def reference_decoder_embeddings(directory: Path, token_ids: list[list[int]]) -> torch.Tensor:
    """transformers' base model over each input alone, pooled, projected by the Dense modules and normalised as
    the sentence-transformers files say (what SentenceTransformer(directory).encode computes)."""
    from safetensors.torch import load_file

    model = transformers.AutoModel.from_pretrained(directory, dtype=torch.float32).eval()
    modules = json.loads((directory / "modules.json").read_text())
    pooling = json.loads((directory / "1_Pooling" / "config.json").read_text())
    dense = [load_file(str(directory / m["path"] / "model.safetensors"))["linear.weight"] for m in modules
             if m["type"].endswith(".Dense")]
    vectors = []
    for ids in token_ids:
        hidden = model(input_ids=torch.tensor([ids])).last_hidden_state[0]
        vector = hidden[-1] if pooling["pooling_mode_lasttoken"] else hidden.mean(0)
        for weight in dense:
            vector = weight @ vector
        vectors.append(torch.nn.functional.normalize(vector, dim=0))
    return torch.stack(vectors)


def yes_no_token_ids(tokenizer: transformers.PreTrainedTokenizerBase, query: str, document: str) -> list[int]:
    """A pair as Qwen3-Reranker's model card tokenizes it: its prefix, the instruction, query and document as one
    string, its suffix (each without special tokens added)."""
    prefix = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
              'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n')
    suffix = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    instruction = "Given a web search query, retrieve relevant passages that answer the query"
    pair = f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"
    return [*tokenizer.encode(prefix, add_special_tokens=False), *tokenizer.encode(pair, add_special_tokens=False),
            *tokenizer.encode(suffix, add_special_tokens=False)]


@torch.inference_mode()
def reference_yes_no_scores(directory: Path, token_ids: list[list[int]]) -> torch.Tensor:
    """Qwen3-Reranker's score with transformers, as its model card computes it: the last position's logits of "no"
    and "yes", log_softmax over the two, exp of yes's."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    no, yes = tokenizer.convert_tokens_to_ids("no"), tokenizer.convert_tokens_to_ids("yes")
    scores = []
    for ids in token_ids:
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
        scores.append(torch.log_softmax(torch.stack([logits[no], logits[yes]]), dim=0)[1].exp())
    return torch.stack(scores)
