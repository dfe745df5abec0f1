"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) on top of the chat path.

As api/responses.py does for OpenAI's Responses: a Messages request is translated into the chat request it means
(`system` as the system message, `tool_use` blocks as an assistant turn's tool calls, `tool_result` blocks as tool
turns, `tools` with `input_schema` as function tools, `tool_choice` any/tool as required/named, `stop_sequences` as
`stop`), so the chat template, the tool-call and reasoning parsers, grammars and every limit are the chat path's own.
What comes back is re-shaped into content blocks (`thinking`, `text`, `tool_use`) with Anthropic's stop reasons and
usage, whole or streamed as Anthropic's typed events, and failures in Anthropic's error shape.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Annotated, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field, field_validator

from lmserve.api.errors import exception_to_response
from lmserve.api.json_fields import JsonObject
from lmserve.api.protocol import (
    MAX_CHAT_MESSAGES,
    ChatCompletionChoice,
    ChatCompletionStreamChoice,
    UsageInfo,
)
from lmserve.api.request_error import RequestError
from lmserve.api.tool_parsers.common import json_text
from lmserve.api.tools import MAX_TOOLS

# Content blocks of one message, and of `system`: each is looked at in Python before the template renders it.
MAX_CONTENT_BLOCKS = 1024
# Anthropic's `metadata.user_id` is an opaque id (a UUID or a hash): nothing else is accepted there.
MAX_USER_ID_CHARS = 256
ANTHROPIC_PATHS = ("/v1/messages",)

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error"}


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def as_anthropic_error(response: Response) -> Response:
    """An error answer of the OpenAI shape (api/errors.py decides status and message) in Anthropic's shape."""
    if not isinstance(response, JSONResponse):
        return response  # 499: nobody reads it
    message = json.loads(bytes(response.body)).get("error", {}).get("message", "")
    headers = {k: v for k, v in response.headers.items() if k.lower() in ("retry-after", "connection", "www-authenticate")}
    return JSONResponse(anthropic_error_body(response.status_code, message), response.status_code, headers=headers)


