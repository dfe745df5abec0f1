"""OpenAI's harmony format (gpt-oss): its tokens, which models speak it, and the prompt its chat template renders.

A harmony conversation is a run of messages `<|start|>ROLE<|channel|>CHANNEL<|message|>TEXT<|end|>`. The assistant
thinks on the `analysis` channel, calls tools on `commentary` (the header names the recipient, `to=functions.NAME`,
and the body is the arguments, ended by `<|call|>`), and answers on `final` (ended by `<|return|>`). Generation stops
on `<|return|>` and `<|call|>`, never on `<|end|>`, which closes a message the model goes on after.

`render_harmony` writes what the chat template gpt-oss ships writes (openai/gpt-oss-*'s chat_template.jinja, which
llama.cpp keeps as models/templates/openai-gpt-oss-120b.jinja), token for token (tests/api/test_harmony.py checks it
against that template), so lmserve needs no Jinja template to serve the format: a GGUF file or a directory without
one, and a template with another's quirks, get the turns the model was trained on. On top of the template:
- an earlier assistant turn's thinking may come as OpenAI clients send it back: `reasoning_content` (vLLM's field)
  or `reasoning`, besides the template's own `thinking`;
- `reasoning_effort` is one of the format's three levels (OpenAI's `minimal`/`none` are `low`, `xhigh` is `high`);
- a tool without a description gets no `//` line (the template fails on it; openai-harmony leaves it out), and an
  assistant turn with a tool call and both content and thinking keeps the thinking (the template refuses it).
Pure text, no tokenizer: the front-end tokenizes what this writes, the API parses what the model writes back.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

START, END, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>"
RETURN, CALL = "<|return|>", "<|call|>"
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
STOP_TEXTS = (RETURN, CALL)  # the tokens that end an assistant's turn (openai-harmony's stop tokens for actions)

FUNCTIONS = "functions."  # the namespace of the request's tools: a call's recipient is `functions.NAME`
HARMONY_MODEL_TYPES = {"gpt_oss", "gpt-oss"}  # Hugging Face's model_type, GGUF's general.architecture
REASONING_EFFORTS = {"low": "low", "medium": "medium", "high": "high", "minimal": "low", "none": "low",
                     "xhigh": "high"}
DEFAULT_MODEL_IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."


def uses_harmony(model_type: str | None, chat_template: str | None) -> bool:
    """A gpt-oss model, or any model whose chat template writes harmony's channels."""
    if model_type in HARMONY_MODEL_TYPES:
        return True
    return chat_template is not None and all(marker in chat_template for marker in (START, CHANNEL, MESSAGE))


def is_function(recipient: str | None) -> bool:
    """A message to this recipient calls one of the request's tools."""
    return recipient is not None and recipient.startswith(FUNCTIONS) and len(recipient) > len(FUNCTIONS)


class HarmonyRenderError(ValueError):
    """The messages cannot be written as a harmony conversation (the template raises on the same)."""


