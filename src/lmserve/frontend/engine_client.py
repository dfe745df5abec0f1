"""The front-end's interface to the API server: what the server may ask of the engine, and nothing else, so that the
server can be tested against a fake. AsyncLLM implements it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol, runtime_checkable

from lmserve.metrics.stats import RequestTimeline, StepRecord
from lmserve.model_tokenizer import FimTokens
from lmserve.outputs import PoolingOutput, RequestOutput
from lmserve.pooling_config import PoolingConfig
from lmserve.pooling_params import PoolingParams
from lmserve.sampling_params import SamplingParams


@runtime_checkable
class EngineClient(Protocol):
    model_name: str  # served model name
    max_model_len: int
    is_ready: bool  # engine process up and loaded
    errored: bool  # engine process died
    on_step: Callable[[StepRecord], None] | None  # set by the server: called with every engine step's record
    # SamplingParams fields a request gets unless it sets them (--generation-config, --override-generation-config).
    default_sampling: dict[str, Any]
    # The model's fill-in-the-middle tokens (GGUF metadata or the vocabulary's convention); None: it has none.
    fim_tokens: FimTokens | None
    # "harmony": the model speaks gpt-oss's format (lmserve.harmony renders its prompts; the server parses its output
    # as harmony unless told another parser); None: the chat template's text is the prompt.
    chat_format: str | None
    # An embedding model's pooling (then this server is a pooling runner: embed, no generate); None: generative.
    pooling: PoolingConfig | None
    embedding_size: int  # the length of an embedding model's vectors (0 for a generative model)

    def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str, priority: int = 0,
        arrival_time: float | None = None, final_only: bool = False, cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields delta RequestOutputs: only the children that changed, with text, token ids and logprobs new since
        the previous yield; the last one has finished=True. With `final_only`, yields once: the whole output, when
        the request has finished (the front-end's own accumulation; the caller keeps no copy of its own).

        Raises ValueError (PromptTooLongError included) for bad input before yielding anything, EngineDeadError if
        the engine dies mid-request. Closing the iterator (or cancelling the task iterating it) aborts the request.
        """
        ...

    async def embed(
        self, prompt: str | list[int], params: PoolingParams, request_id: str, priority: int = 0,
        arrival_time: float | None = None,
    ) -> PoolingOutput:
        """One input's pooled vector (a pooling request through the engine). ValueError for bad input or a
        generative model; cancelling the call aborts the request."""
        ...

    def tokenize_pair(self, first: str, second: str) -> tuple[list[int], int]:
        """A cross-encoder's pair of texts as one prompt, and the position where the second text starts
        (ValueError: empty, or too long for the model)."""
        ...

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool, template_kwargs: dict[str, Any],
        add_special_tokens: bool = False,
    ) -> list[int]:
        """The prompt's token ids: the model's chat template over the messages, tokenized (add_special_tokens: the
        tokenizer's BOS on top of the template's). ValueError names what is wrong with the messages (the template
        raised, or the prompt cannot fit)."""
        ...

    def decode_token(self, token_id: int) -> str:
        """The text of one token on its own (for logprobs)."""
        ...

    def tokenize(self, prompt: str, add_special_tokens: bool, split_special_tokens: bool = False) -> list[int]:
        """The prompt's token ids, checked as generate would (ValueError: too long, not valid text);
        split_special_tokens: the text of a special token is tokenized as text, not as that token."""
        ...

    def detokenize(self, token_ids: list[int]) -> str:
        """The text of the token ids (ValueError: an id outside the vocabulary)."""
        ...

    async def get_stats(self, request_ids: list[str] | None = None) -> dict[str, Any]:
        """Engine gauges and counters: num_requests_running, num_requests_waiting, kv_blocks_used, kv_blocks_free,
        kv_blocks_total, kv_cache_usage_perc, prefix_cache_queries, prefix_cache_hits, num_preemptions, ..."""
        ...

    async def abort(self, request_id: str) -> None:
        """Idempotent; unknown or finished ids are ignored."""
        ...

    def get_timelines(self, request_id: str) -> list[RequestTimeline]:
        """The request's timelines so far (one per engine request); empty when unknown."""
        ...

    def pop_timelines(self, request_id: str) -> list[RequestTimeline]:
        """The request's timelines, forgotten by the client: the server records them once its response is written."""
        ...
