"""/v1/rerank and /rerank (the Jina/Cohere shape that vLLM and llama.cpp serve) and /v1/score (vLLM's), on a
cross-encoder: each (query, document) pair is one pooling request whose result is its relevance in [0, 1].

Bounded as /v1/embeddings is (docs/limits.md): the number of documents (pairs), each pair's tokens (the model's
length) and the tokens of all pairs together, all before the engine sees any pair.
"""

from __future__ import annotations

import asyncio
import uuid

import numpy as np
from fastapi import Request
from fastapi.responses import Response
from pydantic import Field

from lmserve.api.middleware import arrival_time
from lmserve.api.protocol import OpenAIModel, OpenAIRequestModel, UsageInfo, _now
from lmserve.api.request_error import RequestError
from lmserve.api.sse import json_response
from lmserve.frontend.engine_client import EngineClient
from lmserve.metrics.recorder import StatsRecorder
from lmserve.pooling_params import MAX_EMBEDDING_INPUTS, MAX_EMBEDDING_TOTAL_TOKENS, PoolingParams
from lmserve.sampling_params import MAX_COUNT


class RerankRequest(OpenAIRequestModel):
    model: str | None = None
    query: str
    documents: list[str] = Field(max_length=MAX_EMBEDDING_INPUTS)
    top_n: int | None = Field(default=None, ge=1, le=MAX_COUNT)
    return_documents: bool = True


class ScoreRequest(OpenAIRequestModel):
    """vLLM's: text_1 against each of text_2 (one string against a list), or pairwise (two lists of one length)."""

    model: str | None = None
    text_1: str | list[str] = Field(max_length=MAX_EMBEDDING_INPUTS)
    text_2: str | list[str] = Field(max_length=MAX_EMBEDDING_INPUTS)

    def pairs(self) -> list[tuple[str, str]]:
        firsts = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        seconds = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        if len(firsts) != len(seconds):
            raise RequestError(f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: send one text_1, or "
                               "as many as text_2", "text_1")
        return list(zip(firsts, seconds, strict=True))


class RerankDocument(OpenAIModel):
    text: str


class RerankResult(OpenAIModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(OpenAIModel):
    total_tokens: int


class RerankResponse(OpenAIModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class ScoreData(OpenAIModel):
    index: int
    object: str = "score"
    score: float


class ScoreResponse(OpenAIModel):
    id: str
    object: str = "list"
    created: int = Field(default_factory=_now)
    model: str
    data: list[ScoreData]
    usage: UsageInfo


async def _scores(client: EngineClient, model_name: str, recorder: StatsRecorder, pairs: list[tuple[str, str]],
                  field: str, raw: Request) -> tuple[list[float], int]:
    """Each pair's relevance, and the tokens of all pairs."""
    if client.pooling is None or client.pooling.task != "score":
        kind = "generates text" if client.pooling is None else "is an embedding model"
        raise RequestError(f"the model {model_name!r} {kind}: reranking and scoring need a cross-encoder (a "
                           "BertForSequenceClassification reranker) or a Qwen3 yes/no reranker (served with "
                           "--rerank-model or --task score)", "model")
    if not pairs:
        raise RequestError(f"{field} must not be empty", field)
    try:
        encoded = await asyncio.to_thread(lambda: [client.tokenize_pair(a, b) for a, b in pairs])
    except ValueError as exc:
        raise RequestError(str(exc), field) from exc
    num_tokens = sum(len(ids) for ids, _ in encoded)
    if num_tokens > MAX_EMBEDDING_TOTAL_TOKENS:
        raise RequestError(f"the pairs have {num_tokens} tokens in all; at most {MAX_EMBEDDING_TOTAL_TOKENS} are "
                           "allowed in one request", field)
    request_id = uuid.uuid4().hex
    ids = [f"score-{request_id}-{i}" for i in range(len(pairs))]
    arrival = arrival_time(raw)
    tasks = [asyncio.ensure_future(client.embed(tokens, PoolingParams(second_segment_start=start), rid,
                                                arrival_time=arrival))
             for (tokens, start), rid in zip(encoded, ids, strict=True)]
    try:
        outputs = await asyncio.gather(*tasks)
    except ValueError as exc:
        raise RequestError.from_value_error(exc) from exc
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for rid in ids:
            recorder.record(client.pop_timelines(rid))
    return [float(np.frombuffer(o.vector, dtype="<f4")[0]) for o in outputs], num_tokens


async def create_rerank(client: EngineClient, model_name: str, recorder: StatsRecorder, req: RerankRequest,
                        raw: Request) -> Response:
    if not req.query:
        raise RequestError("query must not be empty", "query")
    scores, num_tokens = await _scores(client, model_name, recorder, [(req.query, d) for d in req.documents],
                                       "documents", raw)
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[: req.top_n]
    results = [RerankResult(index=i, relevance_score=scores[i],
                            document=RerankDocument(text=req.documents[i]) if req.return_documents else None)
               for i in order]
    return json_response(RerankResponse(id=f"rerank-{uuid.uuid4().hex}", model=model_name,
                                        usage=RerankUsage(total_tokens=num_tokens), results=results))


async def create_score(client: EngineClient, model_name: str, recorder: StatsRecorder, req: ScoreRequest,
                       raw: Request) -> Response:
    scores, num_tokens = await _scores(client, model_name, recorder, req.pairs(), "text_2", raw)
    return json_response(ScoreResponse(
        id=f"score-{uuid.uuid4().hex}", model=model_name,
        data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
        usage=UsageInfo(prompt_tokens=num_tokens, total_tokens=num_tokens),
    ))
