"""Decoders run as embedding models by the decoder's own code without a KV cache: Qwen3-Embedding (causal, last
token) and EmbeddingGemma (bidirectional attention with sliding-window local layers, mean pooling, Dense projections),
against transformers' base models and the sentence-transformers files' pooling; short and long inputs, batched and
alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from embedding_models import QWEN3_QUERY_PROMPT, reference_decoder_embeddings, save_tiny_decoder_embedder

from lmserve.config import CacheConfig, ModelConfig
from lmserve.models import resolve_model
from lmserve.pooling_config import is_pooling_model, load_pooling_config
from lmserve.worker.pooling_runner import PoolingModelRunner

TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "a",
         "search query for a long document about retrieval and embedding vector search on a server " * 12]


@pytest.fixture(scope="module", params=["qwen3", "gemma3"])
def embedder_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                 default_tokenizer) -> Path:
    return save_tiny_decoder_embedder(tmp_path_factory.mktemp(request.param), request.param, default_tokenizer)


def test_embeddings_match_transformers_alone_and_batched(embedder_dir: Path, default_tokenizer) -> None:
    source = resolve_model(str(embedder_dir))
    assert is_pooling_model(source)
    runner = PoolingModelRunner(ModelConfig(model=str(embedder_dir), dtype="float32"), CacheConfig())
    ids = [default_tokenizer(t)["input_ids"] for t in TEXTS]
    assert max(map(len, ids)) > 150 and min(map(len, ids)) == 1  # long (past Gemma's window) and short
    reference = reference_decoder_embeddings(embedder_dir, ids)
    batched = torch.stack(runner.embed(ids))
    cosine = torch.nn.functional.cosine_similarity(batched, reference)
    assert cosine.min() >= 0.9999, cosine
    torch.testing.assert_close(batched, reference, atol=1e-5, rtol=1e-4)
    # A row's embedding does not depend on its batch (nor its place in it).
    alone = torch.stack([runner.embed([p])[0] for p in ids])
    torch.testing.assert_close(batched, alone, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(batched, torch.stack(runner.embed(ids[::-1])[::-1]), atol=1e-6, rtol=1e-5)


def test_the_files_pooling_heads_and_prompts_are_read(embedder_dir: Path) -> None:
    pooling = load_pooling_config(resolve_model(str(embedder_dir)))
    assert pooling.normalize
    if embedder_dir.name.startswith("qwen3"):
        assert (pooling.pooling, pooling.dense) == ("last", ())
        assert pooling.prompt("query") == QWEN3_QUERY_PROMPT and pooling.prompt(None) == ""
    else:
        assert pooling.pooling == "mean"
        assert [(d.in_features, d.out_features) for d in pooling.dense] == [(64, 256), (256, 64)]
        assert pooling.output_size(64) == 64


def test_a_decoder_without_sentence_transformers_files_is_a_generative_model(tiny_qwen3_dir: Path) -> None:
    assert not is_pooling_model(resolve_model(str(tiny_qwen3_dir)))
