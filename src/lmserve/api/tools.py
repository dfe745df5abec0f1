"""OpenAI's `tools` and `tool_choice`: the request models and their checks, the JSON schema the output must follow
when a call is forced (`tool_choice` "required" or a named function, as vLLM), and the calls read back from that
constrained output, whole or streamed. "auto" is the tool-call parsers' job (lmserve.api.tool_parsers).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from lmserve.api.json_fields import JsonObject
from lmserve.api.request_error import RequestError
from lmserve.api.tool_parsers.common import (
    CALL_HEAD_WITHIN,
    DeltaToolCall,
    ObjectScanner,
    StreamedCall,
    ToolCall,
    call_from_json,
    make_tool_call_id,
)

# Limits on a request's tools (docs/limits.md): each tool's schema goes into the prompt and, when a call is forced,
# into a grammar compiled for the request, so both are bounded.
MAX_TOOLS = 128
MAX_TOOL_NAME_CHARS = 64  # OpenAI's
MAX_TOOL_DESCRIPTION_CHARS = 4096
MAX_TOOL_PARAMETERS_BYTES = 64 * 1024  # a tool's `parameters` as compact UTF-8 JSON


class _ToolModel(BaseModel):
    # As protocol.OpenAIRequestModel (which imports this module): unknown fields ignored, wrong types refused.
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class FunctionDefinition(_ToolModel):
    name: str = Field(min_length=1, max_length=MAX_TOOL_NAME_CHARS, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = Field(default=None, max_length=MAX_TOOL_DESCRIPTION_CHARS)
    parameters: JsonObject | None = None  # a JSON schema; absent means "no parameters"
    strict: bool | None = None  # OpenAI's; lmserve always follows the schema when it constrains

    @field_validator("parameters")
    @classmethod
    def _bounded(cls, parameters: dict[str, Any] | None) -> dict[str, Any] | None:
        if parameters is not None:
            size = len(json.dumps(parameters, ensure_ascii=False, separators=(",", ":")).encode())
            if size > MAX_TOOL_PARAMETERS_BYTES:
                raise ValueError(f"a tool's parameters schema is {size} bytes as JSON; at most "
                                 f"{MAX_TOOL_PARAMETERS_BYTES} are allowed")
        return parameters


class ChatTool(_ToolModel):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(_ToolModel):
    name: str = Field(max_length=MAX_TOOL_NAME_CHARS)


class NamedToolChoice(_ToolModel):
    type: Literal["function"]
    function: ToolChoiceFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
Tools = Annotated[list[ChatTool], Field(max_length=MAX_TOOLS)]


def resolve_tool_choice(tools: Sequence[ChatTool] | None, tool_choice: ToolChoice | None) -> ToolChoice:
    """OpenAI's default: "auto" when the request has tools, "none" when it has none."""
    if tool_choice is not None:
        return tool_choice
    return "auto" if tools else "none"


def check_tool_choice(tools: Sequence[ChatTool] | None, tool_choice: ToolChoice | None) -> None:
    """A 400 for tools and a tool_choice that cannot be served together. "none" and "auto" need no tools."""
    tools = tools or []
    if len(tools) > MAX_TOOLS:
        raise RequestError(f"tools has {len(tools)} entries; at most {MAX_TOOLS} are allowed", "tools")
    names: set[str] = set()
    for tool in tools:
        if tool.function.name in names:
            raise RequestError(f"tools has two functions named {tool.function.name!r}; names must be unique", "tools")
        names.add(tool.function.name)
    if tool_choice in (None, "none", "auto"):
        return
    if not tools:
        raise RequestError("tool_choice forces a tool call, but the request has no tools", "tool_choice")
    if isinstance(tool_choice, NamedToolChoice) and tool_choice.function.name not in names:
        raise RequestError(f"tool_choice names the function {tool_choice.function.name!r}, which is not in tools",
                           "tool_choice")


def _parameters(tool: ChatTool) -> dict[str, Any]:
    # A copy: the schema is edited (its $defs moved) and handed to a grammar compiler.
    parameters = tool.function.parameters
    return copy.deepcopy(parameters) if parameters is not None else {"type": "object"}


