"""Several models in one server over real HTTP (`lmserve serve CHAT --embedding-model EMB --rerank-model RR`): the
`openai` client's chat on one name and embeddings.create on another, rerank on a third, /v1/models listing all,
unknown names a 404, a model asked for what it does not do a 400, /metrics labelled by model, and one model's dead
engine failing only that model's requests (and /health)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
from embedding_models import reference_embeddings, reference_scores, save_tiny_bert, save_tiny_cross_encoder
from server_process import HTTP, Server, alive, children, start_server, wait_for

CHAT = "tiny-chat"
EMBED = "tiny-embed"
RERANK = "tiny-rerank"
TEXTS = ["hello world", "a cat sat on the mat", "a long document about retrieval " * 4]


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_bert(tmp_path_factory.mktemp("multi-bert"), "mean", normalize=True)


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_cross_encoder(tmp_path_factory.mktemp("multi-reranker"))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path, bert_dir: Path,
           reranker_dir: Path) -> Iterator[Server]:
    started = start_server(
        tmp_path_factory.mktemp("multi"), str(tiny_llama_dir), "--served-model-name", CHAT, "--dtype", "float32",
        "--engine-threads", "1", "--kv-cache-memory", "64MiB",
        "--embedding-model", str(bert_dir), "--embedding-model-name", EMBED,
        "--rerank-model", str(reranker_dir), "--rerank-model-name", RERANK,
        "--pooling-engine-threads", "1", "--pooling-kv-cache-memory", "16MiB",
        env={"LMSERVE_ENGINE_DEATH_GRACE_S": "0"})
    try:
        yield started
    finally:
        started.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def oai(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=60)


def engine_pids(server: Server) -> list[int]:
    """The engine processes in the order they started: the chat model's, the embedding model's, the reranker's."""
    pids = [pid for pid in children(server.process.pid)
            if b"lmserve.engine.core_proc" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    return sorted(pids, key=lambda pid: int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]))


def test_each_request_reaches_the_model_it_names(oai: openai.OpenAI, server: Server, bert_dir: Path,
                                                 reranker_dir: Path) -> None:
    assert len(engine_pids(server)) == 3  # one engine process per model
    chat = oai.chat.completions.create(model=CHAT, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.model == CHAT and chat.usage.completion_tokens > 0
    embedded = oai.embeddings.create(model=EMBED, input=TEXTS)
    assert embedded.model == EMBED
    vectors = torch.tensor(np.array([d.embedding for d in embedded.data]), dtype=torch.float32)
    cosine = torch.nn.functional.cosine_similarity(vectors, reference_embeddings(bert_dir, TEXTS))
    assert cosine.min() >= 0.9999
    documents = ["hello world", "the cat sat on the mat"]
    reranked = httpx.post(f"{server.base_url}/v1/rerank", timeout=60,
                          json={"model": RERANK, "query": "a cat", "documents": documents}).json()
    expected = reference_scores(reranker_dir, [("a cat", d) for d in documents]).tolist()
    assert reranked["model"] == RERANK
    for result in reranked["results"]:
        assert result["relevance_score"] == pytest.approx(expected[result["index"]], abs=1e-5)


def test_a_request_without_a_model_goes_to_the_model_that_does_it(server: Server) -> None:
    embedded = httpx.post(f"{server.base_url}/v1/embeddings", json={"input": "hello"}, timeout=60).json()
    assert embedded["model"] == EMBED
    chat = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60).json()
    assert chat["model"] == CHAT


def test_models_lists_every_model(oai: openai.OpenAI) -> None:
    assert [m.id for m in oai.models.list().data] == [CHAT, EMBED, RERANK]
    assert oai.models.retrieve(EMBED).id == EMBED


def test_an_unknown_model_is_a_404_and_a_wrong_task_a_400(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as unknown:
        oai.embeddings.create(model="no-such-model", input="hello")
    # vLLM's answer to an unknown model: a 404 NotFoundError naming the `model` field.
    assert unknown.value.status_code == 404 and unknown.value.body["param"] == "model"
    assert all(name in unknown.value.message for name in (CHAT, EMBED, RERANK))
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as generating:
        oai.chat.completions.create(model=EMBED, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert generating.value.body["param"] == "model" and "embedding model" in generating.value.message
    with pytest.raises(openai.BadRequestError) as embedding:
        oai.embeddings.create(model=CHAT, input="hello")
    assert "generative model" in embedding.value.message
    with pytest.raises(openai.BadRequestError):
        oai.embeddings.create(model=RERANK, input="hello")


def test_metrics_are_labelled_by_model(oai: openai.OpenAI, server: Server) -> None:
    oai.embeddings.create(model=EMBED, input="hello")
    text = HTTP.get(f"{server.base_url}/metrics").text
    # Each family once (Prometheus' text format), with a series per model.
    assert text.count("# HELP lmserve:num_requests_running ") == 1
    lines = text.splitlines()

    def series(family: str, name: str) -> list[str]:
        return [line for line in lines if line.startswith(f"{family}{{") and f'model_name="{name}"' in line]

    for name in (CHAT, EMBED, RERANK):
        assert len(series("lmserve:num_requests_running", name)) == 1, name
    assert series("lmserve:request_success_total", EMBED)


def test_a_dead_engine_fails_only_its_own_models_requests(oai: openai.OpenAI, server: Server) -> None:
    # Last in this module: it kills the embedding model's engine.
    _, embedding_engine, _ = engine_pids(server)
    os.kill(embedding_engine, signal.SIGKILL)
    assert wait_for(lambda: HTTP.get(f"{server.base_url}/health").status_code == 503, timeout=30)
    with pytest.raises(openai.InternalServerError) as dead:
        oai.embeddings.create(model=EMBED, input="hello")
    assert dead.value.status_code == 503 and EMBED in dead.value.message
    chat = oai.chat.completions.create(model=CHAT, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert chat.usage.completion_tokens > 0
    assert alive(server.process.pid) and server.process.poll() is None
