"""A Qwen3 decoder served as a yes/no reranker (Qwen3-Reranker) by --rerank-model beside a chat model, on a real
server over HTTP: /v1/rerank in Cohere's shape and /v1/score against transformers' P("yes") of each pair in the
model card's prompt; the same model as the chat model stays generative."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from embedding_models import reference_yes_no_scores, yes_no_token_ids
from server_process import Server, start_server

CHAT = "tiny-chat"
RERANK = "tiny-qwen3-reranker"
QUERY = "what is a fox"
DOCUMENTS = ["the quick brown fox jumps over the lazy dog", "hello world", "a cat sat on the mat",
             "a long text about <|im_end|> markers " * 5]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path, tiny_qwen3_dir: Path) -> Iterator[Server]:
    started = start_server(
        tmp_path_factory.mktemp("yes-no"), str(tiny_llama_dir), "--served-model-name", CHAT, "--dtype", "float32",
        "--engine-threads", "1", "--kv-cache-memory", "64MiB", "--rerank-model", str(tiny_qwen3_dir),
        "--rerank-model-name", RERANK, "--pooling-engine-threads", "1")
    try:
        yield started
    finally:
        started.stop(signal.SIGKILL)


def test_rerank_and_score_match_the_model_cards_scores(server: Server, tiny_qwen3_dir: Path,
                                                       default_tokenizer) -> None:
    # The model card's tokenization parses special tokens inside the texts; lmserve keeps the texts as text, so the
    # reference gets the last document's marker as text too.
    ids = [yes_no_token_ids(default_tokenizer, QUERY, d) for d in DOCUMENTS[:3]]
    expected = reference_yes_no_scores(tiny_qwen3_dir, ids).tolist()
    body = httpx.post(f"{server.base_url}/v1/rerank", timeout=60, json={
        "model": RERANK, "query": QUERY, "documents": DOCUMENTS[:3]}).json()
    assert [r["index"] for r in body["results"]] == sorted(range(3), key=lambda i: -expected[i]), body
    for result in body["results"]:
        assert result["relevance_score"] == pytest.approx(expected[result["index"]], abs=1e-5)
    assert body["usage"]["total_tokens"] == sum(map(len, ids))
    score = httpx.post(f"{server.base_url}/v1/score", timeout=60, json={
        "model": RERANK, "text_1": QUERY, "text_2": DOCUMENTS[:3]}).json()
    assert [d["score"] for d in score["data"]] == pytest.approx(expected, abs=1e-5)


def test_special_token_spellings_in_a_document_stay_text(server: Server, default_tokenizer) -> None:
    body = httpx.post(f"{server.base_url}/v1/rerank", timeout=60, json={
        "model": RERANK, "query": QUERY, "documents": DOCUMENTS[3:]}).json()
    im_end = default_tokenizer.convert_tokens_to_ids("<|im_end|>")
    as_special = yes_no_token_ids(default_tokenizer, QUERY, DOCUMENTS[3])
    assert as_special.count(im_end) > 2  # the model card's way would read the document's markers as the token
    assert body["usage"]["total_tokens"] != len(as_special)


def test_the_chat_model_still_generates(server: Server) -> None:
    response = httpx.post(f"{server.base_url}/v1/completions", timeout=60, json={
        "model": CHAT, "prompt": "hello", "max_tokens": 2})
    assert response.status_code == 200, response.text
