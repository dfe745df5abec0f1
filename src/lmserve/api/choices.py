"""Folding the delta outputs of a request's engine requests into OpenAI choices, streamed and final."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from lmserve.api.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionStreamChoice,
    ChatMessageOut,
    CompletionChoice,
    CompletionLogprobs,
    DecodeToken,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    Prompt,
    PromptLogprobs,
    UsageInfo,
    chat_logprobs,
    completion_logprobs,
    echo_logprobs,
    prompt_logprobs_out,
)
from lmserve.api.reasoning_parsers import ReasoningParser, ReasoningStream
from lmserve.api.tool_output import ChoiceToolStream, ToolOutput
from lmserve.outputs import CompletionOutput, Logprobs, RequestOutput


@dataclass(frozen=True)
class ReasoningOutput:
    """How a chat request's thinking is split from its answer (--reasoning-parser)."""

    parser: ReasoningParser
    include: bool = True  # the request's include_reasoning


@dataclass
class ChoiceState:
    """One choice as its outputs arrive: counts and positions for the stream; the whole text for a response."""

    text: str = ""  # set by Choices.add (a whole output); a stream's text is never accumulated here
    logprobs: list[Logprobs] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    indent_stop: bool = False  # n_indent ended it (llama.cpp's /infill says stop_type "limit")
    prefix_len: int = 0  # characters of echoed prompt before the generated text
    num_chars: int = 0  # where the next token starts in the choice's text, for completions' text_offset
    prompt_logprobs_sent: bool = False  # a stream sends the echoed prompt's logprobs once, with its text


class Choices:
    """Folds delta outputs of every engine request into choices, indexed prompt_index * n + child index."""

    def __init__(self, n: int, num_prompt_logprobs: int | None = None, decode_token: DecodeToken = str) -> None:
        self.n = n
        self.num_prompt_logprobs = num_prompt_logprobs  # the request's prompt_logprobs field
        self.decode_token = decode_token
        self.states: dict[int, ChoiceState] = {}
        self.prompt_tokens: dict[int, int] = {}
        # Per prompt, once the engine scored it: the prompt's token ids and their logprobs (first None).
        self.scored_prompts: dict[int, tuple[list[int], list[Logprobs | None]]] = {}

    def update(
        self, prompt_index: int, out: RequestOutput
    ) -> Iterator[tuple[int, ChoiceState, str, CompletionOutput]]:
        """Yields (choice index, state before this delta, new text, delta), then folds the delta in."""
        self.prompt_tokens[prompt_index] = len(out.prompt_token_ids)
        if out.prompt_logprobs is not None:
            self.scored_prompts[prompt_index] = (out.prompt_token_ids, out.prompt_logprobs)
        for child in out.outputs:
            index = prompt_index * self.n + child.index
            state = self.states.get(index)
            text = child.text
            if state is None:
                prefix = self.first_text(prompt_index, out)
                state = self.states[index] = ChoiceState(prefix_len=len(prefix), num_chars=len(prefix))
                text = prefix + text
            yield index, state, text, child
            state.num_tokens += len(child.token_ids)
            state.logprobs.extend(child.logprobs or ())
            state.finish_reason = child.finish_reason or state.finish_reason
            state.stop_reason = child.stop_reason if child.finish_reason else state.stop_reason
            state.indent_stop = state.indent_stop or child.indent_stop

    def add(self, prompt_index: int, out: RequestOutput) -> None:
        """Folds in one whole output (from a final_only request group)."""
        for _, state, text, _ in self.update(prompt_index, out):
            state.text = text

    def first_text(self, prompt_index: int, out: RequestOutput) -> str:
        """What precedes a choice's generated text (the echoed prompt for completions)."""
        return ""

    def stream_choices(self, prompt_index: int, out: RequestOutput) -> Sequence[Any]:
        """The stream chunks' choices for one delta (folded in)."""
        raise NotImplementedError

    def final_choices(self) -> Sequence[Any]:
        """The response's choices once every delta is folded in."""
        raise NotImplementedError

    def prompt_logprobs(self, prompt_index: int) -> PromptLogprobs | None:
        """vLLM's prompt_logprobs of one prompt, when the request asked for them."""
        if self.num_prompt_logprobs is None or prompt_index not in self.scored_prompts:
            return None
        return prompt_logprobs_out(self.scored_prompts[prompt_index][1], self.decode_token, self.num_prompt_logprobs)

    def response_fields(self) -> dict[str, Any]:
        """Fields of the whole (non-streamed) response beyond id, model, choices and usage."""
        return {}

    def usage(self) -> UsageInfo:
        prompt = sum(self.prompt_tokens.values())
        completion = sum(s.num_tokens for s in self.states.values())
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    def sorted_states(self) -> list[tuple[int, ChoiceState]]:
        return sorted(self.states.items())


