"""Messages between the front-end process and the engine-core process (msgspec over ZMQ)."""

from __future__ import annotations

import msgspec

from lmserve.engine.outputs import EngineCoreOutput
from lmserve.sampling_params import SamplingParams


# ---- front-end → engine -------------------------------------------------------------------------------------
class AddRequest(msgspec.Struct, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    priority: int
    arrival_time: float


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
class EngineStats(msgspec.Struct):
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    kv_blocks_cached_free: int = 0
    kv_cache_usage_perc: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_requests_aborted: int = 0
    num_steps: int = 0
    # Only for the request ids a GetStats asked about: positions computed so far, and status.
    request_positions: dict[str, int] = {}
    request_status: dict[str, str] = {}


class Ready(msgspec.Struct, tag="ready"):
    max_model_len: int
    vocab_size: int
    num_blocks: int
    block_size: int


class StepRecord(msgspec.Struct):
    """What one engine step did, stamped with the engine's clock (lmserve.metrics.clock)."""

    index: int
    start: float
    end: float
    forward_s: float  # of end - start, the time inside the model runner (forward + sampling)
    prefill: dict[str, int]  # request id -> prompt positions computed (recomputation after preemption included)
    decode: dict[str, int]  # request id -> positions computed while generating (1 each without speculation)
    preempted: list[str]
    num_running: int
    num_waiting: int
    num_sampled: int = 0  # tokens sampled (one per request whose last scheduled position was its newest token)

    @property
    def num_positions(self) -> int:
        return sum(self.prefill.values()) + sum(self.decode.values())

    @property
    def duration_s(self) -> float:
        return self.end - self.start


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
