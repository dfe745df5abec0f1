"""Mistral calls: [TOOL_CALLS] then a JSON list, or name[ARGS]{...} in newer templates."""

from __future__ import annotations

import json

from lmserve.api.tool_parsers.common import (
    JSON_WHITESPACE,
    ExtractedToolCalls,
    ToolCall,
    ToolCallStream,
    ToolParser,
    _CallsAtFinishStream,
    call_from_object,
    held_back,
)


class MistralToolParser(ToolParser):
    """Mistral's `[TOOL_CALLS]` (a control token: the request keeps special tokens in its text): followed by a JSON
    list of `{"name", "arguments"}` (Mistral 7B v0.3, Nemo), or by `name[ARGS]{...}`, once per call (the tokenizers
    of Mistral Small 3.2, Magistral, Devstral). Text before it is content."""

    name = "mistral"
    needs_special_tokens = True
    MARKER = "[TOOL_CALLS]"
    ARGS = "[ARGS]"

    def extract(self, text: str) -> ExtractedToolCalls:
        first = text.find(self.MARKER)
        if first < 0:
            return ExtractedToolCalls(text, [])
        calls = self._calls(text[first:])
        if calls is None:
            return ExtractedToolCalls(text, [])
        return ExtractedToolCalls(text[:first] or None, calls)

    def _calls(self, text: str) -> list[ToolCall] | None:
        segments = [segment.strip(JSON_WHITESPACE) for segment in text.split(self.MARKER)[1:]]
        if len(segments) == 1 and segments[0][:1] in ("[", "{"):  # one JSON list (or object) of calls
            try:
                parsed = json.loads(segments[0])
            except (ValueError, RecursionError):
                return None
            objects = parsed if isinstance(parsed, list) else [parsed]
            calls = [call_from_object(obj) for obj in objects]
        else:  # name[ARGS]{...} per call
            calls = []
            for segment in segments:
                name, found, arguments = segment.partition(self.ARGS)
                try:
                    parsed = json.loads(arguments) if found and name.strip() else None
                except (ValueError, RecursionError):
                    parsed = None
                calls.append(call_from_object({"name": name.strip(), "arguments": parsed}))
        if not calls or any(call is None for call in calls):
            return None
        return calls

    def streaming(self) -> ToolCallStream:
        return _MistralStream(self)


class _MistralStream(_CallsAtFinishStream):
    def tools_start(self) -> int | None:
        start = self.text.find(MistralToolParser.MARKER, self.sent)
        return None if start < 0 else start

    def hold(self) -> int:
        return held_back(self.text, self.sent, MistralToolParser.MARKER)