def render_harmony(
    messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, *,
    tools: Sequence[Mapping[str, Any]] | None = None, reasoning_effort: str | None = None,
    model_identity: str | None = None, today: str | None = None, continue_final_message: bool = False,
    **_ignored: Any,
) -> str:
    """The prompt gpt-oss's chat template writes for these OpenAI-shaped messages (see the module's notes).
    `today`: the "Current date" line's date (default: today, as the template's strftime_now). Other template
    variables are ignored, as the template ignores them."""
    if continue_final_message:
        # The template always closes the last message: a turn to continue would be a new message.
        raise HarmonyRenderError("continue_final_message is not supported by the harmony format (gpt-oss)")
    effort = REASONING_EFFORTS.get(reasoning_effort or "medium", reasoning_effort or "medium")
    system = [
        f"{model_identity if model_identity is not None else DEFAULT_MODEL_IDENTITY}\n",
        "Knowledge cutoff: 2024-06\n",
        f"Current date: {today or datetime.now().strftime('%Y-%m-%d')}\n\n",
        f"Reasoning: {effort}\n\n",
        "# Valid channels: analysis, commentary, final. Channel must be included for every message.",
    ]
    if tools:
        system.append("\nCalls to these tools must go to the commentary channel: 'functions'.")
    out = [f"{START}system{MESSAGE}", *system, END]

    loop_messages = list(messages)
    developer = ""
    if loop_messages and loop_messages[0].get("role") in ("developer", "system"):
        developer = _text(loop_messages[0].get("content"))
        loop_messages = loop_messages[1:]
    if developer or tools:
        out.append(f"{START}developer{MESSAGE}")
        if developer:
            out.append(f"# Instructions\n\n{developer}\n\n")
        if tools:
            out.append("# Tools\n\n" + _tool_namespace("functions", tools))
        out.append(END)

    last_call: str | None = None
    for index, message in enumerate(loop_messages):
        role = message.get("role")
        if role == "assistant":
            out.append(_assistant(message, loop_messages[index + 1:], index == len(loop_messages) - 1,
                                  add_generation_prompt))
            calls = message.get("tool_calls")
            last_call = _call_function(calls[0])["name"] if calls else None
        elif role == "tool":
            if last_call is None:
                raise HarmonyRenderError("a tool message must follow an assistant message with a tool call")
            out.append(f"{START}functions.{last_call} to=assistant{CHANNEL}commentary{MESSAGE}"
                       f"{_tojson(_text(message.get('content')))}{END}")
        elif role == "user":
            out.append(f"{START}user{MESSAGE}{_text(message.get('content'))}{END}")
        # A later system or developer message: the template writes nothing for it.
    if add_generation_prompt:
        out.append(f"{START}assistant")
    return "".join(out)


def _text(content: Any) -> str:
    return "" if content is None else str(content)


def _tojson(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)  # the template's tojson (transformers' filter)


def _thinking(message: Mapping[str, Any]) -> str:
    for key in ("thinking", "reasoning_content", "reasoning"):
        if isinstance(message.get(key), str) and message[key]:
            return message[key]
    return ""


def _call_function(call: Mapping[str, Any]) -> Mapping[str, Any]:
    function = call.get("function")
    return function if isinstance(function, Mapping) else call


def _assistant(message: Mapping[str, Any], later: Sequence[Mapping[str, Any]], last: bool,
               add_generation_prompt: bool) -> str:
    content, thinking = _text(message.get("content")), _thinking(message)
    for field, text in (("content", content), ("reasoning", thinking)):
        if f"{CHANNEL}analysis{MESSAGE}" in text or f"{CHANNEL}final{MESSAGE}" in text:
            raise HarmonyRenderError(f"an assistant message's {field} holds harmony channel tags: send the thinking "
                                     "as reasoning_content and the answer as content, without the tags")
    calls = message.get("tool_calls")
    if calls:
        # The template writes one call per assistant message, and keeps the thinking before it only while no later
        # assistant turn has answered (the only thinking a prompt carries).
        answered = any(m.get("role") == "assistant" and not m.get("tool_calls") for m in later)
        out = ""
        if (thinking or content) and not answered:
            out = f"{START}assistant{CHANNEL}analysis{MESSAGE}{thinking or content}{END}"
        function = _call_function(calls[0])
        content_type = function.get("content_type", "json")
        return (out + f"{START}assistant to=functions.{function['name']}{CHANNEL}commentary {content_type}{MESSAGE}"
                f"{_tojson(function.get('arguments'))}{CALL}")
    if last and not add_generation_prompt:  # a training example's last turn: thinking kept, ended by <|return|>
        analysis = f"{START}assistant{CHANNEL}analysis{MESSAGE}{thinking}{END}" if thinking else ""
        return f"{analysis}{START}assistant{CHANNEL}final{MESSAGE}{content}{RETURN}"
    return f"{START}assistant{CHANNEL}final{MESSAGE}{content}{END}"  # earlier turns' thinking is dropped


