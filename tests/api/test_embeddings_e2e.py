"""/v1/embeddings on a real server over HTTP: the `openai` client's embeddings.create against a tiny random BERT in
sentence-transformers' layout, compared with transformers' BertModel and the pooling its files declare; the request
bounds and errors; and the generating routes refused on an embedding model."""

from __future__ import annotations

import base64
import json
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
import transformers
from embedding_models import reference_embeddings, save_tiny_bert
from server_process import Server, start_server

from lmserve.pooling_params import MAX_EMBEDDING_INPUTS

MODEL = "tiny-embed"
MAX_MODEL_LEN = 64
TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "a cat sat on the mat",
         "search query", "a long document about retrieval " * 4]


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = save_tiny_bert(tmp_path_factory.mktemp("embed-bert"), "mean", normalize=True)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 32]}))
    return directory


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, bert_dir: Path) -> Iterator[Server]:
    started = start_server(tmp_path_factory.mktemp("embed"), "--model", str(bert_dir), "--dtype", "float32",
                           "--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", MODEL)
    try:
        yield started
    finally:
        started.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def oai(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=60)


def cosines(a: np.ndarray, b: torch.Tensor) -> np.ndarray:
    return torch.nn.functional.cosine_similarity(torch.as_tensor(a, dtype=torch.float32), b).numpy()


def test_openai_client_embeddings_match_transformers(oai: openai.OpenAI, bert_dir: Path) -> None:
    reference = reference_embeddings(bert_dir, TEXTS)
    # The client asks for base64 unless told otherwise, and decodes it; float is the JSON list.
    for encoding in (openai.NOT_GIVEN, "float"):
        response = oai.embeddings.create(model=MODEL, input=TEXTS, encoding_format=encoding)
        assert [d.index for d in response.data] == list(range(len(TEXTS)))
        vectors = np.array([d.embedding for d in response.data])
        assert vectors.shape == (len(TEXTS), 64)
        assert cosines(vectors, reference).min() >= 0.9999
    tokenizer = transformers.AutoTokenizer.from_pretrained(bert_dir)
    num_tokens = sum(len(tokenizer(t)["input_ids"]) for t in TEXTS)
    assert response.usage.prompt_tokens == response.usage.total_tokens == num_tokens
    assert response.model == MODEL


def test_a_rows_embedding_does_not_depend_on_its_batch(oai: openai.OpenAI) -> None:
    batched = np.array([d.embedding for d in oai.embeddings.create(model=MODEL, input=TEXTS).data])
    alone = np.array([oai.embeddings.create(model=MODEL, input=t).data[0].embedding for t in TEXTS])
    np.testing.assert_allclose(batched, alone, atol=1e-6)


def test_token_id_inputs_and_base64(server: Server, bert_dir: Path) -> None:
    ids = [transformers.AutoTokenizer.from_pretrained(bert_dir)(t)["input_ids"] for t in TEXTS[:2]]
    reference = reference_embeddings(bert_dir, ids)
    for payload, expected in ((ids[0], reference[:1]), (ids, reference)):
        body = httpx.post(f"{server.base_url}/v1/embeddings", timeout=60,
                          json={"input": payload, "encoding_format": "base64", "user": "u1"}).json()
        vectors = np.array([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in body["data"]])
        assert cosines(vectors, expected).min() >= 0.9999


def test_matryoshka_dimensions_only_where_the_model_declares_them(oai: openai.OpenAI, bert_dir: Path) -> None:
    short = oai.embeddings.create(model=MODEL, input=TEXTS[:2], dimensions=16, encoding_format="float")
    vectors = np.array([d.embedding for d in short.data])
    assert vectors.shape == (2, 16)
    full = reference_embeddings(bert_dir, TEXTS[:2], normalize=False)
    assert cosines(vectors, full[:, :16]).min() >= 0.9999
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    with pytest.raises(openai.BadRequestError) as refused:
        oai.embeddings.create(model=MODEL, input="hello", dimensions=20)
    assert refused.value.body["param"] == "dimensions" and "16, 32" in refused.value.body["message"]


def test_bounds_and_truncation(server: Server, oai: openai.OpenAI) -> None:
    url = f"{server.base_url}/v1/embeddings"
    long_text = "hello " * (MAX_MODEL_LEN + 10)
    too_long = httpx.post(url, json={"input": ["hello", long_text]}, timeout=60)
    assert too_long.status_code == 400 and "maximum context length" in too_long.json()["error"]["message"]
    cut = oai.embeddings.create(model=MODEL, input=long_text, extra_body={"truncate_prompt_tokens": -1})
    assert cut.usage.prompt_tokens == MAX_MODEL_LEN
    cut = oai.embeddings.create(model=MODEL, input=long_text, extra_body={"truncate_prompt_tokens": 8})
    assert cut.usage.prompt_tokens == 8
    too_many = httpx.post(url, json={"input": ["a"] * (MAX_EMBEDDING_INPUTS + 1)}, timeout=60)
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "input"
    for bad, param in (({"input": []}, "input"), ({"input": [""]}, "input"), ({"input": [1, "a"]}, "input"),
                       ({"input": [[10**9]]}, None), ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
                       ({"input": "a", "model": "other"}, "model"), ({"input": "a", "dimensions": 0}, "dimensions")):
        response = httpx.post(url, json=bad, timeout=60)
        assert 400 <= response.status_code < 500, (bad, response.text)
        error = response.json()["error"]
        assert param is None or error["param"] == param, (bad, error)
    # The server still answers after all that.
    assert len(oai.embeddings.create(model=MODEL, input="hello").data) == 1


def test_generating_routes_are_refused_on_an_embedding_model(server: Server) -> None:
    for path, body in (("/v1/completions", {"prompt": "hello", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        response = httpx.post(f"{server.base_url}{path}", json=body, timeout=60)
        assert response.status_code == 400, response.text
        assert "embedding model" in response.json()["error"]["message"]


def test_rerank_on_an_embedding_model_is_a_400(server: Server) -> None:
    response = httpx.post(f"{server.base_url}/v1/rerank", json={"query": "a", "documents": ["b"]}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "model"
    assert "embedding model" in response.json()["error"]["message"]


def test_embeddings_are_counted_as_requests_with_no_generated_tokens(server: Server, oai: openai.OpenAI) -> None:
    def metric(text: str, name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name) and not line.startswith("#"))

    before = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    response = oai.embeddings.create(model=MODEL, input=TEXTS[:3])
    after = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    assert metric(after, "lmserve:prompt_tokens_total") - metric(before, "lmserve:prompt_tokens_total") == \
        response.usage.prompt_tokens
    assert metric(after, "lmserve:e2e_request_latency_seconds_count") - \
        metric(before, "lmserve:e2e_request_latency_seconds_count") == 3
    assert metric(after, "lmserve:generation_tokens_total") == metric(before, "lmserve:generation_tokens_total")
    assert metric(after, "lmserve:time_to_first_token_seconds_count") == \
        metric(before, "lmserve:time_to_first_token_seconds_count")
    assert metric(after, "lmserve:request_params_max_tokens_count") == \
        metric(before, "lmserve:request_params_max_tokens_count")
