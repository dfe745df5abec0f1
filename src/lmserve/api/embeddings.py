"""/v1/embeddings in OpenAI's shape (vLLM's extras: truncate_prompt_tokens, priority): inputs in, vectors out.

Every input is one pooling request through the engine (frontend AsyncLLM.embed), all of them at once so that the
scheduler batches them. Bounded before anything is tokenized or sent (docs/limits.md): the number of inputs, each
input's tokens (the model's length, unless truncate_prompt_tokens cuts it), and the tokens of all inputs together.
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from typing import Any, Literal

import numpy as np
from fastapi import Request
from fastapi.responses import Response
from pydantic import Field, field_validator

from lmserve.api.middleware import arrival_time
from lmserve.api.protocol import PRIORITY_RANGE, OpenAIModel, OpenAIRequestModel, Prompt, UsageInfo, _now
from lmserve.api.request_error import RequestError
from lmserve.api.sse import json_response
from lmserve.frontend.engine_client import EngineClient
from lmserve.metrics.recorder import StatsRecorder
from lmserve.outputs import PoolingOutput
from lmserve.pooling_params import MAX_EMBEDDING_INPUTS, MAX_EMBEDDING_TOTAL_TOKENS, PoolingParams
from lmserve.sampling_params import MAX_COUNT

MAX_USER_CHARS = 256


def _is_token_ids(value: list) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) for t in value)


class EmbeddingRequest(OpenAIRequestModel):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1, le=MAX_COUNT)
    user: str | None = Field(default=None, max_length=MAX_USER_CHARS)
    # vLLM's: keep the last k tokens of each input (-1: the model's length).
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1, le=MAX_COUNT)
    priority: int = Field(default=0, ge=PRIORITY_RANGE[0], le=PRIORITY_RANGE[1])
    # Hugging Face TEI's (sentence-transformers' prompt_name): the instruction prompt of the model's
    # config_sentence_transformers.json put before each text (Qwen3-Embedding's "query"); default: the model's
    # default_prompt_name, or none.
    prompt_name: str | None = Field(default=None, max_length=MAX_USER_CHARS)

    @field_validator("input", mode="before")
    @classmethod
    def _check_input_shape(cls, value: Any) -> Any:
        # One clear message instead of one per member of the union, and the count bounded before anything else.
        if isinstance(value, str):
            return value
        if not isinstance(value, list) or not (
            _is_token_ids(value) or all(isinstance(p, str) for p in value)
            or all(isinstance(p, list) and _is_token_ids(p) for p in value)
        ):
            raise ValueError("input must be a string, a list of strings, a list of token ids or a list of such lists")
        if value and not _is_token_ids(value) and len(value) > MAX_EMBEDDING_INPUTS:
            raise ValueError(f"input has {len(value)} items; at most {MAX_EMBEDDING_INPUTS} are allowed")
        return value

    def inputs(self) -> list[Prompt]:
        value = self.input
        inputs: list[Prompt] = [value] if isinstance(value, str) or (value and isinstance(value[0], int)) \
            else list(value)  # type: ignore[arg-type]
        if not inputs or any(len(p) == 0 for p in inputs):
            raise RequestError("input must not be empty (nor any of its items)", "input")
        if self.truncate_prompt_tokens == 0:
            raise RequestError("truncate_prompt_tokens must be -1 or at least 1", "truncate_prompt_tokens")
        return inputs


class EmbeddingData(OpenAIModel):
    object: str = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingResponse(OpenAIModel):
    id: str
    object: str = "list"
    created: int = Field(default_factory=_now)
    model: str
    data: list[EmbeddingData]
    usage: UsageInfo


def _encoded(vector: bytes, encoding_format: str) -> list[float] | str:
    # OpenAI's base64 is the float32 little-endian bytes; the engine sends exactly those.
    if encoding_format == "base64":
        return base64.b64encode(vector).decode("ascii")
    return np.frombuffer(vector, dtype="<f4").tolist()


def _token_ids(client: EngineClient, inputs: list[Prompt], prefix: str = "") -> list[list[int]]:
    """Each input's token ids: a text, after the instruction prompt `prefix`, tokenized as the model's tokenizer does
    with its special tokens ([CLS] ... [SEP] for BERT, as sentence-transformers encodes); token ids as they are
    (checked by the front-end)."""
    return [client.tokenize(prefix + p, add_special_tokens=True) if isinstance(p, str) else list(p) for p in inputs]


def _prompt_prefix(client: EngineClient, req: EmbeddingRequest, inputs: list[Prompt]) -> str:
    """The text put before each input, as sentence-transformers' encode(prompt_name=...) puts it."""
    assert client.pooling is not None
    names = [name for name, _ in client.pooling.prompts]
    if req.prompt_name is not None:
        if req.prompt_name not in names:
            raise RequestError(f"prompt_name {req.prompt_name!r}: this model declares "
                               f"{', '.join(map(repr, names)) or 'no prompts'}", "prompt_name")
        if any(not isinstance(p, str) for p in inputs):
            raise RequestError("prompt_name applies to text inputs; these are token ids", "prompt_name")
    return client.pooling.prompt(req.prompt_name)