class AnthropicErrorRoute(APIRoute):
    """ErrorMappingRoute's boundary, answered in Anthropic's error shape."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as exc:  # noqa: BLE001 - the boundary: exception_to_response logs the unexpected
                return as_anthropic_error(exception_to_response(exc))

        return handle


def sse_error_event(exc: Exception) -> str:
    """A failure after the stream's headers: Anthropic's in-band `error` event."""
    response = exception_to_response(exc)
    message = json.loads(bytes(response.body)).get("error", {}).get("message", "") \
        if isinstance(response, JSONResponse) else "the client went away"
    return typed_event(anthropic_error_body(response.status_code, message))


def typed_event(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json_text(event)}\n\n"


# ------------------------------------------------------------------------------------------------ requests


Blocks = Annotated[list[JsonObject], Field(max_length=MAX_CONTENT_BLOCKS)]


class Metadata(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    user_id: str | None = Field(default=None, max_length=MAX_USER_ID_CHARS)


class CountTokensRequest(BaseModel):
    """What decides a Messages request's prompt (all that `/v1/messages/count_tokens` takes)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    model: str | None = None
    messages: Annotated[list[JsonObject], Field(min_length=1, max_length=MAX_CHAT_MESSAGES)]
    system: str | Blocks | None = None
    tools: Annotated[list[JsonObject], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: JsonObject | None = None
    thinking: JsonObject | None = None

    @field_validator("messages", mode="before")
    @classmethod
    def _bounded_messages(cls, value: Any) -> Any:
        # In words, before each item is looked at: the list's own error is terse.
        if isinstance(value, list) and len(value) > MAX_CHAT_MESSAGES:
            raise ValueError(f"messages has {len(value)} items; at most {MAX_CHAT_MESSAGES} are allowed")
        return value

    def to_chat(self) -> dict[str, Any]:
        """The chat completion request this one means (validated by the chat path's own model)."""
        chat: dict[str, Any] = {"model": self.model, "messages": self._messages()}
        if self.tools:
            chat["tools"] = [_chat_tool(tool, index) for index, tool in enumerate(self.tools)]
        if self.tool_choice is not None:
            choice, parallel = _chat_tool_choice(self.tool_choice)
            chat["tool_choice"] = choice
            if parallel is False:
                chat["parallel_tool_calls"] = False
        if self.thinking is not None:
            kind = self.thinking.get("type")
            if kind not in ("enabled", "disabled", "adaptive"):
                raise RequestError('thinking.type must be "enabled" or "disabled"', "thinking")
            # Qwen3's template variable (others ignore it); the budget is not enforced: max_tokens bounds the turn.
            chat["chat_template_kwargs"] = {"enable_thinking": kind != "disabled"}
        return chat

    def _messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.system is not None:
            text = self.system if isinstance(self.system, str) else _texts(self.system, "system")
            if text:
                messages.append({"role": "system", "content": text})
        for index, message in enumerate(self.messages):
            role = message.get("role")
            where = f"messages[{index}]"
            if role not in ("user", "assistant"):
                raise RequestError(f"{where}.role is {_short(role)}; use user or assistant (and system for the "
                                   "system prompt)", "messages")
            content = message.get("content")
            if isinstance(content, str):
                messages.append({"role": role, "content": content})
            elif isinstance(content, list):
                if len(content) > MAX_CONTENT_BLOCKS:
                    raise RequestError(f"{where}.content has {len(content)} blocks; at most {MAX_CONTENT_BLOCKS} are "
                                       "allowed", "messages")
                messages += _assistant_turn(content, where) if role == "assistant" else _user_turns(content, where)
            else:
                raise RequestError(f"{where}.content must be a string or a list of content blocks", "messages")
        return messages


class MessagesRequest(CountTokensRequest):
    """Anthropic's Messages request: the prompt's fields, and those of the generation."""

    max_tokens: int = Field(ge=1)  # required, as Anthropic requires it
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)  # Anthropic's range
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = False
    # Structured output: {"format": {"type": "json_schema", "schema": {...}}} is the chat path's response_format.
    output_config: JsonObject | None = None
    # Bookkeeping: accepted, no effect on the answer (there is one tier, one place, and the prefix cache is automatic).
    metadata: Metadata | None = None
    service_tier: str | None = Field(default=None, max_length=64)
    inference_geo: str | None = Field(default=None, max_length=64)
    speed: str | None = Field(default=None, max_length=64)
    cache_control: JsonObject | None = None

    def to_chat(self) -> dict[str, Any]:
        chat = super().to_chat()
        chat["max_tokens"] = self.max_tokens
        chat["stream"] = bool(self.stream)
        if self.stream:
            chat["stream_options"] = {"include_usage": True}
        for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"),
                             ("stop_sequences", "stop")):
            if getattr(self, ours) is not None:
                chat[theirs] = getattr(self, ours)
        fmt = (self.output_config or {}).get("format")
        if fmt is not None:
            if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
                raise RequestError('output_config.format must be {"type": "json_schema", "schema": {...}}',
                                   "output_config")
            chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
        return chat


def _short(value: Any) -> str:
    """A client's value quoted in an error message, however large it is."""
    text = repr(value) if isinstance(value, str | int | float | bool | None) else type(value).__name__
    return text if len(text) <= 100 else text[:97] + "..."


UNSUPPORTED_BLOCKS = {"image": "image content blocks are not supported: this server runs no vision model",
                      "document": "document content blocks are not supported: send the document's text",
                      "search_result": "search_result content blocks are not supported: send their text"}


def _block_type(block: dict[str, Any], where: str) -> str:
    kind = block.get("type")
    if kind in UNSUPPORTED_BLOCKS:
        raise RequestError(f"{where}: {UNSUPPORTED_BLOCKS[kind]}", "messages")
    if not isinstance(kind, str):
        raise RequestError(f"{where} has no type", "messages")
    return kind


