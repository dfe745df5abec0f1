"""What the tool-call parsers share: the call types, JSON scanning and re-serialising, and the streams' base."""

from __future__ import annotations

import json
import random
import re
import string
from dataclasses import dataclass, field
from typing import Any, ClassVar

# OpenAI's id shape (`call_` + 24 alphanumerics) rather than vLLM's `chatcmpl-tool-<hex>`: clients and agent
# frameworks only echo it back, and some validate the prefix. Its own generator, so that code seeding the global
# `random` (sampling seeds, tests) cannot make two requests' ids collide.
_ID_ALPHABET = string.ascii_letters + string.digits
_id_random = random.Random()
JSON_WHITESPACE = " \t\n\r"


# A model can write `"\ud800"` (a lone surrogate escape) in its JSON: json.loads turns it into a character that
# UTF-8 cannot carry, so the response could not be written. What is re-serialised keeps it escaped.
_SURROGATE = re.compile("[\ud800-\udfff]")


def json_text(value: Any, **options: Any) -> str:
    """json.dumps(value, ensure_ascii=False) with every lone surrogate written as its escape (`\\ud800`): the same
    JSON value, in valid UTF-8 (a surrogate can only stand inside a string literal of JSON text)."""
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", json.dumps(value, ensure_ascii=False, **options))


def plain_text(text: str) -> str:
    """A decoded string (a function name) with any lone surrogate replaced by U+FFFD, as a bad UTF-8 byte would be."""
    return _SURROGATE.sub("\ufffd", text)


def make_tool_call_id() -> str:
    return "call_" + "".join(_id_random.choices(_ID_ALPHABET, k=24))


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI's `function.arguments`


@dataclass
class ExtractedToolCalls:
    content: str | None
    tool_calls: list[ToolCall]


@dataclass
class DeltaToolCall:
    """One entry of a streamed `delta.tool_calls`: the first for a call has id and name, later ones only index."""

    index: int
    id: str | None
    name: str | None
    arguments: str


@dataclass
class StreamDelta:
    content: str = ""
    tool_calls: list[DeltaToolCall] = field(default_factory=list)