def _worth_sending(text: str, child: CompletionOutput) -> bool:
    # A delta whose text is still held back (a possible stop string) carries nothing new unless it ends the
    # choice or brings logprobs the client asked for.
    return bool(text or child.finish_reason or child.logprobs)


def _without_generation(out: RequestOutput) -> RequestOutput:
    """The output as if nothing had been generated (echo with max_tokens 0 runs one step and drops its token)."""
    children = [
        CompletionOutput(
            index=c.index, logprobs=[] if c.logprobs is not None else None,
            finish_reason="length" if c.finish_reason else None,
        )
        for c in out.outputs
    ]
    return replace(out, outputs=children)


class CompletionChoices(Choices):
    def __init__(
        self, n: int, prompts: Sequence[Prompt], echo: bool, num_logprobs: int | None,
        decode_token: DecodeToken, num_prompt_logprobs: int | None = None, echo_only: bool = False,
    ) -> None:
        super().__init__(n, num_prompt_logprobs, decode_token)
        self.prompts = prompts
        self.echo = echo
        self.echo_only = echo_only
        self.num_logprobs = num_logprobs

    def update(
        self, prompt_index: int, out: RequestOutput
    ) -> Iterator[tuple[int, ChoiceState, str, CompletionOutput]]:
        yield from super().update(prompt_index, _without_generation(out) if self.echo_only else out)

    def first_text(self, prompt_index: int, out: RequestOutput) -> str:
        if not self.echo:
            return ""
        prompt = self.prompts[prompt_index]
        if isinstance(prompt, str):
            return prompt
        # Token-id prompts: the engine client's prompt text when it kept one, else the tokens' own texts.
        return out.prompt if out.prompt is not None else "".join(self.decode_token(t) for t in prompt)

    def _logprobs(self, entries: Sequence[Logprobs], text_offset: int) -> CompletionLogprobs | None:
        if self.num_logprobs is None:
            return None
        return completion_logprobs(entries, self.decode_token, self.num_logprobs, text_offset)

    def _echo_logprobs(self, prompt_index: int) -> CompletionLogprobs | None:
        """The echoed prompt's logprobs, which lead the choice's (lm-eval sums them to score a continuation)."""
        if not self.echo or self.num_logprobs is None or prompt_index not in self.scored_prompts:
            return None
        token_ids, entries = self.scored_prompts[prompt_index]
        return echo_logprobs(token_ids, entries, self.decode_token, self.num_logprobs)

    def stream_choices(self, prompt_index: int, out: RequestOutput) -> list[CompletionChoice]:
        choices = []
        for index, state, text, child in self.update(prompt_index, out):
            logprobs = self._logprobs(child.logprobs or [], state.num_chars)
            if logprobs is not None:
                state.num_chars += sum(map(len, logprobs.tokens))
                echoed = None if state.prompt_logprobs_sent else self._echo_logprobs(prompt_index)
                state.prompt_logprobs_sent = True
                logprobs = echoed + logprobs if echoed is not None else logprobs
            if _worth_sending(text, child):
                choices.append(CompletionChoice(
                    index=index, text=text, logprobs=logprobs,
                    finish_reason=child.finish_reason, stop_reason=child.stop_reason,
                ))
        return choices

    def final_choices(self) -> list[CompletionChoice]:
        choices = []
        for index, state in self.sorted_states():
            prompt_index = index // self.n
            logprobs = self._logprobs(state.logprobs, state.prefix_len)
            echoed = self._echo_logprobs(prompt_index)
            choices.append(CompletionChoice(
                index=index, text=state.text,
                logprobs=echoed + logprobs if echoed is not None and logprobs is not None else logprobs,
                finish_reason=state.finish_reason, stop_reason=state.stop_reason,
                prompt_logprobs=self.prompt_logprobs(prompt_index),
            ))
        return choices


def split_call_heads(calls: list[DeltaToolCall]) -> tuple[list[DeltaToolCall], list[DeltaToolCall]]:
    """The calls' first deltas without their arguments (id, type, name), and then every argument fragment."""
    heads = [DeltaToolCall(index=c.index, id=c.id, type=c.type, function=DeltaFunctionCall(name=c.function.name,
                                                                                             arguments=""))
             for c in calls if c.id is not None]
    if not heads:
        return [], calls
    rest = [DeltaToolCall(index=c.index, function=DeltaFunctionCall(arguments=c.function.arguments))
            for c in calls if c.function.arguments]
    return heads, rest


