"""What the engine core emits to the front-end (the step's plan and result between scheduler and runner: lmserve.step)."""

from __future__ import annotations

from dataclasses import dataclass, field

from lmserve.outputs import Logprobs


@dataclass
class EngineCoreOutput:
    """What one step produced for one request (new tokens since the last output, and whether it ended)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[Logprobs] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # Sent once, with the first generated token: the logprob of each prompt token after the first.
    prompt_logprobs: list[Logprobs] | None = None
    # A pooling request's vector: float32, little-endian (OpenAI's base64 embedding is these bytes, encoded).
    pooled: bytes | None = None