def call_from_object(obj: Any) -> ToolCall | None:
    """`{"name": str, "arguments" | "parameters": {...}}` as a ToolCall; None for anything else."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    # Llama 3's template says "parameters", Hermes' says "arguments"; models trained on either mix them up.
    arguments = obj["arguments"] if "arguments" in obj else obj.get("parameters", {})
    if not isinstance(arguments, dict):
        return None
    return ToolCall(make_tool_call_id(), plain_text(obj["name"]), json_text(arguments))


def call_from_json(text: str) -> ToolCall | None:
    try:
        return call_from_object(json.loads(text))
    except (ValueError, RecursionError):  # RecursionError: thousands of nested brackets
        return None


def held_back(text: str, start: int, marker: str) -> int:
    """How many trailing characters of text[start:] could be the beginning of `marker` (so are not yet content)."""
    for k in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ObjectScanner:
    """Finds the JSON objects that open `depth` brackets deep in a growing text, looking at each character once."""

    def __init__(self, depth: int) -> None:
        self.base = depth
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.start: int | None = None
        self.pos = 0

    def scan(self, text: str) -> list[tuple[int, int]]:
        """The (start, end) spans of the objects that closed in the text added since the last call."""
        spans = []
        for i in range(self.pos, len(text)):
            c = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                if c == "{" and self.depth == self.base:
                    self.start = i
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if c == "}" and self.depth == self.base and self.start is not None:
                    spans.append((self.start, i + 1))
                    self.start = None
        self.pos = len(text)
        return spans


class CanonicalJson:
    """A JSON value written as json.dumps(json.loads(value), ensure_ascii=False) writes it, while the value streams:
    each call of `advance` gives the text that can no longer change. Whitespace between tokens goes, separators
    become ", " and ": ", each string and number is re-serialised once complete enough (a string piece by piece,
    never inside an escape or between the halves of a surrogate pair). `done` once the value's outer bracket closed;
    `failed` on text that is not JSON (the caller's parse of the whole call then decides)."""

    def __init__(self, start: int) -> None:
        self.pos = start  # the next character of the text to look at
        self.depth = 0
        self.in_string = False
        self.escaped = False  # in a string, after a backslash
        self.pending = ""  # a string's or a bare token's characters not yet written
        self.done = False
        self.failed = False

    def advance(self, text: str) -> str:
        out: list[str] = []
        while self.pos < len(text) and not (self.done or self.failed):
            if self.in_string:
                self._string(text, out)
                continue
            c = text[self.pos]
            if self.pending and (c in ",:]}" or c in JSON_WHITESPACE):
                out.append(self._bare_token())
                if self.failed:
                    break
            if c in JSON_WHITESPACE:
                pass
            elif c == '"':
                self.in_string = True
                out.append('"')
            elif c in "{[":
                self.depth += 1
                out.append(c)
            elif c in "}]":
                self.depth -= 1
                out.append(c)
                self.done = self.depth == 0
            elif c == ",":
                out.append(", ")
            elif c == ":":
                out.append(": ")
            elif c.isalnum() or c in "+-.":
                self.pending += c
            else:
                self.failed = True
                break
            self.pos += 1
        return "".join(out)

    def _bare_token(self) -> str:
        """A number or literal, as json.dumps writes what json.loads reads of it (1.50 -> 1.5, 1e2 -> 100.0)."""
        token, self.pending = self.pending, ""
        try:
            return json.dumps(json.loads(token))
        except ValueError:
            self.failed = True
            return ""

    def _string(self, text: str, out: list[str]) -> None:
        """Takes string characters up to the closing quote or the end of the text; writes what is safe to."""
        i, closed = self.pos, False
        while i < len(text):
            c = text[i]
            if self.escaped:
                self.escaped = False
            elif c == "\\":
                self.escaped = True
            elif c == '"':
                closed = True
                break
            i += 1
        self.pending += text[self.pos : i]
        self.pos = i + 1 if closed else i
        safe = self.pending if closed else whole_characters(self.pending)
        if safe:
            try:
                out.append(json_text(json.loads(f'"{safe}"'))[1:-1])
            except ValueError:
                self.failed = True
                return
            self.pending = self.pending[len(safe):]
        if closed:
            out.append('"')
            self.in_string = False


def whole_characters(raw: str) -> str:
    """The longest prefix of a JSON string's raw text that ends on a whole character: not inside an escape, and not
    between the two escapes of a surrogate pair (decoded apart, they would be two lone surrogates)."""
    i = cut = 0
    while i < len(raw):
        if raw[i] != "\\":
            i += 1
        elif i + 1 >= len(raw):
            break
        elif raw[i + 1] != "u":
            i += 2
        elif i + 6 > len(raw):
            break
        else:
            code = raw[i + 2 : i + 6]
            high = all(ch in string.hexdigits for ch in code) and 0xD800 <= int(code, 16) < 0xDC00
            if high and raw[i + 6 : i + 8] == "\\u":
                if i + 12 > len(raw):
                    break
                i += 6  # the pair goes out together
            elif high and i + 8 > len(raw):
                break  # the next escape may be its other half
            i += 6
        cut = i
    return raw[:cut]


# `{"name": "...", "arguments": {` (or "parameters"), with any spacing: where a streamed call can start sending.
CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')
CALL_HEAD_WITHIN = 1024  # a call whose head is not complete this far into its object is sent whole at its end


class StreamedCall:
    """A call object `{"name": ..., "arguments": {...}}` while it streams: its first delta (index, id, name) once the
    name is complete, then its arguments as CanonicalJson writes them."""

    def __init__(self, index: int, name: str, arguments_start: int) -> None:
        self.index = index
        self.name = name
        self.arguments = CanonicalJson(arguments_start)
        self.sent = ""  # the argument text sent so far

    @classmethod
    def start(cls, index: int, text: str, start: int) -> tuple[StreamedCall | None, list[DeltaToolCall]]:
        """The call whose object starts at text[start], once its head is complete: it and its first deltas."""
        head = CALL_HEAD.match(text, start)
        if head is None:
            return None, []
        try:
            name = plain_text(json.loads(f'"{head.group(1)}"'))
        except ValueError:
            return None, []
        if not name:
            return None, []
        call = cls(index, name, head.end())
        return call, [DeltaToolCall(index, make_tool_call_id(), name, ""), *call.advance(text)]

    def advance(self, text: str) -> list[DeltaToolCall]:
        piece = self.arguments.advance(text)
        self.sent += piece
        return [DeltaToolCall(self.index, None, None, piece)] if piece else []

    def close(self, call: ToolCall) -> list[DeltaToolCall] | None:
        """The rest of the call, now parsed whole; None if it contradicts what was sent (a repeated key, say)."""
        if call.name != self.name or not call.arguments.startswith(self.sent):
            return None
        rest = call.arguments[len(self.sent):]
        self.sent = call.arguments
        return [DeltaToolCall(self.index, None, None, rest)] if rest else []


# ------------------------------------------------------------------------------------------------ parsers


class ToolParser:
    name: ClassVar[str]
    needs_special_tokens: ClassVar[bool] = False  # its markers are special tokens, which detokenizing would drop

    def extract(self, text: str) -> ExtractedToolCalls:
        raise NotImplementedError

    def streaming(self) -> ToolCallStream:
        raise NotImplementedError


class ToolCallStream:
    """State of one streamed choice. Subclasses release content and complete calls early in `_advance`."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent = 0  # the content streamed so far is always text[:sent]
        self.calls = 0  # tool calls streamed so far
        self.plain = False  # decided: there are no tool calls, everything is content
        self.stopped = False  # a call after streamed ones was malformed: nothing more is sent
        self.open_call: StreamedCall | None = None  # a call being sent piece by piece (hermes)

    def feed(self, delta_text: str) -> StreamDelta:
        self.text += delta_text
        out = StreamDelta()
        if self.plain:
            self._release(out, len(self.text))
        elif not self.stopped:
            self._advance(out)
        return out

    def finish(self) -> StreamDelta:
        out = StreamDelta()
        if self.stopped:
            return out
        result = self.parser.extract(self.text)
        if result.tool_calls:
            # What was held back of the content, then the calls not yet streamed (the earlier ones are equal).
            out.content = (result.content or "")[self.sent:]
            for call in result.tool_calls[self.calls:]:
                if not self._emit(out, call):
                    break
        elif self.calls == 0 and self.open_call is None:
            self._release(out, len(self.text))
        # else: a call was malformed after calls (or a call's first pieces) were sent, which cannot be taken back.
        return out

    def _advance(self, out: StreamDelta) -> None:
        raise NotImplementedError

    def _release(self, out: StreamDelta, end: int) -> None:
        out.content += self.text[self.sent:end]
        self.sent = max(self.sent, end)

    def _emit(self, out: StreamDelta, call: ToolCall) -> bool:
        """Sends a complete call, or the rest of the one being sent; False (and nothing more is sent) if it
        contradicts what was."""
        if self.open_call is None:
            out.tool_calls.append(DeltaToolCall(self.calls, call.id, call.name, call.arguments))
        else:
            rest = self.open_call.close(call)
            self.open_call = None
            if rest is None:
                self.stopped = True
                return False
            out.tool_calls += rest
        self.calls += 1
        return True

    def _stream_call(self, out: StreamDelta, start: int) -> None:
        """The call whose object starts at text[start] and has not closed yet: its first delta once its name is
        complete, then its arguments as they come."""
        if self.open_call is None:
            if len(self.text) - start > CALL_HEAD_WITHIN:
                return
            self.open_call, deltas = StreamedCall.start(self.calls, self.text, start)
        else:
            deltas = self.open_call.advance(self.text)
        out.tool_calls += deltas

    def _malformed(self, out: StreamDelta) -> None:
        """A call that cannot be parsed: if it is the first, the whole text is content (as extract() says)."""
        if self.open_call is not None:
            self.stopped = True  # its first pieces were sent
        elif self.calls == 0:
            self.plain = True
            self._release(out, len(self.text))
        else:
            self.stopped = True


class _CallsAtFinishStream(ToolCallStream):
    """Content until the output turns into calls (`tools_start` says where), then everything held to finish(),
    which sends the calls whole: for formats whose calls cannot be told complete before the output ends."""

    def __init__(self, parser: ToolParser) -> None:
        super().__init__(parser)
        self.tools = False

    def tools_start(self) -> int | None:
        """Where the calls begin (None: not yet seen); may set self.plain when the output cannot hold any."""
        raise NotImplementedError

    def hold(self) -> int:
        """Trailing characters that could still begin the calls."""
        return 0

    def _advance(self, out: StreamDelta) -> None:
        if self.tools:
            return
        start = self.tools_start()
        if self.plain:
            self._release(out, len(self.text))
        elif start is not None:
            self._release(out, start)
            self.tools = True
        else:
            self._release(out, len(self.text) - self.hold())


