"""Turns engine outputs (token ids) into text deltas per request: detokenize, find stop strings (and llama.cpp's
n_indent), fan n>1 back in."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lmserve.engine.outputs import EngineCoreOutput
from lmserve.frontend.detokenizer import IncrementalDetokenizer
from lmserve.outputs import CompletionOutput, Logprobs, RequestOutput
from lmserve.sampling_params import SamplingParams


@dataclass
class ChildState:
    request_id: str
    parent: ParentState
    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    output: CompletionOutput  # everything so far (full text, all kept token ids)


@dataclass
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[ChildState] = field(default_factory=list)
    num_cached_tokens: int = 0
    prompt_logprobs: list[Logprobs | None] | None = None

    @property
    def finished(self) -> bool:
        return all(c.output.finished for c in self.children)

    def full_output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[c.output for c in self.children],
            finished=self.finished,
            num_cached_tokens=self.num_cached_tokens,
            prompt_logprobs=self.prompt_logprobs,
        )


@dataclass
class ProcessedOutputs:
    deltas: list[RequestOutput]  # per parent: only the new text / tokens of children that changed
    requests_to_abort: list[str]  # children that a stop string or n_indent ended in the front-end


def child_request_id(parent_id: str, index: int, n: int) -> str:
    return parent_id if n == 1 else f"{parent_id}-{index}"


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentState] = {}
        self.children: dict[str, ChildState] = {}

    def add_request(
        self, parent_id: str, prompt: str | None, prompt_token_ids: list[int], child_params: list[SamplingParams]
    ) -> list[str]:
        """Registers a request with one child per sample; returns the children's engine request ids."""
        if parent_id in self.parents:
            raise ValueError(f"request id {parent_id!r} is already in use")
        parent = ParentState(parent_id, prompt, prompt_token_ids)
        for index, params in enumerate(child_params):
            child_id = child_request_id(parent_id, index, len(child_params))
            detokenizer = IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, params.stop, params.include_stop_str_in_output,
                params.skip_special_tokens, params.min_tokens, params.n_indent,
            )
            output = CompletionOutput(index=index, logprobs=[] if params.logprobs is not None else None)
            child = ChildState(child_id, parent, index, params, detokenizer, output)
            parent.children.append(child)
            self.children[child_id] = child
        self.parents[parent_id] = parent
        return [c.request_id for c in parent.children]

    def child_ids(self, parent_id: str) -> list[str]:
        parent = self.parents.get(parent_id)
        return [] if parent is None else [c.request_id for c in parent.children if not c.output.finished]

    def parent_id_of(self, child_id: str) -> str | None:
        child = self.children.get(child_id)
        return None if child is None else child.parent.request_id

    def get_parent(self, parent_id: str) -> ParentState | None:
        return self.parents.get(parent_id)

    def remove(self, parent_id: str) -> None:
        parent = self.parents.pop(parent_id, None)
        for child in parent.children if parent else []:
            self.children.pop(child.request_id, None)

    def process_outputs(self, engine_outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        deltas: dict[str, RequestOutput] = {}
        to_abort: list[str] = []
        for eo in engine_outputs:
            child = self.children.get(eo.request_id)
            if child is None or child.output.finished:
                continue  # a stop string already ended it, or its client went away
            delta, stopped_here = self._apply(child, eo)
            if stopped_here and eo.finish_reason is None:  # the engine would go on computing it
                to_abort.append(child.request_id)
            parent = child.parent
            parent.num_cached_tokens = max(parent.num_cached_tokens, eo.num_cached_tokens)
            out = deltas.get(parent.request_id)
            if out is None:
                out = deltas[parent.request_id] = RequestOutput(
                    parent.request_id, parent.prompt, parent.prompt_token_ids, [],
                    num_cached_tokens=parent.num_cached_tokens,
                )
            if eo.prompt_logprobs is not None and parent.prompt_logprobs is None:
                parent.prompt_logprobs = [None, *eo.prompt_logprobs]
                out.prompt_logprobs = parent.prompt_logprobs
            out.outputs.append(delta)
            out.finished = parent.finished
        return ProcessedOutputs(list(deltas.values()), to_abort)

    def _apply(self, child: ChildState, eo: EngineCoreOutput) -> tuple[CompletionOutput, bool]:
        """The child's delta, and whether its text ended it here (a stop string or n_indent)."""
        full = child.output
        detokenizer = child.detokenizer
        stopped = detokenizer.update(eo.new_token_ids)
        new_tokens = eo.new_token_ids
        new_logprobs = eo.new_logprobs
        if stopped:
            keep = detokenizer.num_output_tokens_used - len(full.token_ids)
            new_tokens, new_logprobs = new_tokens[:keep], new_logprobs[:keep]
            # n_indent: "stop", as the model's own end: the middle is complete (llama.cpp says "limit", whose
            # OpenAI finish_reason "length" would tell a client the text was cut short and to ask for more).
            full.finish_reason, full.stop_reason = "stop", detokenizer.stop_string
            full.indent_stop = detokenizer.stopped_by_indent
        elif eo.finish_reason is not None:
            full.finish_reason, full.stop_reason = eo.finish_reason, eo.stop_reason
        text = child.detokenizer.get_delta(finished=full.finished)
        full.text += text
        full.token_ids.extend(new_tokens)
        if full.logprobs is not None:
            full.logprobs.extend(new_logprobs)
        return CompletionOutput(
            index=child.index,
            text=text,
            token_ids=list(new_tokens),
            logprobs=list(new_logprobs) if full.logprobs is not None else None,
            finish_reason=full.finish_reason,
            stop_reason=full.stop_reason,
            indent_stop=full.indent_stop,
        ), stopped
