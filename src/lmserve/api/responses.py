"""OpenAI's Responses API (`POST /v1/responses`) on top of the chat path.

A Responses request is translated into the chat request it means (instructions as the system message, input items
as turns, function tools and tool results, `text.format` as `response_format`), so every limit, the chat template,
tool calling and reasoning are the chat path's own. What comes back is re-shaped into Responses output items:
a `reasoning` item (under --reasoning-parser), a `message` with `output_text`, and one `function_call` item per call;
streamed as the typed events the `openai` client's `responses.create(stream=True)` and `responses.stream()` read.

`store` is accepted but nothing is kept (`store: false` semantics whatever it says): `previous_response_id` and
`GET /v1/responses/{id}` are answered as for a response that does not exist, so a client resends the conversation.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from lmserve.api.errors import NotFoundError
from lmserve.api.json_fields import JsonObject
from lmserve.api.protocol import (
    MAX_CHAT_MESSAGES,
    ChatCompletionChoice,
    ChatCompletionStreamChoice,
    Metadata,
    UsageInfo,
)
from lmserve.api.request_error import RequestError
from lmserve.api.tool_parsers.common import json_text


class ResponsesRequest(BaseModel):
    """The fields of OpenAI's Responses request that change the answer, and those that only describe it."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    model: str | None = None
    input: str | Annotated[list[JsonObject], Field(max_length=MAX_CHAT_MESSAGES)]
    instructions: str | None = None
    tools: list[JsonObject] | None = None
    tool_choice: str | JsonObject | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    text: JsonObject | None = None
    reasoning: JsonObject | None = None  # effort reaches the chat template as reasoning_effort; no summaries
    # Bookkeeping: accepted, no effect on the answer (nothing is stored).
    store: bool | None = None
    metadata: Metadata | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    stream_options: JsonObject | None = None
    # Refused unless absent or off: lmserve keeps no state and runs nothing in the background.
    previous_response_id: str | None = None
    conversation: str | JsonObject | None = None
    background: bool | None = None
    prompt: JsonObject | None = None
    max_tool_calls: int | None = Field(default=None, ge=1)

    @field_validator("input", mode="before")
    @classmethod
    def _bounded_items(cls, value: Any) -> Any:
        # Before the items are validated, and in words: the union's own error says only "should be a string".
        if isinstance(value, list) and len(value) > MAX_CHAT_MESSAGES:
            raise ValueError(f"input has {len(value)} items; at most {MAX_CHAT_MESSAGES} are allowed")
        return value

    def to_chat(self) -> dict[str, Any]:
        """The chat completion request this one means (validated by the chat path's own model)."""
        if self.previous_response_id is not None:
            raise NotFoundError(f"previous response {self.previous_response_id[:100]!r} not found: this server "
                                "keeps no responses (store is not supported); send the whole conversation as input",
                                "previous_response_id")
        for name in ("conversation", "prompt"):
            if getattr(self, name) is not None:
                raise RequestError(f"{name} is not supported: send the conversation as input", name)
        if self.background:
            raise RequestError("background responses are not supported", "background")
        chat: dict[str, Any] = {"model": self.model, "messages": self._messages(), "stream": bool(self.stream)}
        if self.stream:
            chat["stream_options"] = {"include_usage": True}
        for ours, theirs in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"),
                             ("top_p", "top_p"), ("parallel_tool_calls", "parallel_tool_calls"), ("user", "user")):
            if getattr(self, ours) is not None:
                chat[theirs] = getattr(self, ours)
        if isinstance(self.reasoning, dict) and self.reasoning.get("effort") is not None:
            chat["reasoning_effort"] = self.reasoning["effort"]  # checked by the chat request's model
        if self.max_tool_calls == 1:
            chat["parallel_tool_calls"] = False
        if self.tools:
            chat["tools"] = [_chat_tool(tool) for tool in self.tools]
        if self.tool_choice is not None:
            chat["tool_choice"] = _chat_tool_choice(self.tool_choice)
        if response_format := _response_format(self.text):
            chat["response_format"] = response_format
        return chat

    def _messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return [*messages, {"role": "user", "content": self.input}]
        reasoning: list[str] = []  # reasoning items not yet given to the assistant turn they precede
        for index, item in enumerate(self.input):
            kind = item.get("type", "message")
            if kind == "message":
                role = item.get("role")
                if role not in ("user", "assistant", "system", "developer"):
                    raise RequestError(f"input[{index}] has role {_short(role)}; use user, assistant, system or developer",
                                       "input")
                messages.append({"role": role, "content": _text(item.get("content"), index)})
                if role == "assistant" and reasoning:
                    messages[-1]["reasoning_content"] = "\n".join(reasoning)
                reasoning = []
            elif kind == "function_call":
                call = {"id": _string(item, "call_id", index), "type": "function",
                        "function": {"name": _string(item, "name", index),
                                     "arguments": _string(item, "arguments", index)}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and last.get("tool_calls") and not reasoning:
                    last["tool_calls"].append(call)  # several calls of one turn are one assistant message
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                    if reasoning:
                        messages[-1]["reasoning_content"] = "\n".join(reasoning)
                reasoning = []
            elif kind == "function_call_output":
                output = item.get("output")
                text = output if isinstance(output, str) else _text(output, index)
                messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", index), "content": text})
            elif kind == "reasoning":
                # The thinking before the assistant turn that follows, as its reasoning_content: a chat template
                # keeps what it needs (gpt-oss's, the thinking before a call not yet answered) and drops the rest.
                reasoning += _reasoning_texts(item)
            else:
                raise RequestError(f"input[{index}] is of type {_short(kind)}; lmserve takes message, function_call, "
                                   "function_call_output and reasoning items", "input")
        return messages


def _reasoning_texts(item: dict[str, Any]) -> list[str]:
    """A reasoning item's text: its reasoning_text content (as lmserve and vLLM send it), else its summary."""
    for key in ("content", "summary"):
        parts = item.get(key)
        texts = [p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)] \
            if isinstance(parts, list) else []
        if texts:
            return texts
    return []