def constraint_schema(
    tools: Sequence[ChatTool] | None, tool_choice: ToolChoice | None, max_calls: int | None = None
) -> dict[str, Any] | None:
    """The JSON schema the whole output must follow, or None when the model may answer freely ("none", "auto").

    Named function: its parameters, so the output *is* the arguments. "required": a non-empty array of
    `{"name": NAME, "parameters": {...}}`, one anyOf branch per tool (as vLLM), of at most max_calls elements
    (parallel_tool_calls false: 1). Checks check_tool_choice's 400s."""
    check_tool_choice(tools, tool_choice)
    tools = tools or []
    if isinstance(tool_choice, NamedToolChoice):
        return _parameters(next(t for t in tools if t.function.name == tool_choice.function.name))
    if tool_choice != "required":
        return None

    # A tool's "$ref": "#/$defs/X" points at the root of the document, which is now the array schema: its
    # definitions move there, and two tools may share a name only for the same definition.
    definitions: dict[str, dict[str, Any]] = {}
    branches = []
    for tool in tools:
        parameters = _parameters(tool)
        for key in ("$defs", "definitions"):
            if isinstance(parameters.get(key), dict):
                for name, schema in parameters.pop(key).items():
                    if definitions.setdefault(key, {}).setdefault(name, schema) != schema:
                        raise RequestError(f"two tools define {key}/{name} differently; with tool_choice "
                                           "'required' their definitions share one namespace", "tools")
        branches.append({
            "type": "object",
            "properties": {"name": {"type": "string", "const": tool.function.name}, "parameters": parameters},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        })
    bound = {} if max_calls is None else {"maxItems": max_calls}
    return {"type": "array", "minItems": 1, **bound, "items": {"anyOf": branches}, **definitions}


class ConstrainedToolStream:
    """The tool calls in output generated under constraint_schema, as OpenAI's streamed `delta.tool_calls`.

    Named function: the first delta carries the id, the name and the first text; later ones carry the generated
    text as it comes, so the fragments concatenate to exactly the output. "required": each array element streams as
    a hermes call does (tool_parsers.StreamedCall): its id and name once the name is complete, then its arguments
    re-serialised piece by piece as json.dumps writes them whole."""

    def __init__(self, tool_choice: ToolChoice) -> None:
        if isinstance(tool_choice, NamedToolChoice):
            self.name: str | None = tool_choice.function.name
        elif tool_choice == "required":
            self.name = None
        else:
            raise ValueError(f"tool_choice {tool_choice!r} does not constrain the output")
        self.text = ""
        self.calls = 0
        self.scanner = ObjectScanner(depth=1)  # the array's elements
        self.open_call: StreamedCall | None = None  # the element being sent piece by piece
        self.open_call_start = -1

    def feed(self, delta_text: str) -> list[DeltaToolCall]:
        if self.name is not None:
            if self.calls == 0:
                self.calls = 1
                return [DeltaToolCall(0, make_tool_call_id(), self.name, delta_text)]
            return [DeltaToolCall(0, None, None, delta_text)] if delta_text else []
        self.text += delta_text
        deltas = []
        for start, end in self.scanner.scan(self.text):
            # The grammar makes every element a call; without it (a backend bug), an element that is not is skipped.
            call = call_from_json(self.text[start:end])
            if self.open_call is not None and self.open_call_start == start:
                rest = self.open_call.close(call) if call is not None else None
                self.open_call = None
                if rest is None:  # a backend bug again: what was sent of it stands, nothing more is sent of it
                    self.calls += 1
                    continue
                deltas += rest
                self.calls += 1
            elif call is not None:
                deltas.append(DeltaToolCall(self.calls, call.id, call.name, call.arguments))
                self.calls += 1
        open_start = self.scanner.start
        if open_start is not None:  # an element still open: its head, then its arguments, as they come
            if self.open_call_start != open_start and len(self.text) - open_start > CALL_HEAD_WITHIN:
                pass  # no head this far in: the element goes whole when it closes
            elif self.open_call is None or self.open_call_start != open_start:
                self.open_call, started = StreamedCall.start(self.calls, self.text, open_start)
                self.open_call_start = open_start
                deltas += started
            else:
                deltas += self.open_call.advance(self.text)
        return deltas

    def finish(self) -> list[DeltaToolCall]:
        """A named call exists even if nothing was generated; a "required" element left open is dropped."""
        if self.name is not None and self.calls == 0:
            return self.feed("")
        return []


def tool_calls_from_constrained(text: str, tool_choice: ToolChoice) -> list[ToolCall]:
    """The calls in a whole constrained output: the stream's, so streamed and whole responses agree by
    construction. A named call's arguments are the output as generated (not re-serialised), since its stream sends
    that text as it comes; if generation stopped early (max_tokens) they are the JSON cut short, as OpenAI's."""
    stream = ConstrainedToolStream(tool_choice)
    calls: list[ToolCall] = []
    for delta in stream.feed(text) + stream.finish():
        if delta.id is not None and delta.name is not None:
            calls.append(ToolCall(delta.id, delta.name, delta.arguments))
        else:
            calls[delta.index].arguments += delta.arguments
    return calls
