"""/v1/embeddings of a decoder embedding model (a tiny random Qwen3-Embedding in sentence-transformers' layout) on a
real server over HTTP: the `openai` client's embeddings.create against transformers' Qwen3Model pooled at the last
token, with the instruction prompt its config_sentence_transformers.json names put before the text when the request
asks for it (TEI's prompt_name)."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from embedding_models import QWEN3_QUERY_PROMPT, reference_decoder_embeddings, save_tiny_decoder_embedder
from server_process import Server, start_server

MODEL = "tiny-qwen3-embedding"
TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "a long document about retrieval " * 8]


@pytest.fixture(scope="module")
def embedder_dir(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> Path:
    return save_tiny_decoder_embedder(tmp_path_factory.mktemp("qwen3-embedding"), "qwen3", default_tokenizer)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, embedder_dir: Path) -> Iterator[Server]:
    started = start_server(tmp_path_factory.mktemp("qwen3-embed"), "--model", str(embedder_dir), "--dtype",
                           "float32", "--max-model-len", "256", "--served-model-name", MODEL)
    try:
        yield started
    finally:
        started.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def oai(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=60)


def test_embeddings_with_and_without_the_instruction_prompt(oai: openai.OpenAI, embedder_dir: Path,
                                                            default_tokenizer) -> None:
    for prompt_name, prefix in ((None, ""), ("query", QWEN3_QUERY_PROMPT), ("document", "")):
        extra = {} if prompt_name is None else {"prompt_name": prompt_name}
        response = oai.embeddings.create(model=MODEL, input=TEXTS, extra_body=extra)
        ours = torch.tensor([d.embedding for d in response.data])
        ids = [default_tokenizer(prefix + text)["input_ids"] for text in TEXTS]
        reference = reference_decoder_embeddings(embedder_dir, ids)
        assert torch.nn.functional.cosine_similarity(ours, reference).min() >= 0.9999
        assert response.usage.prompt_tokens == sum(map(len, ids))
    # One text alone gets the vector it got in the batch.
    query = {"prompt_name": "query"}
    batched = oai.embeddings.create(model=MODEL, input=TEXTS, extra_body=query).data[2].embedding
    alone = oai.embeddings.create(model=MODEL, input=TEXTS[2], extra_body=query).data[0].embedding
    torch.testing.assert_close(torch.tensor(alone), torch.tensor(batched), atol=1e-6, rtol=1e-5)


def test_an_unknown_prompt_name_is_a_400_naming_it(server: Server) -> None:
    for body in ({"model": MODEL, "input": "hello", "prompt_name": "passage"},
                 {"model": MODEL, "input": [1, 2, 3], "prompt_name": "query"}):
        response = httpx.post(f"{server.base_url}/v1/embeddings", json=body, timeout=30)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "prompt_name"
