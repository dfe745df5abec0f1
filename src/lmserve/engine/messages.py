"""Messages between the front-end process and the engine-core process (msgspec over ZMQ)."""

from __future__ import annotations

import msgspec

from lmserve.engine.outputs import EngineCoreOutput
from lmserve.metrics.stats import EngineStats, StepRecord
from lmserve.pooling_params import PoolingParams
from lmserve.sampling_params import SamplingParams


# ---- front-end → engine -------------------------------------------------------------------------------------
class AddRequest(msgspec.Struct, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    priority: int
    arrival_time: float
    parent_id: str | None = None  # for a child of an n>1 request
    index: int = 0
    cache_salt: str | None = None  # prefix-cache blocks are shared only between requests with the same salt
    pooling_params: PoolingParams | None = None  # a pooling request (an embedding): no decode, one vector back


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class FinishRequests(msgspec.Struct, tag="finish"):
    """The front-end found a stop string: stop computing these requests."""

    request_ids: list[str]


class GetStats(msgspec.Struct, tag="get_stats"):
    call_id: int
    request_ids: list[str] = []  # also report these requests' computed positions and status


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


EngineInput = AddRequest | AbortRequests | FinishRequests | GetStats | Shutdown


# ---- engine → front-end -------------------------------------------------------------------------------------
class Ready(msgspec.Struct, tag="ready"):
    max_model_len: int
    vocab_size: int
    num_blocks: int
    block_size: int
    eos_token_ids: list[int] = []  # the model config's (the front-end adds its tokenizer's)


class StepOutputs(msgspec.Struct, tag="outputs"):
    outputs: list[EngineCoreOutput]
    step: StepRecord | None = None  # None when the outputs come from an abort outside a step
    queued: dict[str, float] = {}  # requests the engine received since the last message -> when


class StatsReply(msgspec.Struct, tag="stats"):
    call_id: int
    stats: EngineStats


class RequestRejected(msgspec.Struct, tag="rejected"):
    """The engine refused an AddRequest (the front-end validates first; this is its last line of defence)."""

    request_id: str
    message: str


class EngineFailed(msgspec.Struct, tag="failed"):
    """The engine hit an unrecoverable error (e.g. the model failed to load) and is exiting."""

    message: str


EngineOutput = Ready | StepOutputs | StatsReply | RequestRejected | EngineFailed
