"""Hermes calls (Qwen2.5 and many fine-tunes): JSON objects between <tool_call> markers, streamed piece by piece."""

from __future__ import annotations

from lmserve.api.tool_parsers.common import (
    ExtractedToolCalls,
    StreamDelta,
    ToolCallStream,
    ToolParser,
    call_from_json,
    held_back,
)


class HermesToolParser(ToolParser):
    """Qwen 2.5 / Hermes 2 Pro: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks.

    Text before the first block is content; text between and after blocks is dropped (as vLLM). The last block
    may lack its end tag (generation stopped on EOS right after the JSON)."""

    name = "hermes"
    START = "<tool_call>"
    END = "</tool_call>"

    def extract(self, text: str) -> ExtractedToolCalls:
        first = text.find(self.START)
        if first < 0:
            return ExtractedToolCalls(text, [])
        calls = []
        start = first
        while start >= 0:
            body_start = start + len(self.START)
            end = text.find(self.END, body_start)
            call = call_from_json(text[body_start:] if end < 0 else text[body_start:end])
            if call is None:
                return ExtractedToolCalls(text, [])
            calls.append(call)
            start = -1 if end < 0 else text.find(self.START, end + len(self.END))
        return ExtractedToolCalls(text[:first] or None, calls)

    def streaming(self) -> ToolCallStream:
        return _HermesStream(self)


class _HermesStream(ToolCallStream):
    def __init__(self, parser: HermesToolParser) -> None:
        super().__init__(parser)
        self.pos = 0  # where to look for the next block
        self.started = False  # a block has begun: no more content

    def _advance(self, out: StreamDelta) -> None:
        start_tag, end_tag = HermesToolParser.START, HermesToolParser.END
        while not self.plain:
            start = self.text.find(start_tag, self.pos)
            if start < 0:
                if not self.started:
                    self._release(out, len(self.text) - held_back(self.text, self.sent, start_tag))
                    self.pos = self.sent  # no block starts before what was released: don't search it again
                return
            if not self.started:
                self._release(out, start)
                self.started = True
            end = self.text.find(end_tag, start + len(start_tag))
            if end < 0:
                self.pos = start  # an open block waits for its end tag, or for finish(); its call streams
                self._stream_call(out, start + len(start_tag))
                return
            call = call_from_json(self.text[start + len(start_tag):end])
            if call is None:
                self._malformed(out)
                return
            if not self._emit(out, call):
                return
            self.pos = end + len(end_tag)