def _text_of(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise RequestError(f"{where}.text must be a string", "messages")
    return text


def _texts(blocks: list[dict[str, Any]], where: str) -> str:
    """Text blocks (system's, a tool result's) joined; any other block is refused."""
    texts = []
    for index, block in enumerate(blocks):
        at = f"{where}[{index}]"
        if _block_type(block, at) != "text":
            raise RequestError(f"{at} is of type {_short(block.get('type'))}; only text blocks are allowed here",
                               "system" if where == "system" else "messages")
        texts.append(_text_of(block, at))
    return "\n".join(texts)


def _user_turns(blocks: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """A user message's blocks: each tool_result a tool turn (Anthropic puts them first), the text one user turn."""
    turns: list[dict[str, Any]] = []
    texts: list[str] = []
    for index, block in enumerate(blocks):
        at = f"{where}.content[{index}]"
        kind = _block_type(block, at)
        if kind == "text":
            texts.append(_text_of(block, at))
        elif kind == "tool_result":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str):
                raise RequestError(f"{at}.tool_use_id must be a string", "messages")
            content = block.get("content", "")
            text = content if isinstance(content, str) else _texts(content, f"{at}.content") \
                if isinstance(content, list) else None
            if text is None:
                raise RequestError(f"{at}.content must be a string or a list of text blocks", "messages")
            if block.get("is_error") is True:
                text = f"Error: {text}"
            turns.append({"role": "tool", "tool_call_id": call_id, "content": text})
        else:
            raise RequestError(f"{at} is of type {_short(kind)}; a user message takes text and tool_result blocks",
                               "messages")
    if texts:
        turns.append({"role": "user", "content": "\n".join(texts)})
    return turns


def _assistant_turn(blocks: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for index, block in enumerate(blocks):
        at = f"{where}.content[{index}]"
        kind = _block_type(block, at)
        if kind == "text":
            texts.append(_text_of(block, at))
        elif kind == "tool_use":
            call_id, name, arguments = block.get("id"), block.get("name"), block.get("input", {})
            if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(arguments, dict):
                raise RequestError(f"{at} needs an id and a name (strings) and an input object", "messages")
            calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
        elif kind in ("thinking", "redacted_thinking"):
            continue  # an earlier turn's thinking: chat templates drop it too
        else:
            raise RequestError(f"{at} is of type {_short(kind)}; an assistant message takes text, tool_use and "
                               "thinking blocks", "messages")
    turn: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts or not calls else None}
    if calls:
        turn["tool_calls"] = calls
    return [turn]


def _chat_tool(tool: dict[str, Any], index: int) -> dict[str, Any]:
    if tool.get("type", "custom") != "custom":
        raise RequestError(f"tools[{index}] is of type {_short(tool.get('type'))}; lmserve runs client tools "
                           "(name, description, input_schema), not Anthropic's server tools", "tools")
    if not isinstance(tool.get("input_schema"), dict):
        raise RequestError(f"tools[{index}].input_schema must be a JSON schema object", "tools")
    function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: dict[str, Any]) -> tuple[str | dict[str, Any], bool | None]:
    """The chat tool_choice and parallel_tool_calls of Anthropic's tool_choice."""
    parallel = choice.get("disable_parallel_tool_use")
    if parallel is not None and not isinstance(parallel, bool):
        raise RequestError("tool_choice.disable_parallel_tool_use must be a boolean", "tool_choice")
    kind = choice.get("type")
    chat: str | dict[str, Any]
    if kind == "auto":
        chat = "auto"
    elif kind == "any":
        chat = "required"
    elif kind == "none":
        chat = "none"
    elif kind == "tool" and isinstance(choice.get("name"), str):
        chat = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise RequestError('tool_choice must be {"type": "auto"}, {"type": "any"}, {"type": "none"} or '
                           '{"type": "tool", "name": ...}', "tool_choice")
    return chat, (False if parallel else None)


# ------------------------------------------------------------------------------------------------ output


class MessageBody(BaseModel):
    """A Message object as a model, for the JSON writers."""

    model_config = ConfigDict(extra="allow")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def usage_of(usage: UsageInfo | None, input_tokens: int = 0) -> dict[str, int]:
    return {"input_tokens": usage.prompt_tokens if usage else input_tokens,
            "output_tokens": usage.completion_tokens if usage else 0,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}


