"""XLM-RoBERTa and MPNet, the encoders BERT's module runs with their differences (positions after the padding id,
MPNet's relative position bias and names), against transformers' own models and the pooling the files declare: short
and long texts, batched and alone; their cross-encoders (bge-reranker's kind) against transformers' classifiers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from embedding_models import reference_embeddings, reference_scores, save_tiny_bert, save_tiny_cross_encoder

from lmserve.config import CacheConfig, ModelConfig
from lmserve.models import resolve_model
from lmserve.pooling_config import is_pooling_model, load_pooling_config
from lmserve.worker.pooling_runner import PoolingModelRunner

TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "a",
         "search query for a long document about retrieval and embedding vector search on a server " * 5]
FAMILIES = ["xlm-roberta", "mpnet"]


@pytest.fixture(scope="module", params=[(f, p) for f in FAMILIES for p in ("mean", "cls")],
                ids=lambda fp: f"{fp[0]}-{fp[1]}")
def encoder_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    family, pooling = request.param
    return save_tiny_bert(tmp_path_factory.mktemp(f"{family}-{pooling}"), pooling, family=family), pooling


def token_ids(directory: Path, texts: list[str]) -> list[list[int]]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    return [tokenizer(t)["input_ids"] for t in texts]


def test_embeddings_match_transformers_alone_and_batched(encoder_dir: tuple[Path, str]) -> None:
    directory, pooling = encoder_dir
    assert is_pooling_model(resolve_model(str(directory)))
    runner = PoolingModelRunner(ModelConfig(model=str(directory), dtype="float32"), CacheConfig())
    assert runner.max_model_len == 128  # 130 learned positions, the first two the padding id's
    ids = token_ids(directory, TEXTS)
    assert 90 < max(map(len, ids)) <= 128 and min(map(len, ids)) <= 3  # long and short
    reference = reference_embeddings(directory, ids, pooling)
    batched = torch.stack(runner.embed(ids))
    alone = torch.stack([runner.embed([p])[0] for p in ids])
    cosine = torch.nn.functional.cosine_similarity(batched, reference)
    assert cosine.min() >= 0.9999, cosine
    torch.testing.assert_close(batched, reference, atol=1e-5, rtol=1e-4)
    # A row's embedding does not depend on its batch (nor its place in it).
    torch.testing.assert_close(batched, alone, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(batched, torch.stack(runner.embed(ids[::-1])[::-1]), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_cross_encoders_scores_match_transformers(tmp_path: Path, family: str) -> None:
    directory = save_tiny_cross_encoder(tmp_path / "reranker", family=family)
    assert load_pooling_config(resolve_model(str(directory))).task == "score"
    runner = PoolingModelRunner(ModelConfig(model=str(directory), dtype="float32"), CacheConfig())
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    pairs = [("search query", "a document about retrieval"), ("hello", "world"), ("the cat", "sat on the mat " * 20)]
    encoded = [tokenizer(a, b)["input_ids"] for a, b in pairs]
    ours = torch.stack(runner.embed(encoded))[:, 0]  # one token type: the pair needs no second segment
    torch.testing.assert_close(ours, reference_scores(directory, pairs), atol=1e-6, rtol=1e-5)


def test_mpnet_relative_position_bias_is_applied(tmp_path: Path) -> None:
    """Without the bias table the vectors differ by far more than the tolerance of the comparison above, so that
    comparison would catch a dropped bias."""
    directory = save_tiny_bert(tmp_path / "mpnet", "mean", family="mpnet")
    runner = PoolingModelRunner(ModelConfig(model=str(directory), dtype="float32"), CacheConfig())
    ids = token_ids(directory, TEXTS[1:2])
    with_bias = runner.embed(ids)[0]
    with torch.no_grad():
        runner.model.encoder.relative_attention_bias.weight.zero_()
    assert (with_bias - runner.embed(ids)[0]).abs().max() > 1e-4
