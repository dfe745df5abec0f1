"""/v1/rerank, /rerank (Cohere's and Jina's shape) and /v1/score (vLLM's) on a real server over HTTP, with a tiny
random BertForSequenceClassification reranker, against transformers' scores of each pair."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from embedding_models import reference_scores, save_tiny_cross_encoder
from server_process import Server, start_server

from lmserve.pooling_params import MAX_EMBEDDING_INPUTS

MODEL = "tiny-reranker"
QUERY = "search query"
DOCUMENTS = ["a document about retrieval", "hello world", "the cat sat on the mat", "a long text " * 5]


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_cross_encoder(tmp_path_factory.mktemp("reranker"))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, reranker_dir: Path) -> Iterator[Server]:
    started = start_server(tmp_path_factory.mktemp("rerank"), "--model", str(reranker_dir), "--dtype", "float32",
                           "--max-model-len", "64", "--served-model-name", MODEL)
    try:
        yield started
    finally:
        started.stop(signal.SIGKILL)


def test_rerank_in_cohere_shape_orders_by_transformers_scores(server: Server, reranker_dir: Path) -> None:
    expected = reference_scores(reranker_dir, [(QUERY, d) for d in DOCUMENTS]).tolist()
    best_first = sorted(range(len(DOCUMENTS)), key=lambda i: -expected[i])
    for path in ("/v1/rerank", "/rerank"):
        body = httpx.post(f"{server.base_url}{path}", timeout=60, json={
            "model": MODEL, "query": QUERY, "documents": DOCUMENTS, "top_n": 3}).json()
        assert [r["index"] for r in body["results"]] == best_first[:3], body
        for result in body["results"]:
            assert result["relevance_score"] == pytest.approx(expected[result["index"]], abs=1e-5)
            assert result["document"]["text"] == DOCUMENTS[result["index"]]
        assert body["model"] == MODEL and body["usage"]["total_tokens"] > 0
    bare = httpx.post(f"{server.base_url}/v1/rerank", timeout=60, json={
        "query": QUERY, "documents": DOCUMENTS, "return_documents": False}).json()
    assert len(bare["results"]) == len(DOCUMENTS) and all(r.get("document") is None for r in bare["results"])


def test_score_one_against_many_and_pairwise(server: Server, reranker_dir: Path) -> None:
    expected = reference_scores(reranker_dir, [(QUERY, d) for d in DOCUMENTS]).tolist()
    body = httpx.post(f"{server.base_url}/v1/score", timeout=60,
                      json={"text_1": QUERY, "text_2": DOCUMENTS}).json()
    assert [d["index"] for d in body["data"]] == list(range(len(DOCUMENTS)))
    assert [d["score"] for d in body["data"]] == pytest.approx(expected, abs=1e-5)
    pairwise = httpx.post(f"{server.base_url}/v1/score", timeout=60,
                          json={"text_1": [QUERY, "hello"], "text_2": DOCUMENTS[:2]}).json()
    assert pairwise["data"][0]["score"] == pytest.approx(expected[0], abs=1e-5)


def test_bad_requests_are_400s_naming_the_field(server: Server) -> None:
    url = server.base_url
    for path, body, param in (
        ("/v1/rerank", {"query": QUERY, "documents": []}, "documents"),
        ("/v1/rerank", {"query": "", "documents": ["a"]}, "query"),
        ("/v1/rerank", {"query": QUERY, "documents": ["a"] * (MAX_EMBEDDING_INPUTS + 1)}, "documents"),
        ("/v1/rerank", {"query": QUERY, "documents": ["hello " * 100]}, "documents"),
        ("/v1/rerank", {"query": QUERY, "documents": ["a"], "top_n": 0}, "top_n"),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_1"),
        ("/v1/embeddings", {"input": "hello"}, "model"),
    ):
        response = httpx.post(f"{url}{path}", json=body, timeout=60)
        assert response.status_code == 400, (path, body, response.text)
        assert response.json()["error"]["param"] == param, (path, body, response.text)
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}, timeout=60).status_code == 400