def stop_of(finish_reason: str | None, stop_reason: int | str | None, called: bool,
            stop_sequences: list[str] | None) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for a chat choice's ending."""
    if called:
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stop_reason, str) and stop_reason in (stop_sequences or ()):
        return "stop_sequence", stop_reason
    return "end_turn", None


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's JSON arguments as tool_use's input object (Anthropic's input is always an object)."""
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class MessageShell:
    """What a message says besides its content."""

    def __init__(self, model: str, request: MessagesRequest) -> None:
        self.id = new_id("msg")
        self.model = model
        self.request = request

    def body(self, content: list[dict[str, Any]], stop_reason: str | None, stop_sequence: str | None,
             usage: dict[str, int]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}


def message_body(shell: MessageShell, choice: ChatCompletionChoice, usage: UsageInfo) -> dict[str, Any]:
    """A whole chat choice as a Message."""
    message = choice.message
    content: list[dict[str, Any]] = []
    if message.reasoning_content:
        content.append({"type": "thinking", "thinking": message.reasoning_content, "signature": ""})
    if message.content or not message.tool_calls:
        content.append({"type": "text", "text": message.content or ""})
    for call in message.tool_calls or ():
        content.append({"type": "tool_use", "id": call.id, "name": call.function.name,
                        "input": tool_input(call.function.arguments)})
    reason, sequence = stop_of(choice.finish_reason, choice.stop_reason, bool(message.tool_calls),
                               shell.request.stop_sequences)
    return shell.body(content, reason, sequence, usage_of(usage))


class MessageEvents:
    """Streamed chat deltas in, Anthropic's typed events out: message_start and a ping, then each content block
    started, filled by deltas and stopped in turn (thinking, text, each tool_use), then message_delta (the stop
    reason and the output tokens) and message_stop."""

    def __init__(self, shell: MessageShell) -> None:
        self.shell = shell
        self.index = -1  # the open block's index
        self.open: str | None = None  # the open block's type
        self.calls: dict[int, int] = {}  # chat tool-call index -> its block index

    def start(self, input_tokens: int) -> Iterator[dict[str, Any]]:
        message = self.shell.body([], None, None, {**usage_of(None, input_tokens), "output_tokens": 0})
        yield {"type": "message_start", "message": message}
        yield {"type": "ping"}

    def _close(self) -> Iterator[dict[str, Any]]:
        if self.open is not None:
            if self.open == "thinking":  # the SDK expects a signature; lmserve signs nothing
                yield {"type": "content_block_delta", "index": self.index,
                       "delta": {"type": "signature_delta", "signature": ""}}
            yield {"type": "content_block_stop", "index": self.index}
            self.open = None

    def _open(self, block: dict[str, Any]) -> Iterator[dict[str, Any]]:
        yield from self._close()
        self.index += 1
        self.open = block["type"]
        yield {"type": "content_block_start", "index": self.index, "content_block": block}

    def delta(self, choice: ChatCompletionStreamChoice) -> Iterator[dict[str, Any]]:
        delta = choice.delta
        if delta.reasoning_content:
            if self.open != "thinking":
                yield from self._open({"type": "thinking", "thinking": "", "signature": ""})
            yield {"type": "content_block_delta", "index": self.index,
                   "delta": {"type": "thinking_delta", "thinking": delta.reasoning_content}}
        if delta.content:
            if self.open != "text":
                yield from self._open({"type": "text", "text": ""})
            yield {"type": "content_block_delta", "index": self.index,
                   "delta": {"type": "text_delta", "text": delta.content}}
        for call in delta.tool_calls or ():
            if call.index not in self.calls:  # a call's first delta names it
                yield from self._open({"type": "tool_use", "id": call.id or new_id("toolu"),
                                       "name": call.function.name or "", "input": {}})
                self.calls[call.index] = self.index
            if self.calls[call.index] != self.index or self.open != "tool_use":
                continue  # a late fragment of a call already closed (the parsers send each call whole in turn)
            if call.function.arguments:
                yield {"type": "content_block_delta", "index": self.index,
                       "delta": {"type": "input_json_delta", "partial_json": call.function.arguments}}

    def finish(self, finish_reason: str | None, stop_reason: int | str | None,
               usage: UsageInfo | None) -> Iterator[dict[str, Any]]:
        if self.index < 0:  # an empty answer is still one text block, as a whole message has
            yield from self._open({"type": "text", "text": ""})
        yield from self._close()
        reason, sequence = stop_of(finish_reason, stop_reason, bool(self.calls), self.shell.request.stop_sequences)
        yield {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
               "usage": {"output_tokens": usage.completion_tokens if usage else 0}}
        yield {"type": "message_stop"}

