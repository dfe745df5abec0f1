"""gpt-oss's harmony messages (lmserve.harmony): a call is a message to `functions.NAME` (on the commentary channel, or
any) whose body is its arguments; the answer is every other message but the analysis channel's: the final channel,
and the commentary a model shows the user before its calls (its preambles). The analysis channel is the
reasoning parser's (reasoning_parsers.HarmonyReasoningParser) and is skipped here.

A call is sent whole (id, name and arguments in one delta) once its message ends: at `<|call|>`, which also ends
generation, so streaming its arguments piece by piece would gain nothing. Arguments that are not a JSON object, a
message to a recipient that is not a function (gpt-oss's built-in browser and python tools, which lmserve does not
run) and text outside the format are content, never an error.
"""

from __future__ import annotations

import json

from lmserve.api.tool_parsers.common import (
    DeltaToolCall,
    ExtractedToolCalls,
    StreamDelta,
    ToolCall,
    ToolCallStream,
    ToolParser,
    json_text,
    make_tool_call_id,
    plain_text,
)
from lmserve.harmony import FUNCTIONS, HarmonyReader, Piece, is_function


def _call(recipient: str, body: str) -> ToolCall | None:
    """The call a message to a function makes; None when its arguments are not a JSON object (then it is content)."""
    try:
        arguments = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(make_tool_call_id(), plain_text(recipient[len(FUNCTIONS):]), json_text(arguments))


class HarmonyToolParser(ToolParser):
    name = "harmony"
    needs_special_tokens = True  # the format's tokens are special tokens: the text must keep them

    def extract(self, text: str) -> ExtractedToolCalls:
        stream = _HarmonyStream(self)
        out = stream.feed(text)
        last = stream.finish()
        calls = [ToolCall(c.id or "", c.name or "", c.arguments) for c in out.tool_calls + last.tool_calls]
        content = out.content + last.content
        return ExtractedToolCalls(content or None, calls)

    def streaming(self) -> ToolCallStream:
        return _HarmonyStream(self)


class _HarmonyStream(ToolCallStream):
    def __init__(self, parser: HarmonyToolParser) -> None:
        super().__init__(parser)
        self.reader = HarmonyReader()
        self.call_bodies: dict[int, str] = {}  # a commentary message to a recipient, until it ends

    def feed(self, delta_text: str) -> StreamDelta:
        return self._read(self.reader.feed(delta_text))

    def finish(self) -> StreamDelta:
        return self._read(self.reader.feed("", finished=True))

    def _read(self, pieces: list[Piece]) -> StreamDelta:
        out = StreamDelta()
        for piece in pieces:
            header = piece.header
            if header is not None and is_function(header.recipient):  # a call's body, whole once it ended
                body = self.call_bodies.pop(piece.message, "") + piece.text
                if not piece.ended:
                    self.call_bodies[piece.message] = body
                    continue
                call = _call(header.recipient, body)
                if call is None:
                    out.content += body
                else:
                    out.tool_calls.append(DeltaToolCall(self.calls, call.id, call.name, call.arguments))
                    self.calls += 1
            elif header is None or header.channel != "analysis":  # analysis is the reasoning parser's
                out.content += piece.text
        return out
