"""A request's state inside the engine core."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from lmserve.outputs import Logprobs
from lmserve.pooling_params import PoolingParams
from lmserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue, its KV freed, to be recomputed
    FINISHED_STOPPED = "stop"  # EOS, a stop token id (or a stop string found by the front-end)
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # Every token id that ends the request as EOS (a model may have several: generation_config's list).
    eos_token_ids: list[int] = field(default_factory=list)
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # Positions whose K/V are in the cache; catches up with num_tokens step by step.
    num_computed_tokens: int = 0
    # Prompt tokens served from the prefix cache the first time this request was scheduled.
    num_cached_tokens: int = -1
    kv_loading: bool = False  # its stored blocks are being read in (--kv-transfer-config): not scheduled until done
    kv_load_start: int = 0  # positions it held before its loaded blocks: where it resumes if the load fails
    num_preemptions: int = 0
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    cache_salt: str | None = None
    # For a child of an n>1 request: the parent's id (what clients know) and this child's index among its siblings.
    parent_id: str | None = None
    index: int = 0
    # Scored prompt tokens (sampling_params.prompt_logprobs): entry i is token i + 1's, given tokens 0..i.
    prompt_logprobs: list[Logprobs] = field(default_factory=list)
    grammar: Any = None  # engine.grammar.GrammarState of a constrained request (structured_outputs)
    # A pooling request: its whole prompt in one step, a pooled vector instead of a token, then it ends.
    pooling_params: PoolingParams | None = None

    @property
    def num_prompt_logprobs_missing(self) -> int:
        if self.sampling_params.prompt_logprobs is None:
            return 0
        return max(0, self.num_prompt_tokens - 1 - len(self.prompt_logprobs))

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    def token_at(self, position: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[position] if position < n else self.output_token_ids[position - n]

    def token_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        return (self.prompt_token_ids + self.output_token_ids)[start:end]
