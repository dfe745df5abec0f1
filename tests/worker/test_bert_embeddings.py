"""BERT embeddings against transformers' BertModel and the pooling the model's files declare (sentence-transformers'
layout), batched and alone; the pooling config read from modules.json and 1_Pooling/config.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from embedding_models import reference_embeddings, save_tiny_bert

from lmserve.config import CacheConfig, ModelConfig
from lmserve.models import resolve_model
from lmserve.pooling_config import PoolingConfig, is_pooling_model, load_pooling_config
from lmserve.worker.pooling_runner import PoolingModelRunner

TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "a",
         "search query for a long document about retrieval and embedding vector search on a server " * 3]


@pytest.fixture(scope="module", params=["mean", "cls", "last", "max"])
def bert_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    pooling = request.param
    normalize = pooling != "max"  # one model without a Normalize module
    return save_tiny_bert(tmp_path_factory.mktemp(f"bert-{pooling}"), pooling, normalize), pooling


def token_ids(directory: Path, texts: list[str]) -> list[list[int]]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    return [tokenizer(t)["input_ids"] for t in texts]


def test_pooling_config_is_read_from_the_files(bert_dir: tuple[Path, str]) -> None:
    directory, pooling = bert_dir
    source = resolve_model(str(directory))
    assert is_pooling_model(source)
    assert load_pooling_config(source) == PoolingConfig(pooling, normalize=pooling != "max")


def test_embeddings_match_transformers_alone_and_batched(bert_dir: tuple[Path, str]) -> None:
    directory, pooling = bert_dir
    runner = PoolingModelRunner(ModelConfig(model=str(directory), dtype="float32"), CacheConfig())
    ids = token_ids(directory, TEXTS)
    reference = reference_embeddings(directory, ids, pooling, normalize=pooling != "max")
    batched = torch.stack(runner.embed(ids))
    alone = torch.stack([runner.embed([p])[0] for p in ids])
    cosine = torch.nn.functional.cosine_similarity(batched, reference)
    assert cosine.min() >= 0.9999, cosine
    torch.testing.assert_close(batched, reference, atol=1e-5, rtol=1e-4)
    # A row's embedding does not depend on its batch (nor its place in it).
    reversed_batch = torch.stack(runner.embed(ids[::-1])[::-1])
    torch.testing.assert_close(batched, alone, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(batched, reversed_batch, atol=1e-6, rtol=1e-5)


def test_matryoshka_dimensions_truncate_then_normalise(tmp_path: Path) -> None:
    directory = save_tiny_bert(tmp_path / "bert", "mean", normalize=True)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 32]}))
    assert load_pooling_config(resolve_model(str(directory))).matryoshka_dimensions == (16, 32)
    runner = PoolingModelRunner(ModelConfig(model=str(directory)), CacheConfig())
    ids = token_ids(directory, TEXTS[:2])
    full = torch.stack(reference_embeddings(directory, ids, "mean", normalize=False).unbind())
    short = torch.stack(runner.embed(ids, [16, 16]))
    expected = torch.nn.functional.normalize(full[:, :16], dim=1)
    torch.testing.assert_close(short, expected, atol=1e-5, rtol=1e-4)


def test_pooling_modes_lmserve_does_not_run_are_refused(tmp_path: Path) -> None:
    directory = save_tiny_bert(tmp_path / "bert", "mean")
    settings = json.loads((directory / "1_Pooling" / "config.json").read_text())
    (directory / "1_Pooling" / "config.json").write_text(json.dumps({**settings, "pooling_mode_cls_token": True}))
    with pytest.raises(ValueError, match="one pooling mode"):
        load_pooling_config(resolve_model(str(directory)))


def test_a_directory_without_sentence_transformers_files_pools_cls_normalised(tmp_path: Path) -> None:
    directory = save_tiny_bert(tmp_path / "bert", "mean")
    (directory / "modules.json").unlink()
    assert load_pooling_config(resolve_model(str(directory))) == PoolingConfig("cls", normalize=True)


def test_a_cross_encoders_scores_match_transformers(tmp_path: Path) -> None:
    from embedding_models import reference_scores, save_tiny_cross_encoder

    directory = save_tiny_cross_encoder(tmp_path / "reranker")
    assert load_pooling_config(resolve_model(str(directory))).task == "score"
    runner = PoolingModelRunner(ModelConfig(model=str(directory), dtype="float32"), CacheConfig())
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    pairs = [("search query", "a document about retrieval"), ("hello", "world"), ("the cat", "sat on the mat")]
    encoded = [tokenizer(a, b) for a, b in pairs]
    starts = [e["token_type_ids"].index(1) for e in encoded]
    ours = torch.stack(runner.embed([e["input_ids"] for e in encoded], None, starts))[:, 0]
    expected = reference_scores(directory, pairs)
    torch.testing.assert_close(ours, expected, atol=1e-6, rtol=1e-5)
    # The token types matter: the same ids read as one text score differently.
    as_one_text = torch.stack(runner.embed([e["input_ids"] for e in encoded]))[:, 0]
    assert not torch.allclose(as_one_text, expected, atol=1e-4)


def test_sentence_transformers_max_seq_length_is_the_default_length(tmp_path: Path) -> None:
    directory = save_tiny_bert(tmp_path / "bert", "mean")  # 128 learned positions
    (directory / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 32, "do_lower_case": False}))
    assert load_pooling_config(resolve_model(str(directory))).max_seq_length == 32
    assert PoolingModelRunner(ModelConfig(model=str(directory)), CacheConfig()).max_model_len == 32
    # --max-model-len may ask for more, up to the learned positions.
    runner = PoolingModelRunner(ModelConfig(model=str(directory), max_model_len=1000), CacheConfig())
    assert runner.max_model_len == 128


def test_the_offline_llm_embeds_as_the_server_does(tmp_path: Path) -> None:
    from lmserve.frontend.llm import LLM
    from lmserve.pooling_params import PoolingParams

    directory = save_tiny_bert(tmp_path / "bert", "mean")
    with LLM(str(directory), dtype="float32", max_num_batched_tokens=16) as llm:  # several steps for the batch
        outputs = llm.embed(TEXTS)
        ours = torch.tensor([o.embedding for o in outputs])
        expected = reference_embeddings(directory, token_ids(directory, TEXTS))
        assert torch.nn.functional.cosine_similarity(ours, expected).min() >= 0.9999
        assert [o.prompt_token_ids for o in outputs] == token_ids(directory, TEXTS)
        with pytest.raises(ValueError, match="dimensions=16"):
            llm.embed("hello", PoolingParams(dimensions=16))  # the model declares no Matryoshka sizes
        assert not llm.engine.has_unfinished_requests()
