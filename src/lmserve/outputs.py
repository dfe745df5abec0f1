"""What users get back: vLLM's RequestOutput / CompletionOutput shape, so their code ports."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field


@dataclass
class Logprobs:
    """Log-probabilities at one sampled position: the sampled token's, then the top-n."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: list[tuple[int, float]]  # (token id, logprob), most likely first


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string, None for EOS or length
    # SamplingParams.n_indent ended it (finish_reason "stop", stop_reason None): llama.cpp's stop_type "limit".
    indent_stop: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cumulative_logprob(self) -> float | None:
        return None if self.logprobs is None else sum(lp.logprob for lp in self.logprobs)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: dict | None = None
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (nothing precedes it).
    prompt_logprobs: list[Logprobs | None] | None = None


@dataclass
class PoolingOutput:
    """A pooling request's result (an embedding): vLLM's PoolingRequestOutput, its vector as the engine sends it."""

    request_id: str
    prompt_token_ids: list[int]
    vector: bytes  # float32, little-endian

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def embedding(self) -> list[float]:
        """The vector as Python floats (vLLM's outputs.embedding)."""
        return list(struct.unpack(f"<{len(self.vector) // 4}f", self.vector))