def _short(value: Any) -> str:
    """A client's value quoted in an error message, however large it is."""
    text = repr(value) if isinstance(value, str | int | float | bool | None) else type(value).__name__
    return text if len(text) <= 100 else text[:97] + "..."


def _string(item: dict[str, Any], key: str, index: int) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise RequestError(f"input[{index}].{key} must be a string", "input")
    return value


def _text(content: Any, index: int) -> str:
    """A message's content as text: a string, or its input_text/output_text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"input[{index}].content must be a string or a list of text parts", "input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise RequestError(f"input[{index}] has a content part of type {_short(kind)}; only text parts are supported",
                               "input")
        texts.append(part["text"])
    return "\n".join(texts)


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise RequestError(f"tools of type {_short(tool.get('type'))} are not supported; lmserve runs function tools",
                           "tools")
    function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if tool.get(key) is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise RequestError(f"tool_choice {json.dumps(choice, ensure_ascii=False)[:200]} is not supported; use auto, none, required or "
                       '{"type": "function", "name": ...}', "tool_choice")


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise RequestError('text.format must be an object with a type: {"type": "text"}, {"type": "json_object"} or '
                           '{"type": "json_schema", "name": ..., "schema": {...}}', "text")
    if fmt["type"] == "text":
        return None
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    if fmt["type"] == "json_schema":
        schema = {key: fmt[key] for key in ("name", "schema", "strict", "description") if key in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise RequestError(f"text.format of type {fmt['type'][:100]!r} is not supported; use text, json_object or "
                       "json_schema", "text")


# ------------------------------------------------------------------------------------------------ output


class ResponseBody(BaseModel):
    """A Response object (ResponseShell.body) as a model, for the JSON writers."""

    model_config = ConfigDict(extra="allow")


def typed_sse(event: dict[str, Any]) -> str:
    """One Responses stream event, named as OpenAI names them (`event:` then `data:`)."""
    return f"event: {event['type']}\ndata: {json_text(event)}\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _usage(usage: UsageInfo | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.total_tokens}


@dataclass
class ResponseShell:
    """What a response says besides its output: the request's settings, as OpenAI echoes them."""

    request: ResponsesRequest
    model: str
    id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    def body(self, status: str, output: list[dict[str, Any]], usage: UsageInfo | None = None,
             finish_reason: str | None = None) -> dict[str, Any]:
        req = self.request
        incomplete = status == "incomplete"
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": None, "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": self.model,
            "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": None, "reasoning": req.reasoning, "store": False,
            "temperature": req.temperature, "text": req.text or {"format": {"type": "text"}},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto", "tools": req.tools or [],
            "top_p": req.top_p, "truncation": req.truncation or "disabled", "usage": _usage(usage),
            "user": req.user, "metadata": req.metadata or {},
        }


