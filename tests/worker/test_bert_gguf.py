"""BERT from GGUF (llama.cpp's `bert`): a tiny random BERT written as llama.cpp's convert_hf_to_gguf.py writes one
(its tensor names, F16 matrices and F32 vectors, its "phantom space" WordPiece vocabulary, the pooling type from
sentence-transformers' files), against transformers' BertModel on the Hugging Face directory it came from. The names
and metadata here were checked against the converter's own output for the same directory (2026-12-08)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from embedding_models import reference_embeddings, save_tiny_bert

from lmserve.config import CacheConfig, ModelConfig
from lmserve.model_tokenizer import load_tokenizer
from lmserve.models import resolve_model
from lmserve.pooling_config import is_pooling_model, load_pooling_config
from lmserve.worker.pooling_runner import PoolingModelRunner

TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "a",
         "search query for a long document about retrieval and embedding vector search on a server " * 6]
LAYER_NAMES = {"attention.self.query": "attn_q", "attention.self.key": "attn_k", "attention.self.value": "attn_v",
               "attention.output.dense": "attn_output", "attention.output.LayerNorm": "attn_output_norm",
               "intermediate.dense": "ffn_up", "output.dense": "ffn_down", "output.LayerNorm": "layer_output_norm"}
TOP_NAMES = {"embeddings.word_embeddings": "token_embd", "embeddings.position_embeddings": "position_embd",
             "embeddings.token_type_embeddings": "token_types", "embeddings.LayerNorm": "token_embd_norm"}


def gguf_name(hf_name: str) -> str | None:
    module, leaf = hf_name.rsplit(".", 1)
    if module in TOP_NAMES:
        return f"{TOP_NAMES[module]}.{leaf}"
    if module.startswith("encoder.layer."):
        _, _, index, rest = module.split(".", 3)
        return f"blk.{index}.{LAYER_NAMES[rest]}.{leaf}"
    return None  # the pooler, which the converter drops


def write_bert_gguf(directory: Path, path: Path, pooling_type: int = 1, cls_head: bool = False) -> Path:
    config = transformers.AutoConfig.from_pretrained(directory)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.BertModel.from_pretrained(directory, dtype=torch.float32)
    writer = gguf.GGUFWriter(str(path), "bert")
    for key, value in (("context_length", config.max_position_embeddings), ("embedding_length", config.hidden_size),
                       ("feed_forward_length", config.intermediate_size), ("block_count", config.num_hidden_layers),
                       ("attention.head_count", config.num_attention_heads), ("pooling_type", pooling_type)):
        writer.add_uint32(f"bert.{key}", value)
    writer.add_float32("bert.attention.layer_norm_epsilon", config.layer_norm_eps)
    writer.add_bool("bert.attention.causal", False)
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    special = set(tokenizer.all_special_tokens)
    types = [3 if token in special else 1 for token, _ in vocab]  # CONTROL, NORMAL
    writer.add_tokenizer_model("bert")
    writer.add_tokenizer_pre("default")
    writer.add_token_type_count(config.type_vocab_size)
    writer.add_token_list([t if t in special else t[2:] if t.startswith("##") else "\u2581" + t for t, _ in vocab])
    writer.add_token_types(types)
    for key, token in (("bos_token_id", "[CLS]"), ("eos_token_id", "[SEP]"), ("unknown_token_id", "[UNK]"),
                       ("seperator_token_id", "[SEP]"), ("padding_token_id", "[PAD]"), ("mask_token_id", "[MASK]")):
        writer.add_uint32(f"tokenizer.ggml.{key}", tokenizer.convert_tokens_to_ids(token))
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.add_bool("tokenizer.ggml.add_eos_token", True)
    for hf_name, tensor in model.state_dict().items():
        name = gguf_name(hf_name)
        if name is None:
            continue
        data = tensor.numpy()
        # As the converter stores them: matrices in F16 but the position and token-type tables, vectors in F32.
        f16 = data.ndim == 2 and name.split(".")[0] not in ("position_embd", "token_types")
        writer.add_tensor(name, data.astype(np.float16 if f16 else np.float32))
    if cls_head:
        writer.add_tensor("cls.output.weight", np.zeros((1, config.hidden_size), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def bert_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    directory = save_tiny_bert(tmp_path_factory.mktemp("bert-hf"), "mean")
    return directory, write_bert_gguf(directory, tmp_path_factory.mktemp("bert-gguf") / "tiny-bert.f16.gguf")


def test_the_gguf_tokenizes_and_embeds_as_the_hf_directory(bert_pair: tuple[Path, Path]) -> None:
    directory, path = bert_pair
    source = resolve_model(str(path))
    assert is_pooling_model(source)
    assert load_pooling_config(source).pooling == "mean"  # the header's pooling_type 1
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    ids = [hf_tokenizer(t)["input_ids"] for t in TEXTS]
    assert [load_tokenizer(source)(t)["input_ids"] for t in TEXTS] == ids
    runner = PoolingModelRunner(ModelConfig(model=str(path), dtype="float32"), CacheConfig())
    assert runner.max_model_len == 128
    reference = reference_embeddings(directory, ids, "mean")
    batched = torch.stack(runner.embed(ids))
    cosine = torch.nn.functional.cosine_similarity(batched, reference)
    assert cosine.min() >= 0.9999, cosine  # the file's F16 matrices against the directory's float32
    alone = torch.stack([runner.embed([p])[0] for p in ids])
    torch.testing.assert_close(batched, alone, atol=1e-6, rtol=1e-5)


def test_a_gguf_bert_reranker_is_refused_by_name(tmp_path: Path, bert_pair: tuple[Path, Path]) -> None:
    path = write_bert_gguf(bert_pair[0], tmp_path / "reranker.gguf", cls_head=True)
    with pytest.raises(ValueError, match="bert reranker .* from GGUF is not served yet"):
        PoolingModelRunner(ModelConfig(model=str(path), dtype="float32"), CacheConfig())


def test_an_embeddinggemma_gguf_is_refused_naming_the_architecture(tmp_path: Path) -> None:
    path = tmp_path / "embeddinggemma.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma-embedding")
    writer.add_uint32("gemma-embedding.block_count", 1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ValueError, match="gemma-embedding.*not read yet; serve its Hugging Face directory"):
        is_pooling_model(resolve_model(str(path)))