class ChatChoices(Choices):
    def __init__(
        self, n: int, num_top_logprobs: int | None, decode_token: DecodeToken, num_prompt_logprobs: int | None = None,
        tool_output: ToolOutput | None = None, echoed: str | None = None,
        reasoning: ReasoningOutput | None = None,
    ) -> None:
        super().__init__(n, num_prompt_logprobs, decode_token)
        self.num_top_logprobs = num_top_logprobs
        self.tool_output = tool_output  # None: the text is the answer
        self.echoed = echoed  # echo: the assistant's own last message, before each answer
        self.reasoning = reasoning  # None: no thinking to split from the answer
        self.tool_streams: dict[int, ChoiceToolStream] = {}
        self.reasoning_streams: dict[int, ReasoningStream] = {}

    def response_fields(self) -> dict[str, Any]:
        # vLLM puts a chat request's prompt logprobs on the response: its one prompt is every choice's.
        return {"prompt_logprobs": self.prompt_logprobs(0)}

    def _logprobs(self, entries: Sequence[Logprobs]) -> ChatChoiceLogprobs | None:
        if self.num_top_logprobs is None:
            return None
        return chat_logprobs(entries, self.decode_token, self.num_top_logprobs)

    def stream_choices(self, prompt_index: int, out: RequestOutput) -> list[ChatCompletionStreamChoice]:
        choices = []
        for index, _, text, child in self.update(prompt_index, out):
            thinking = None
            if self.reasoning is not None:  # the thinking goes its own way; tools and content see the answer
                stream = self.reasoning_streams.setdefault(index, self.reasoning.parser.streaming())
                thinking, text = stream.feed(text, finished=child.finish_reason is not None)
                thinking = (thinking or None) if self.reasoning.include else None
            delta = DeltaMessage(content=text, reasoning_content=thinking)
            finish_reason = child.finish_reason
            if self.tool_output is not None:
                stream = self.tool_streams.setdefault(index, self.tool_output.stream())
                content, calls = stream.feed(text, finished=child.finish_reason is not None)
                if finish_reason is not None and stream.num_calls:
                    finish_reason = self.tool_output.calls_finish_reason
                if not (content or calls or thinking or finish_reason or child.logprobs):
                    continue
                heads, calls = split_call_heads(calls)
                if heads:  # vLLM's shape: a call's id, type and name in one chunk, its arguments in the next
                    choices.append(ChatCompletionStreamChoice(
                        index=index, delta=DeltaMessage(content=content, tool_calls=heads, reasoning_content=thinking),
                    ))
                    content = thinking = None
                    if not (calls or finish_reason or child.logprobs):
                        continue  # nothing left for a second chunk (the arguments were empty)
                delta = DeltaMessage(content=content, tool_calls=calls or None, reasoning_content=thinking)
            elif not (thinking or _worth_sending(text, child)):
                continue
            elif self.reasoning is not None and not text:
                delta.content = None  # a thinking delta carries no content key
            choices.append(ChatCompletionStreamChoice(
                index=index, delta=delta, logprobs=self._logprobs(child.logprobs or []),
                finish_reason=finish_reason, stop_reason=child.stop_reason,
            ))
        return choices

    def final_choices(self) -> list[ChatCompletionChoice]:
        choices = []
        for index, state in self.sorted_states():
            answer, thinking = state.text, None
            if self.reasoning is not None:
                split = self.reasoning.parser.extract(state.text)
                answer, thinking = split.content, split.reasoning if self.reasoning.include else None
            message, finish_reason = ChatMessageOut(content=answer, reasoning_content=thinking), state.finish_reason
            if self.tool_output is not None:
                content, calls = self.tool_output.final(answer or "")
                message = ChatMessageOut(content=content, tool_calls=calls or None, reasoning_content=thinking)
                if calls and finish_reason is not None:
                    finish_reason = self.tool_output.calls_finish_reason
            if self.echoed is not None:
                message.content = self.echoed + (message.content or "")
            choices.append(ChatCompletionChoice(
                index=index, message=message, logprobs=self._logprobs(state.logprobs),
                finish_reason=finish_reason, stop_reason=state.stop_reason,
            ))
        return choices