def status_of(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def message_item(item_id: str, text: str | None, status: str = "completed") -> dict[str, Any]:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def output_items(choice: ChatCompletionChoice) -> list[dict[str, Any]]:
    """A whole chat choice as Responses output items."""
    message = choice.message
    items = []
    if message.reasoning_content:
        items.append(reasoning_item(new_id("rs"), message.reasoning_content))
    if message.content or not message.tool_calls:
        items.append(message_item(new_id("msg"), message.content or ""))
    for call in message.tool_calls or ():
        items.append(function_call_item(new_id("fc"), call.id, call.function.name, call.function.arguments))
    return items


class ResponseEvents:
    """Streamed chat deltas in, Responses' typed events out: each output item is added, filled by deltas and done
    in turn (reasoning, then the message, then each function call), as OpenAI sends them."""

    def __init__(self, shell: ResponseShell) -> None:
        self.shell = shell
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # finished items, in output order
        self.open: dict[str, Any] | None = None  # the item being filled
        self.calls: dict[int, dict[str, Any]] = {}  # chat tool-call index -> its function_call item

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        out = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return out

    def start(self) -> Iterator[dict[str, Any]]:
        body = self.shell.body("in_progress", [])
        yield self.event("response.created", response=body)
        yield self.event("response.in_progress", response=body)

    def _index(self) -> int:
        return len(self.items)

    def _close(self) -> Iterator[dict[str, Any]]:
        item = self.open
        if item is None:
            return
        self.open = None
        index = self._index()
        if item["type"] == "reasoning":
            text = item["content"][0]["text"]
            yield self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                             content_index=0, text=text)
        elif item["type"] == "message":
            text = item["content"][0]["text"]
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            yield self.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                             text=text, logprobs=[])
            yield self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                             part=part)
        else:
            yield self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                             name=item["name"], arguments=item["arguments"])
        item["status"] = "completed"
        yield self.event("response.output_item.done", output_index=index, item=item)
        self.items.append(item)

    def _open(self, item: dict[str, Any]) -> Iterator[dict[str, Any]]:
        yield from self._close()
        self.open = item
        index = self._index()
        added = {**item, "status": "in_progress"}
        if item["type"] in ("message", "reasoning"):
            added["content"] = []
        yield self.event("response.output_item.added", output_index=index, item=added)
        if item["type"] == "message":
            yield self.event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                             part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})

    def delta(self, choice: ChatCompletionStreamChoice) -> Iterator[dict[str, Any]]:
        delta = choice.delta
        if delta.reasoning_content:
            if self.open is None or self.open["type"] != "reasoning":
                yield from self._open(reasoning_item(new_id("rs"), "", "in_progress"))
            self.open["content"][0]["text"] += delta.reasoning_content
            yield self.event("response.reasoning_text.delta", item_id=self.open["id"], output_index=self._index(),
                             content_index=0, delta=delta.reasoning_content)
        if delta.content:
            if self.open is None or self.open["type"] != "message":
                yield from self._open(message_item(new_id("msg"), "", "in_progress"))
            self.open["content"][0]["text"] += delta.content
            yield self.event("response.output_text.delta", item_id=self.open["id"], output_index=self._index(),
                             content_index=0, delta=delta.content, logprobs=[])
        for call in delta.tool_calls or ():
            item = self.calls.get(call.index)
            if item is None:  # a call's first delta names it
                item = self.calls[call.index] = function_call_item(
                    new_id("fc"), call.id or new_id("call"), call.function.name or "", "", "in_progress")
                yield from self._open(item)
            if item is not self.open:
                continue  # a late fragment of a call already closed (the parsers send each call whole in turn)
            if call.function and call.function.arguments:
                item["arguments"] += call.function.arguments
                yield self.event("response.function_call_arguments.delta", item_id=item["id"],
                                 output_index=self._index(), delta=call.function.arguments)

    def finish(self, finish_reason: str | None, usage: UsageInfo | None) -> Iterator[dict[str, Any]]:
        if not self.items and self.open is None:  # an empty answer is still a message, as a whole response has
            yield from self._open(message_item(new_id("msg"), "", "in_progress"))
        yield from self._close()
        # One closing event whatever the status, as vLLM sends it: OpenAI names a cut-off stream's last event
        # response.incomplete, which the `openai` client's responses.stream() and the Agents SDK do not take as the
        # end (get_final_response raises); the response inside says "incomplete" either way.
        yield self.event("response.completed", response=self.shell.body(status_of(finish_reason), self.items, usage))
