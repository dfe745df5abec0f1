"""A Qwen3 decoder as a yes/no reranker (Qwen3-Reranker, --task score): P("yes") against "no" at the last token of
its prompt, by the decoder's own code without a KV cache, against transformers' Qwen3ForCausalLM as the model card
computes it; batched and alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from embedding_models import reference_yes_no_scores, yes_no_token_ids

from lmserve.config import CacheConfig, ModelConfig
from lmserve.models import resolve_model
from lmserve.pooling_config import is_pooling_model, load_pooling_config
from lmserve.worker.pooling_runner import PoolingModelRunner

PAIRS = [("what is a fox", "the quick brown fox jumps over the lazy dog"), ("hello", "world"),
         ("search query", "a long document about retrieval and embedding vector search " * 10)]


def test_yes_no_scores_match_transformers(tiny_qwen3_dir: Path, default_tokenizer) -> None:
    source = resolve_model(str(tiny_qwen3_dir))
    assert not is_pooling_model(source)  # generative unless asked to score
    assert is_pooling_model(source, "score")
    pooling = load_pooling_config(source, "score")
    assert (pooling.task, pooling.yes_no) == ("score", True)
    runner = PoolingModelRunner(ModelConfig(model=str(tiny_qwen3_dir), dtype="float32", task="score"), CacheConfig())
    ids = [yes_no_token_ids(default_tokenizer, q, d) for q, d in PAIRS]
    reference = reference_yes_no_scores(tiny_qwen3_dir, ids)
    batched = torch.stack(runner.embed(ids))[:, 0]
    torch.testing.assert_close(batched, reference, atol=1e-6, rtol=1e-5)
    alone = torch.stack([runner.embed([p])[0] for p in ids])[:, 0]
    torch.testing.assert_close(batched, alone, atol=1e-7, rtol=1e-6)
    assert batched.std() > 1e-3  # the pairs score differently: the test would see a constant


def test_task_score_on_a_model_that_cannot_score_names_it(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="--task score runs cross-encoders .* not llama"):
        is_pooling_model(resolve_model(str(tiny_llama_dir)), "score")


def test_a_decoders_sequence_classifier_is_refused_by_name(tmp_path: Path, tiny_qwen3_dir: Path) -> None:
    import json
    import shutil

    directory = Path(shutil.copytree(tiny_qwen3_dir, tmp_path / "seq-cls"))
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3ForSequenceClassification"]}))
    with pytest.raises(ValueError, match="Qwen3ForSequenceClassification is not served yet"):
        is_pooling_model(resolve_model(str(directory)))


def test_a_qwen3_reranker_is_recognised_as_llama_cpps_converter_recognises_it(tmp_path: Path,
                                                                             tiny_qwen3_dir: Path) -> None:
    """By its directory's name or its README's title (convert_hf_to_gguf.py's Qwen3Model._is_qwen3_reranker), with
    no flag; another Qwen3 stays generative."""
    import shutil

    named = Path(shutil.copytree(tiny_qwen3_dir, tmp_path / "Qwen3-Reranker-0.6B"))
    titled = Path(shutil.copytree(tiny_qwen3_dir, tmp_path / "some-copy"))
    (titled / "README.md").write_text("---\nlicense: apache-2.0\n---\n# Qwen3-Reranker-0.6B\n\nA reranker.\n")
    for directory in (named, titled):
        source = resolve_model(str(directory))
        assert is_pooling_model(source)
        assert load_pooling_config(source).yes_no
    assert not is_pooling_model(resolve_model(str(tiny_qwen3_dir)))
