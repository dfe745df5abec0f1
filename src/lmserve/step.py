"""What crosses the scheduler -> executor -> model runner boundary each step, and back: the step's plan and its result;
and, once as the ranks start, what they tell the engine of their model and cache (WorkerInfo).

Below the engine, the executor and the worker (each of them imports it, it imports none of them), as vLLM keeps
SchedulerOutput and ModelRunnerOutput in modules of their own.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any, Protocol

from lmserve.kv_groups import KVCacheGroups
from lmserve.outputs import Logprobs
from lmserve.pooling_params import PoolingParams
from lmserve.sampling_params import SamplingParams

# The token of a position planned before it was sampled (async scheduling): the runner fills in its own last sample.
PLACEHOLDER_TOKEN_ID = -1


@dataclass
class ScheduledRequest:
    """One request's share of a step: positions [start, start + len(token_ids))."""

    request_id: str
    token_ids: list[int]  # tokens of the scheduled positions
    start_position: int  # == the request's num_computed_tokens before this step
    block_ids: list[int]  # the request's whole block table (KV-cache group 0's: lmserve.kv_groups)
    samples: bool  # True when the last scheduled position is the request's last known token
    sampling_params: SamplingParams
    # For penalties; references, not copies: the runner only reads them.
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: list[int] = field(default_factory=list)  # for min_tokens: EOS is held back until then
    # Prompt logprobs to compute in this chunk: the chunk's rows from prompt_logprobs_row on score these prompt
    # tokens (each row predicts the next position's token); the top num_prompt_logprobs come with each.
    prompt_logprob_targets: list[int] = field(default_factory=list)
    prompt_logprobs_row: int = 0
    num_prompt_logprobs: int = 0
    # Async scheduling: planned while the batch that samples this position's token is still in flight, so token_ids
    # is [PLACEHOLDER_TOKEN_ID] and output_token_ids lacks that token; the runner uses the one it sampled last.
    uses_previous_token: bool = False
    # With sliding-window layers in groups of their own: every group's table, group 0's first (empty otherwise).
    group_block_ids: list[list[int]] = field(default_factory=list)
    # Speculative decoding: the guesses for the tokens after this step's first one (its last len(...) positions);
    # every position samples, and the runner keeps the drafts up to the first one its own samples refuse.
    draft_token_ids: list[int] = field(default_factory=list)
    # A pooling request: token_ids is its whole prompt (a bidirectional encoder sees every position at once), and the
    # runner returns its pooled vector (ModelRunnerOutput.pooled) instead of sampling.
    pooling_params: PoolingParams | None = None
    # A hybrid model's request (linear-attention layers): the state slot the engine gave it at admission, whose
    # conv and recurrent states the runner reads and updates; it starts empty at start_position 0. -1: none.
    state_slot: int = -1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    # Requests that ended (finished, aborted, preempted) since the last step: the runner drops their state, except
    # what a preempted request needs when it resumes (its sampling generator).
    finished_request_ids: set[str] = field(default_factory=set)
    preempted_request_ids: set[str] = field(default_factory=set)
    num_batched_tokens: int = 0
    # The grammars of the constrained requests that sample this step, or None: engine.grammar.GrammarBatch for a
    # runner in the engine's process, GrammarMasks for ranks in other processes.
    grammar: StepGrammar | None = None
    # Prefill/decode disaggregation (distributed/kv_storage.py): (request id, block id, pinned file) to read into the
    # cache beside the forward passes (the request runs once the ranks report its load done: ModelRunnerOutput.
    # finished_kv_loads), and (block id, block hash hex) to write out after this step's forward pass.
    kv_loads: list[tuple[str, int, str]] = field(default_factory=list)
    kv_saves: list[tuple[int, str]] = field(default_factory=list)
    kv_loads_pending: bool = False  # requests wait for their loads: the ranks report them even with nothing to run

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.kv_loads and not self.kv_loads_pending


class StepGrammar(Protocol):
    """What the worker may do with the grammars of a step's constrained rows (SchedulerOutput.grammar): ask for their
    masks, test a token, and, where the matchers live in the runner's process, advance a matcher over a drafted row's
    drafts and roll it back. The matchers themselves stay the engine's: the engine accepts the step's tokens after it."""

    masked_first: list[str]  # requests whose rows are masked before their first draw (the others draw, then check)

    @property
    def request_ids(self) -> Collection[str]:
        """The constrained requests among the step's sampling rows."""
        ...

    def fill(self, request_ids: list[str]) -> Any:
        """The allowed next tokens of these requests: xgrammar's packed bitmask, int32 [rows, ceil(vocab / 32)]."""
        ...

    def allows(self, request_id: str, token_id: int) -> bool:
        """Whether the grammar takes this token next; the matcher is left as it was."""
        ...

    def accept(self, request_id: str, token_id: int) -> bool:
        """Advances the matcher by one token (False, and not advanced, where the grammar refuses it)."""
        ...

    def rollback(self, request_id: str, num_tokens: int) -> None:
        """Takes back the last `num_tokens` that accept() advanced the matcher by."""
        ...


