"""Llama 3.1-style calls: a bare JSON object (or several, separated by semicolons) as the whole answer."""

from __future__ import annotations

import json

from lmserve.api.tool_parsers.common import (
    JSON_WHITESPACE,
    ExtractedToolCalls,
    ObjectScanner,
    StreamDelta,
    ToolCallStream,
    ToolParser,
    call_from_json,
    call_from_object,
)


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1 / 3.2 JSON tool calls: the whole output is `{"name": ..., "parameters": {...}}` (or
    "arguments"), optionally after `<|python_tag|>`, several separated by `;`. Anything else is content."""

    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"

    def body_start(self, text: str) -> int:
        """Where the JSON starts: after leading whitespace and the python tag."""
        pos = len(text) - len(text.lstrip(JSON_WHITESPACE))
        if text.startswith(self.PYTHON_TAG, pos):
            pos += len(self.PYTHON_TAG)
            pos = len(text) - len(text[pos:].lstrip(JSON_WHITESPACE))
        return pos

    def extract(self, text: str) -> ExtractedToolCalls:
        pos = self.body_start(text)
        if not text.startswith("{", pos):
            return ExtractedToolCalls(text, [])
        decoder = json.JSONDecoder()
        calls = []
        while pos < len(text):
            try:
                obj, pos = decoder.raw_decode(text, pos)
            except (ValueError, RecursionError):
                return ExtractedToolCalls(text, [])
            call = call_from_object(obj)
            if call is None:
                return ExtractedToolCalls(text, [])
            calls.append(call)
            rest = text[pos:].lstrip(JSON_WHITESPACE)
            if rest.startswith(";"):
                rest = rest[1:].lstrip(JSON_WHITESPACE)  # a trailing ";" is allowed
            elif rest:
                return ExtractedToolCalls(text, [])
            pos = len(text) - len(rest)
        return ExtractedToolCalls(None, calls)

    def streaming(self) -> ToolCallStream:
        return _Llama3JsonStream(self)


class _Llama3JsonStream(ToolCallStream):
    def __init__(self, parser: Llama3JsonToolParser) -> None:
        super().__init__(parser)
        self.llama = parser
        self.tools = False  # decided: the output is tool calls
        self.scanner = ObjectScanner(depth=0)
        self.pending: list[tuple[int, int]] = []  # complete objects not yet known to be followed by ";"

    def _advance(self, out: StreamDelta) -> None:
        if not self.tools:
            pos = self.llama.body_start(self.text)
            if pos == len(self.text):
                return  # whitespace or (part of) the python tag: undecided
            tag = Llama3JsonToolParser.PYTHON_TAG
            if self.text.startswith("{", pos):
                self.tools = True
            elif not tag.startswith(self.text.lstrip(JSON_WHITESPACE)):
                self.plain = True
                self._release(out, len(self.text))
                return
            else:
                return
        self.pending += self.scanner.scan(self.text)
        # A call is final once a ";" follows it; the last one waits for finish(), which also checks what follows.
        while self.pending:
            start, end = self.pending[0]
            after = self.text[end:].lstrip(JSON_WHITESPACE)
            if not after:
                return
            call = call_from_json(self.text[start:end]) if after.startswith(";") else None
            if call is None:
                self._malformed(out)
                return
            self._emit(out, call)
            self.pending.pop(0)


