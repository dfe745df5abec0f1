"""A step's plan as it travels to ranks in other processes: each request's prompt, sampling settings and history once,
then per step only what changed (vLLM V1's new-request and cached-request data, in lmserve's own types).

Sent whole, a SchedulerOutput carries every scheduled request's prompt, output so far and block tables each step: at
256 decodes of 2,500 positions ~2.7 MB pickled to every rank every step, for a step that adds one token a request.
StepEncoder (in the engine process) remembers what each rank was sent; StepDecoder (in each rank) keeps the request's
lists and rebuilds the ScheduledRequests the runner reads, equal field for field to those the engine planned. Both
see the same messages in the same order (one sender, ordered sockets or actor calls), so they agree on what was sent:
- a request is sent whole the first time, and again after it ended or was preempted (finished_request_ids), when
  both sides drop it;
- its output tokens are sent as the ones after those already sent (Request.output_token_ids only grows; a rejected
  draft never enters it);
- its block tables as the part after the longest prefix unchanged since the last step (they grow, shrink when drafts
  are rolled back, and sliding-window groups blank blocks that leave the window).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from lmserve.sampling_params import SamplingParams
from lmserve.step import ScheduledRequest, SchedulerOutput


@dataclass
class ListTail:
    """A list as the first `keep` items of the copy the receiver holds, then `tail`."""

    keep: int
    tail: list[int]

    @classmethod
    def between(cls, sent: list[int], now: list[int]) -> ListTail:
        """The tail of `now` after its longest common prefix with `sent`."""
        n = len(sent)
        if len(now) >= n and now[:n] == sent:  # the usual case: only appended
            return cls(n, now[n:])
        keep, limit = 0, min(n, len(now))
        while keep < limit and sent[keep] == now[keep]:
            keep += 1
        return cls(keep, now[keep:])

    def apply(self, held: list[int]) -> None:
        del held[self.keep :]
        held.extend(self.tail)


@dataclass
class NewRequestData:
    """What does not change while a request runs: sent the first time it is scheduled (after any preemption too)."""

    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]


@dataclass
class RequestStep:
    """One request's share of a step on the wire: the ScheduledRequest's own small fields, and its lists as tails."""

    scheduled: ScheduledRequest  # its prompt, output and block lists left empty; sampling_params those of new, or None
    new: NewRequestData | None
    output: ListTail
    blocks: ListTail
    group_blocks: list[ListTail] = field(default_factory=list)


@dataclass
class StepMessage:
    """SchedulerOutput with `scheduled` replaced by the requests' RequestSteps."""

    output: SchedulerOutput  # with scheduled = []
    steps: list[RequestStep]


@dataclass
class _Sent:
    output_len: int = 0
    blocks: list[int] = field(default_factory=list)
    group_blocks: list[list[int]] = field(default_factory=list)


_EMPTIED = {"prompt_token_ids": [], "output_token_ids": [], "block_ids": [], "group_block_ids": [], "eos_token_ids": []}


class StepEncoder:
    def __init__(self) -> None:
        self._sent: dict[str, _Sent] = {}

    @property
    def num_requests(self) -> int:
        """Requests the ranks hold now."""
        return len(self._sent)

    def encode(self, scheduler_output: SchedulerOutput) -> StepMessage:
        for request_id in scheduler_output.finished_request_ids:
            self._sent.pop(request_id, None)
        steps = []
        for s in scheduler_output.scheduled:
            sent = self._sent.get(s.request_id)
            new = None
            if sent is None:
                sent = self._sent[s.request_id] = _Sent()
                new = NewRequestData(s.prompt_token_ids, s.sampling_params, s.eos_token_ids)
            keep = sent.output_len if len(s.output_token_ids) >= sent.output_len else 0
            groups = [ListTail.between(sent.group_blocks[g] if g < len(sent.group_blocks) else [], table)
                      for g, table in enumerate(s.group_block_ids)]
            steps.append(RequestStep(
                scheduled=dataclasses.replace(s, sampling_params=None, **_EMPTIED),  # type: ignore[arg-type]
                new=new,
                output=ListTail(keep, s.output_token_ids[keep:]),
                blocks=ListTail.between(sent.blocks, s.block_ids),
                group_blocks=groups,
            ))
            sent.output_len = len(s.output_token_ids)
            sent.blocks = list(s.block_ids)
            sent.group_blocks = [list(t) for t in s.group_block_ids]
        return StepMessage(dataclasses.replace(scheduler_output, scheduled=[]), steps)


@dataclass
class _Held:
    new: NewRequestData
    output_token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    group_block_ids: list[list[int]] = field(default_factory=list)


class StepDecoder:
    def __init__(self) -> None:
        self._held: dict[str, _Held] = {}

    @property
    def num_requests(self) -> int:
        return len(self._held)

    def decode(self, message: StepMessage) -> SchedulerOutput:
        output = message.output
        for request_id in output.finished_request_ids:
            self._held.pop(request_id, None)
        scheduled = []
        for step in message.steps:
            s = step.scheduled
            if step.new is not None:
                self._held[s.request_id] = _Held(step.new)
            held = self._held[s.request_id]
            step.output.apply(held.output_token_ids)
            step.blocks.apply(held.block_ids)
            del held.group_block_ids[len(step.group_blocks) :]
            held.group_block_ids.extend([] for _ in range(len(step.group_blocks) - len(held.group_block_ids)))
            for tail, table in zip(step.group_blocks, held.group_block_ids, strict=True):
                tail.apply(table)
            # Copies of the block tables, as the engine sends a fresh list each step: a runner may keep a step's.
            scheduled.append(dataclasses.replace(
                s, prompt_token_ids=held.new.prompt_token_ids, sampling_params=held.new.sampling_params,
                eos_token_ids=held.new.eos_token_ids, output_token_ids=held.output_token_ids,
                block_ids=list(held.block_ids), group_block_ids=[list(t) for t in held.group_block_ids],
            ))
        return dataclasses.replace(output, scheduled=scheduled)