@dataclass
class GrammarMasks:
    """The constrained rows' allowed tokens for ranks in other processes, which cannot reach the engine's grammar
    matchers: every row masked before its draw (vLLM V1's GrammarOutput). The engine sends the step first and fills
    the masks while the ranks run its forward pass; the driver rank `receive`s them when it samples (vLLM splits
    execute_model and sample_tokens the same way). Plain data: it pickles."""

    matchers: dict[str, int]  # request id -> its row of the mask (the name the runner reads for constrained rows)
    masked_first: list[str]
    mask: Any = None  # xgrammar's packed bitmask, int32 [rows, ceil(vocab / 32)]; None until it arrives
    receive: Callable[[], Any] | None = field(default=None, repr=False, compare=False)  # set where it is decoded

    def fill(self, request_ids: list[str]) -> Any:
        if self.mask is None:
            if self.receive is None:
                raise RuntimeError("the grammar masks of this step never came: nothing receives them here")
            self.mask = self.receive()
        return self.mask[[self.matchers[r] for r in request_ids]]

    @property
    def request_ids(self) -> Collection[str]:
        return self.matchers.keys()

    def allows(self, request_id: str, token_id: int) -> bool:
        raise AssertionError("every row of a GrammarMasks batch is masked before its draw")

    def accept(self, request_id: str, token_id: int) -> bool:
        raise AssertionError("ranks in other processes verify no drafts of constrained requests")

    def rollback(self, request_id: str, num_tokens: int) -> None:
        raise AssertionError("ranks in other processes verify no drafts of constrained requests")

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "receive": None}  # a receiver belongs to the process that set it


@dataclass
class ModelRunnerOutput:
    # Only requests whose ScheduledRequest.samples was True appear here.
    sampled_token_ids: dict[str, int]
    logprobs: dict[str, Logprobs] = field(default_factory=dict)
    # Per request that asked for them: the prompt logprobs its chunk scored, in prompt order.
    prompt_logprobs: dict[str, list[Logprobs]] = field(default_factory=dict)
    # Per request that verified drafts: the drafts kept, which come before its sampled_token_ids entry (and their
    # logprobs where the request asked for them).
    accepted_draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    accepted_draft_logprobs: dict[str, list[Logprobs]] = field(default_factory=dict)
    # Requests whose KV loads (SchedulerOutput.kv_loads) this rank finished since its last report.
    finished_kv_loads: list[str] = field(default_factory=list)
    # Of those, the requests whose load failed (a block file missing or short): they compute those positions.
    failed_kv_loads: list[str] = field(default_factory=list)
    failed_kv_saves: int = 0  # blocks this rank could not store since its last report (a full or failing disk)
    # Per pooling request of the step: its vector, float32 little-endian (a pooling runner's output).
    pooled: dict[str, bytes] = field(default_factory=dict)


@dataclass(frozen=True)
class WorkerInfo:
    """What the engine needs to know of its ranks' model and cache (the same on every rank)."""

    num_blocks: int
    max_model_len: int
    vocab_size: int
    kv_bytes_per_block: int
    # Prompt tokens and generated ones go through different arithmetic (prompt-bf16), so a block's K/V depends on
    # which of its tokens were prompt tokens: the prefix cache keys such blocks apart (engine/kv_cache.py).
    prompt_rows_computed_apart: bool = False
    kv_groups: KVCacheGroups | None = None  # the layers' KV-cache groups (sliding windows in tables of their own)
    layer_program: str = ""  # how the decoder layers run (ModelRunner.layer_program), for the engine's log and tests
    # "pooling": an encoder's runner (worker/pooling_runner.py) that holds no KV cache; requests are pooling ones.
    runner: str = "generate"
    # A hybrid model's per-request state slots (one per running request at most; 0: the model keeps no such state)
    # and the bytes of one, which the KV memory budget already paid for.
    num_state_slots: int = 0
    state_bytes_per_slot: int = 0