def _tool_namespace(namespace: str, tools: Sequence[Mapping[str, Any]]) -> str:
    out = [f"## {namespace}\n\n", f"namespace {namespace} {{\n\n"]
    for tool in tools:
        function = tool.get("function", tool)
        if function.get("description"):
            out.append(f"// {function['description']}\n")
        out.append(f"type {function['name']} = ")
        parameters = function.get("parameters") or {}
        properties = parameters.get("properties") if isinstance(parameters, Mapping) else None
        if not properties:
            out.append("() => any;\n\n")
            continue
        required = parameters.get("required") or []
        out.append("(_: {\n")
        for name, spec in properties.items():
            if spec.get("description"):
                out.append(f"// {spec['description']}\n")
            out.append(f"{name}{'' if name in required else '?'}: {_typescript(spec)}")
            if "default" in spec:
                if spec.get("enum"):
                    out.append(f", // default: {spec['default']}")
                elif spec.get("oneOf"):
                    out.append(f"// default: {spec['default']}")
                else:
                    out.append(f", // default: {_tojson(spec['default'])}")
            out.append(",\n")
        out.append("}) => any;\n\n")
    out.append(f"}} // namespace {namespace}")
    return "".join(out)


_ARRAY_ITEMS = {"string": "string[]", "number": "number[]", "integer": "number[]", "boolean": "boolean[]"}
_SCALARS = {"number": "number", "integer": "number", "boolean": "boolean"}


def _typescript(spec: Mapping[str, Any]) -> str:
    """A JSON schema as the template's render_typescript_type writes it (its quirks included)."""
    kind = spec.get("type")
    nullable = " | null" if spec.get("nullable") else ""
    if kind == "array":
        items = spec.get("items")
        if not items:
            return "any[]" + nullable
        if items.get("type") in _ARRAY_ITEMS:
            return _ARRAY_ITEMS[items["type"]] + nullable
        inner = _typescript(items)
        return ("any[]" if inner == "object | object" or len(inner) > 50 else inner + "[]") + nullable
    if isinstance(kind, list) and kind:
        return " | ".join(map(str, kind))
    if spec.get("oneOf"):
        variants = spec["oneOf"]
        if len(variants) > 1 and any(v.get("type") == "object" for v in variants):
            return "any"
        out = []
        for i, variant in enumerate(variants):
            out.append(_typescript(variant))
            if variant.get("description"):
                out.append(f"// {variant['description']}")
            if "default" in variant:
                out.append(f"\n    // default: {_tojson(variant['default'])}")
            if i < len(variants) - 1:
                out.append(" | \n")
        return "".join(out)
    if kind == "string":
        if spec.get("enum"):
            return '"' + '" | "'.join(map(str, spec["enum"])) + '"'
        return "string" + nullable
    if kind in _SCALARS:
        return _SCALARS[kind]
    if kind == "object":
        properties = spec.get("properties")
        if not properties:
            return "object"
        required = spec.get("required") or []
        fields = [f"{name}{'' if name in required else '?'}: \n                {_typescript(sub)}"
                  for name, sub in properties.items()]
        return "{\n" + ", ".join(fields) + "}"
    return "any"


# ------------------------------------------------------------------------------------------------ reading


@dataclass(frozen=True)
class Header:
    """A message's header: `assistant to=functions.get_weather<|channel|>commentary <|constrain|>json`."""

    role: str
    channel: str | None
    recipient: str | None = None  # `to=...`: a tool call's function, as `functions.NAME`
    content_type: str | None = None  # `json` (after <|constrain|> or the channel)


@dataclass
class Piece:
    """Text the model wrote: a piece of one message's body, or (header None) text outside the format."""

    message: int  # which message of the output (pieces of one message share it)
    header: Header | None
    text: str
    ended: bool = False  # the message is complete (its end token, or the end of the output)
    end: str | None = None  # the token that ended it: <|end|>, <|call|> or <|return|> (None: the output ended)


# A header is a role, a recipient, a channel and a content type: longer than this without <|message|>, it is not one.
MAX_HEADER_CHARS = 256
_BODY_ENDS = (END, CALL, RETURN, START)  # START: a model that forgot <|end|> began the next message


