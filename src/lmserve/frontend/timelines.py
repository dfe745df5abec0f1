"""Keeps each in-flight request's timeline, filled from engine step records and from the output processor.

The stamps are taken in the process where each event happens (see lmserve.metrics.stats); this class only puts
them in the right timeline. Finished timelines stay until the API takes them (after writing the last byte), up to
a bound, so a caller that never takes them leaks nothing.
"""

from __future__ import annotations

from collections import OrderedDict

from lmserve.engine.messages import StepOutputs
from lmserve.metrics.clock import now
from lmserve.metrics.stats import RequestTimeline, StepSpan

# Finished timelines kept for the API to take (a request whose caller never takes them drops out after this many).
KEPT_FINISHED = 1024


class TimelineTracker:
    def __init__(self) -> None:
        self.by_parent: OrderedDict[str, list[RequestTimeline]] = OrderedDict()
        self.by_child: dict[str, RequestTimeline] = {}  # in-flight engine requests only

    def add(
        self, parent_id: str, child_ids: list[str], arrival: float, input_processed: float, num_prompt_tokens: int,
        max_tokens: int | None = None,
    ) -> None:
        timelines = [
            RequestTimeline(child_id, parent_id, arrival, input_processed, num_prompt_tokens=num_prompt_tokens,
                            counts_prompt=index == 0, n=len(child_ids), max_tokens=max_tokens)
            for index, child_id in enumerate(child_ids)
        ]
        self.by_parent[parent_id] = timelines
        self.by_child.update((t.request_id, t) for t in timelines)
        self._trim()

    def on_engine_message(self, message: StepOutputs) -> None:
        for request_id, stamp in message.queued.items():
            if (timeline := self.by_child.get(request_id)) is not None:
                timeline.queued = stamp
        step = message.step
        if step is not None:
            for request_id in step.preempted:
                if (timeline := self.by_child.get(request_id)) is not None:
                    timeline.preemptions.append(step.start)
            for positions, is_prefill in ((step.prefill, True), (step.decode, False)):
                for request_id, n in positions.items():
                    if (timeline := self.by_child.get(request_id)) is None:
                        continue
                    if timeline.scheduled is None:
                        timeline.scheduled = step.start
                    timeline.steps.append(StepSpan(step.index, step.start, step.end, n, is_prefill))
        for out in message.outputs:
            timeline = self.by_child.get(out.request_id)
            if timeline is None or not out.new_token_ids or step is None:
                continue
            if timeline.steps and timeline.steps[-1].index == step.index:
                timeline.steps[-1].new_tokens += len(out.new_token_ids)
            if timeline.first_token is None:
                timeline.first_token = step.end
            timeline.num_cached_tokens = max(timeline.num_cached_tokens, out.num_cached_tokens)

    def on_text(self, request_id: str, has_text: bool, num_output_tokens: int, finish_reason: str | None) -> None:
        """The output processor produced a delta for this engine request."""
        timeline = self.by_child.get(request_id)
        if timeline is None:
            return
        stamp = now()
        if has_text and timeline.first_chunk is None:
            timeline.first_chunk = stamp
        timeline.num_output_tokens = num_output_tokens
        if finish_reason is not None:
            self._finish(timeline, stamp, finish_reason)

    def abort(self, parent_id: str) -> None:
        stamp = now()
        for timeline in self.by_parent.get(parent_id, ()):
            if timeline.finished is None:
                self._finish(timeline, stamp, "abort")

    def get(self, parent_id: str) -> list[RequestTimeline]:
        return list(self.by_parent.get(parent_id, ()))

    def pop(self, parent_id: str) -> list[RequestTimeline]:
        timelines = self.by_parent.pop(parent_id, [])
        for timeline in timelines:
            self.by_child.pop(timeline.request_id, None)
        return timelines

    def _finish(self, timeline: RequestTimeline, stamp: float, reason: str) -> None:
        timeline.finished, timeline.finish_reason = stamp, reason
        self.by_child.pop(timeline.request_id, None)

    def _trim(self) -> None:
        finished = len(self.by_parent) - len({t.parent_id for t in self.by_child.values()})
        while finished > KEPT_FINISHED:
            parent_id = next((p for p, ts in self.by_parent.items() if all(t.finished for t in ts)), None)
            if parent_id is None:
                return
            self.pop(parent_id)
            finished -= 1
