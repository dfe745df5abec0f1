"""Qwen3-Embedding and Qwen3-Reranker from GGUF, as llama.cpp's convert_hf_to_gguf.py writes them: a qwen3 file with
a pooling type (last token from sentence-transformers' files; rank with the "yes" and "no" rows as cls.output, its
Qwen3Model._get_cls_out_tensor), against the same model's Hugging Face directory served by lmserve (itself checked
against transformers in test_decoder_embeddings.py and test_yes_no_reranker.py)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from embedding_models import save_tiny_decoder_embedder, yes_no_token_ids

from lmserve.config import CacheConfig, ModelConfig
from lmserve.models import resolve_model
from lmserve.pooling_config import is_pooling_model, load_pooling_config
from lmserve.worker.pooling_runner import PoolingModelRunner

Q = gguf.GGMLQuantizationType


def float_types(name: str) -> Q:
    return Q.F32 if name.endswith(".bias") or "norm" in name else Q.F16


def with_pooling(source: Path, target: Path, pooling_type: int, extra: dict[str, np.ndarray] | None = None) -> Path:
    """A copy of a GGUF file with ARCH.pooling_type set and `extra` tensors added, as the converter writes them."""
    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(target), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type)
    writer.add_uint32(f"{arch}.pooling_type", pooling_type)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
    for name, value in (extra or {}).items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def test_a_qwen3_embedding_gguf_embeds_as_its_directory(tmp_path: Path, default_tokenizer, gguf_writer) -> None:
    directory = save_tiny_decoder_embedder(tmp_path / "qwen3-embedding", "qwen3", default_tokenizer)
    # write_gguf reads a causal-LM checkpoint: the base model's weights with the tied head
    transformers.Qwen3ForCausalLM.from_pretrained(directory).save_pretrained(tmp_path / "as-causal-lm")
    default_tokenizer.save_pretrained(tmp_path / "as-causal-lm")
    plain = gguf_writer(tmp_path / "as-causal-lm", tmp_path / "plain.gguf", type_for=float_types)
    assert not is_pooling_model(resolve_model(str(plain)))  # no pooling type: a generative qwen3
    path = with_pooling(plain, tmp_path / "qwen3-embedding.f16.gguf", 3)
    source = resolve_model(str(path))
    assert is_pooling_model(source) and load_pooling_config(source).pooling == "last"
    ids = [default_tokenizer(t)["input_ids"] for t in ("hello world", "a long document about retrieval " * 10)]
    from_gguf = PoolingModelRunner(ModelConfig(model=str(path), dtype="float32"), CacheConfig())
    from_directory = PoolingModelRunner(ModelConfig(model=str(directory), dtype="float32"), CacheConfig())
    cosine = torch.nn.functional.cosine_similarity(torch.stack(from_gguf.embed(ids)),
                                                   torch.stack(from_directory.embed(ids)))
    assert cosine.min() >= 0.9999, cosine  # the file's F16 matrices


def test_a_qwen3_reranker_gguf_scores_as_its_directory(tmp_path: Path, tiny_qwen3_dir: Path, default_tokenizer,
                                                       gguf_writer) -> None:
    plain = gguf_writer(tiny_qwen3_dir, tmp_path / "plain.gguf", type_for=float_types)
    model = transformers.Qwen3ForCausalLM.from_pretrained(tiny_qwen3_dir)
    head = model.get_output_embeddings().weight.detach()
    yes, no = default_tokenizer.convert_tokens_to_ids("yes"), default_tokenizer.convert_tokens_to_ids("no")
    path = with_pooling(plain, tmp_path / "qwen3-reranker.gguf", 4,
                        {"cls.output.weight": torch.stack([head[yes], head[no]]).numpy()})
    source = resolve_model(str(path))
    assert is_pooling_model(source) and load_pooling_config(source).yes_no
    ids = [yes_no_token_ids(default_tokenizer, "what is a fox", d) for d in ("a quick brown fox", "hello world")]
    from_gguf = PoolingModelRunner(ModelConfig(model=str(path), dtype="float32"), CacheConfig())
    from_directory = PoolingModelRunner(ModelConfig(model=str(tiny_qwen3_dir), dtype="float32", task="score"),
                                        CacheConfig())
    torch.testing.assert_close(torch.stack(from_gguf.embed(ids)), torch.stack(from_directory.embed(ids)),
                               atol=2e-3, rtol=0)  # the file's F16 matrices


def test_a_block_format_decoder_embedding_file_is_refused(tmp_path: Path, tiny_qwen3_dir: Path,
                                                          gguf_writer) -> None:
    path = with_pooling(gguf_writer(tiny_qwen3_dir, tmp_path / "q.gguf"), tmp_path / "q-embed.gguf", 3)
    with pytest.raises(ValueError, match=r"is stored as Q\w+; lmserve runs embedding models"):
        PoolingModelRunner(ModelConfig(model=str(path), dtype="float32"), CacheConfig())