def _held_back(text: str, start: int, markers: Sequence[str]) -> int:
    """How many trailing characters of text[start:] could begin one of the markers (not yet decided)."""
    for k in range(min(max(map(len, markers)) - 1, len(text) - start), 0, -1):
        if any(marker.startswith(text[len(text) - k:]) for marker in markers):
            return k
    return 0


def parse_header(raw: str, first: bool) -> Header | None:
    """The header of a message the model wrote (`first`: the prompt already wrote `<|start|>assistant`); None when
    the text is not a header."""
    if any(marker in raw for marker in (START, END, MESSAGE, RETURN, CALL)):
        return None
    before, found, after = raw.partition(CHANNEL)
    if not found:
        return None
    words = before.split()
    role = "assistant" if first else (words.pop(0) if words and not words[0].startswith("to=") else "")
    if not role or role.startswith("to="):
        return None
    rest = after.replace(CONSTRAIN, " ").split()
    if not rest:
        return None
    channel, rest = rest[0], rest[1:]
    recipient = next((w[3:] for w in words + rest if w.startswith("to=")), None)
    others = [w for w in words + rest if not w.startswith("to=")]
    if len(others) > 1 or (recipient is not None and not recipient):
        return None
    return Header(role, channel, recipient, others[0] if others else None)


class HarmonyReader:
    """The model's output, read as harmony messages while it streams: `feed` takes the next text and returns the
    pieces that can no longer change. A body's end tokens are held back while only their beginning has come. Text
    that does not follow the format (no header where one must be, a header too long, another role than the
    assistant's) is read, from there on, as one plain piece (header None): a caller makes it content."""

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0  # what was read so far
        self.state = "header"  # header, body, between (after an end token), plain
        self.header: Header | None = None
        self.message = 0

    def feed(self, delta: str, finished: bool = False) -> list[Piece]:
        self.text += delta
        pieces: list[Piece] = []
        while True:
            if self.state == "plain":
                if self.pos < len(self.text):
                    pieces.append(Piece(self.message, None, self.text[self.pos:], ended=finished))
                    self.pos = len(self.text)
                return pieces
            if self.state == "header":
                if not self._header(finished):
                    return pieces
            elif self.state == "body":
                if not self._body(pieces, finished):
                    return pieces
            elif not self._between(finished):
                return pieces

    def _plain(self) -> bool:
        self.state = "plain"
        self.message += 1
        return True

    def _header(self, finished: bool) -> bool:
        end = self.text.find(MESSAGE, self.pos)
        if end < 0:
            if finished and (self.message > 0 or CHANNEL in self.text[self.pos:]):
                self.pos, self.state = len(self.text), "between"  # a header cut off by max_tokens: no message
                return False
            if finished or len(self.text) - self.pos > MAX_HEADER_CHARS:
                return self._plain()
            return False
        header = parse_header(self.text[self.pos:end], first=self.message == 0)
        if header is None or header.role != "assistant":
            return self._plain()
        self.header, self.pos, self.state = header, end + len(MESSAGE), "body"
        return True

    def _body(self, pieces: list[Piece], finished: bool) -> bool:
        found = [(i, marker) for marker in _BODY_ENDS if (i := self.text.find(marker, self.pos)) >= 0]
        if found:
            end, marker = min(found)
            pieces.append(Piece(self.message, self.header, self.text[self.pos:end], True, marker))
            self.pos = end + (len(marker) if marker != START else 0)
            self.state, self.message = "between", self.message + 1
            return True
        hold = 0 if finished else _held_back(self.text, self.pos, _BODY_ENDS)
        cut = len(self.text) - hold
        if cut > self.pos or finished:
            pieces.append(Piece(self.message, self.header, self.text[self.pos:cut], ended=finished))
            self.pos = cut
        return False

    def _between(self, finished: bool) -> bool:
        rest = self.text[self.pos:]
        if rest.startswith(START):
            self.pos += len(START)
            self.state = "header"
            return True
        if not rest or (START.startswith(rest) and not finished):
            return False
        return self._plain()