def _check_dimensions(client: EngineClient, dimensions: int | None) -> None:
    if dimensions is None:
        return
    pooling = client.pooling
    if pooling is None or not pooling.accepts_dimensions(dimensions, client.embedding_size):
        declared = ("" if pooling is None else "any size up to its own" if pooling.any_dimensions
                    else ", ".join(map(str, pooling.matryoshka_dimensions)) or "none")
        raise RequestError(f"dimensions={dimensions}: this model does not support it (the Matryoshka dimensions it "
                           f"declares: {declared}; its vectors have {client.embedding_size})", "dimensions")


async def create_embedding(client: EngineClient, model_name: str, recorder: StatsRecorder, req: EmbeddingRequest,
                           raw: Request) -> Response:
    if client.pooling is None:
        raise RequestError(f"the model {model_name!r} generates text: it has no embeddings (serve an embedding "
                           "model, such as a BERT sentence-transformers directory, for /v1/embeddings)", "model")
    if client.pooling.task != "embed":
        raise RequestError(f"the model {model_name!r} is a reranker (a cross-encoder): it scores pairs of texts "
                           "on /v1/rerank and /v1/score, and has no embeddings", "model")
    inputs = req.inputs()
    _check_dimensions(client, req.dimensions)
    prefix = _prompt_prefix(client, req, inputs)
    # Texts tokenized first (off the event loop), so that the tokens of all inputs are bounded before the engine
    # sees any of them.
    try:
        token_ids = await asyncio.to_thread(_token_ids, client, inputs, prefix)
    except ValueError as exc:
        raise RequestError.from_value_error(exc) from exc
    keep = client.max_model_len if req.truncate_prompt_tokens == -1 else req.truncate_prompt_tokens
    num_tokens = sum(len(ids) if keep is None else min(len(ids), keep) for ids in token_ids)
    if num_tokens > MAX_EMBEDDING_TOTAL_TOKENS:
        raise RequestError(f"input has {num_tokens} tokens in all; at most {MAX_EMBEDDING_TOTAL_TOKENS} are allowed "
                           "in one request", "input")
    params = PoolingParams(dimensions=req.dimensions, truncate_prompt_tokens=req.truncate_prompt_tokens)
    request_id = f"embd-{uuid.uuid4().hex}"
    arrival = arrival_time(raw)
    ids = [f"{request_id}-{i}" for i in range(len(inputs))]
    tasks = [asyncio.ensure_future(client.embed(p, params, rid, req.priority, arrival))
             for p, rid in zip(token_ids, ids, strict=True)]
    try:
        outputs: list[PoolingOutput] = await asyncio.gather(*tasks)
    except ValueError as exc:  # a bad input (too long, outside the vocabulary): the others are aborted
        raise RequestError.from_value_error(exc) from exc
    finally:
        for task in tasks:
            task.cancel()  # a finished task ignores it; one still waiting aborts its engine request
        await asyncio.gather(*tasks, return_exceptions=True)
        for rid in ids:
            recorder.record(client.pop_timelines(rid))
    num_tokens = sum(o.num_prompt_tokens for o in outputs)
    return json_response(EmbeddingResponse(
        id=request_id, model=model_name,
        data=[EmbeddingData(index=i, embedding=_encoded(o.vector, req.encoding_format)) for i, o in enumerate(outputs)],
        usage=UsageInfo(prompt_tokens=num_tokens, total_tokens=num_tokens),
    ))
