"""Several models behind one API (`lmserve serve CHAT --embedding-model EMB --rerank-model RR`): each model is its own
engine client (its own engine process, from the front-end's AsyncLLM) and its own OpenAIServing; a request goes to
the one its `model` field names. Nothing below the API knows that there are others.

A request that names no model goes to the first model that can do what it asks: the chat model for the generating
routes, the embedding model for /v1/embeddings, the reranker for /v1/rerank and /v1/score.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Literal

from lmserve.api.errors import ModelNotFoundError
from lmserve.api.request_error import RequestError
from lmserve.api.serving import OpenAIServing
from lmserve.frontend.errors import EngineDeadError, EngineNotReadyError

# A handful of engines side by side, not a model zoo: each is a process with its own weights and KV cache.
MAX_SERVED_MODELS = 4

Task = Literal["generate", "embed", "score"]


def _task_of(serving: OpenAIServing) -> Task:
    pooling = serving.client.pooling
    if pooling is None:
        return "generate"
    return "embed" if pooling.task == "embed" else "score"


def check_ready(serving: OpenAIServing) -> None:
    """EngineDeadError (503) or EngineNotReadyError (503) for this model's engine; with several models the message
    names the model, so that a client knows which one."""
    client = serving.client
    if client.errored:
        raise EngineDeadError(f"the engine process of the model {serving.model_name!r} has died; restart the server")
    if not client.is_ready:
        raise EngineNotReadyError(f"the engine of the model {serving.model_name!r} is still starting; retry shortly")


class ServedModels:
    """The servings by every name a request may use; the first is the primary model (the dashboard's, /debug's)."""

    def __init__(self, servings: Sequence[OpenAIServing]) -> None:
        if not 1 <= len(servings) <= MAX_SERVED_MODELS:
            raise ValueError(f"serve from 1 to {MAX_SERVED_MODELS} models in one server, got {len(servings)}")
        self.servings = list(servings)
        self.by_name: dict[str, OpenAIServing] = {}
        for serving in servings:
            for name in serving.model_names:
                if name in self.by_name:
                    raise ValueError(f"two models are served as {name!r}: give each its own name")
                self.by_name[name] = serving

    @property
    def primary(self) -> OpenAIServing:
        return self.servings[0]

    def __iter__(self) -> Iterator[OpenAIServing]:
        return iter(self.servings)

    def __len__(self) -> int:
        return len(self.servings)

    @property
    def names(self) -> list[str]:
        return list(self.by_name)

    def pick(self, requested: str | None, task: Task | None = None) -> OpenAIServing:
        """The serving for a request's `model` (404 model_not_found for an unknown name, as vLLM and OpenAI answer);
        with no name, the first model that does `task`. With several models, a model that cannot do `task` is the
        client's 400 here; with one, the serving's own checks answer as they always have."""
        if requested is None:
            serving = next((s for s in self.servings if task is None or _task_of(s) == task), self.primary)
        else:
            found = self.by_name.get(requested)
            if found is None:
                served = ", ".join(map(repr, self.names))
                raise ModelNotFoundError(f"the model {requested!r} does not exist; this server serves {served}")
            serving = found
        if len(self.servings) > 1:
            check_ready(serving)
            if task is not None and _task_of(serving) != task:
                raise RequestError(_wrong_task(serving, task), "model")
        return serving

    def check_all_ready(self) -> None:
        """/health: every model's engine up."""
        if len(self.servings) == 1:
            _check_single(self.primary)
        for serving in self.servings:
            check_ready(serving)

    def check_any_ready(self) -> None:
        """Before a /v1 route reads its body: 503 while no engine can answer (each request's model is checked once
        its body names it)."""
        if len(self.servings) == 1:
            _check_single(self.primary)
        elif all(s.client.errored for s in self.servings):
            raise EngineDeadError("every engine process has died; restart the server")
        elif not any(s.client.is_ready for s in self.servings):
            raise EngineNotReadyError("the engines are still starting; retry shortly")


def _check_single(serving: OpenAIServing) -> None:
    # One model: the messages it has always had.
    if serving.client.errored:
        raise EngineDeadError("the engine process has died; restart the server")
    if not serving.client.is_ready:
        raise EngineNotReadyError("the engine is still starting; retry shortly")


def _wrong_task(serving: OpenAIServing, task: Task) -> str:
    name, does = serving.model_name, _task_of(serving)
    what = {"generate": "a generative model: it serves completions and chat",
            "embed": "an embedding model: it serves /v1/embeddings",
            "score": "a reranker (a cross-encoder): it serves /v1/rerank and /v1/score"}
    route = {"generate": "text generation", "embed": "embeddings", "score": "reranking or scoring"}
    return f"the model {name!r} is {what[does]}, not {route[task]}; name a model that does"
