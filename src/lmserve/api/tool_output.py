"""How a chat choice's generated text becomes OpenAI tool calls: decoded under the tool's schema (tool_choice
"required" or a named function) or parsed from the model's own format (tool_choice "auto", --tool-call-parser)."""

from __future__ import annotations

from dataclasses import dataclass

from lmserve.api.protocol import DeltaFunctionCall, DeltaToolCall, FunctionCallOut, ToolCallOut
from lmserve.api.tool_parsers.common import DeltaToolCall as ParsedDelta
from lmserve.api.tool_parsers.common import ToolCall, ToolParser
from lmserve.api.tools import ConstrainedToolStream, NamedToolChoice, ToolChoice, tool_calls_from_constrained


@dataclass
class ToolOutput:
    tool_choice: ToolChoice  # "auto", "required" or a named function
    parser: ToolParser | None = None  # for "auto"
    max_calls: int | None = None  # parallel_tool_calls false: 1 (the first call the model writes)

    @property
    def calls_finish_reason(self) -> str:
        # OpenAI ends a forced named call with "stop", and any other turn that calls tools with "tool_calls".
        return "stop" if isinstance(self.tool_choice, NamedToolChoice) else "tool_calls"

    def final(self, text: str) -> tuple[str | None, list[ToolCallOut]]:
        """The message's content and tool calls from the whole text."""
        if self.parser is None:
            calls = tool_calls_from_constrained(text, self.tool_choice)
            return None, [_call_out(c) for c in calls[: self.max_calls]]
        extracted = self.parser.extract(text)
        return extracted.content, [_call_out(c) for c in extracted.tool_calls[: self.max_calls]]

    def stream(self) -> ChoiceToolStream:
        return ChoiceToolStream(self)


class ChoiceToolStream:
    """One streamed choice: text deltas in, (content, tool-call deltas) out."""

    def __init__(self, output: ToolOutput) -> None:
        self.parsed = output.parser.streaming() if output.parser is not None else None
        self.constrained = None if output.parser is not None else ConstrainedToolStream(output.tool_choice)
        self.num_calls = 0
        self.max_calls = output.max_calls

    def feed(self, text: str, finished: bool) -> tuple[str | None, list[DeltaToolCall]]:
        if self.constrained is not None:
            calls = self.constrained.feed(text) + (self.constrained.finish() if finished else [])
            return None, self._out(calls)
        assert self.parsed is not None
        delta = self.parsed.feed(text)
        content, calls = delta.content, list(delta.tool_calls)
        if finished:
            last = self.parsed.finish()
            content, calls = content + last.content, calls + list(last.tool_calls)
        return content or None, self._out(calls)

    def _out(self, calls: list[ParsedDelta]) -> list[DeltaToolCall]:
        if self.max_calls is not None:  # the calls past the first max_calls are left out, fragments and all
            calls = [c for c in calls if c.index < self.max_calls]
        self.num_calls += sum(1 for c in calls if c.id is not None)
        return [
            DeltaToolCall(index=c.index, id=c.id, type="function" if c.id is not None else None,
                          function=DeltaFunctionCall(name=c.name, arguments=c.arguments))
            for c in calls
        ]


def _call_out(call: ToolCall) -> ToolCallOut:
    return ToolCallOut(id=call.id, function=FunctionCallOut(name=call.name, arguments=call.arguments))
