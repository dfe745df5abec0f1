"""Pythonic calls (Llama 3.2/4): a Python list of calls, parsed with `ast`, literals only."""

from __future__ import annotations

import ast

from lmserve.api.tool_parsers.common import (
    ExtractedToolCalls,
    ToolCall,
    ToolCallStream,
    ToolParser,
    _CallsAtFinishStream,
    json_text,
    make_tool_call_id,
)


class PythonicToolParser(ToolParser):
    """Llama 3.2 and Llama 4's Python-call lists: the whole output is `[get_weather(city="Paris"), f(x=1)]`
    (Llama 4 may wrap it in `<|python_start|>` ... `<|python_end|>`), keyword arguments of Python literals.
    Anything else is content."""

    name = "pythonic"
    START, END = "<|python_start|>", "<|python_end|>"

    def _body(self, text: str) -> str:
        body = text.strip()
        if body.startswith(self.START):
            body = body[len(self.START):].removesuffix(self.END).strip()
        return body

    def extract(self, text: str) -> ExtractedToolCalls:
        body = self._body(text)
        if not (body.startswith("[") and body.endswith("]")):
            return ExtractedToolCalls(text, [])
        calls = self._calls(body)
        return ExtractedToolCalls(text, []) if calls is None else ExtractedToolCalls(None, calls)

    @staticmethod
    def _calls(body: str) -> list[ToolCall] | None:
        try:
            tree = ast.parse(body, mode="eval").body
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return None
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args):
                return None
            arguments = {}
            for keyword in node.keywords:
                if keyword.arg is None:  # **kwargs
                    return None
                try:
                    arguments[keyword.arg] = ast.literal_eval(keyword.value)
                except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                    return None
            try:
                arguments_json = json_text(arguments, allow_nan=False)
            except (TypeError, ValueError):  # a set, bytes or a complex number: not JSON
                return None
            calls.append(ToolCall(make_tool_call_id(), node.func.id, arguments_json))
        return calls

    def streaming(self) -> ToolCallStream:
        return _PythonicStream(self)


class _PythonicStream(_CallsAtFinishStream):
    def tools_start(self) -> int | None:
        body = self.text.lstrip()
        if not body or PythonicToolParser.START.startswith(body):
            return None  # whitespace or part of the tag: undecided (nothing released: hold() is everything)
        if body.startswith(("[", PythonicToolParser.START)):
            return 0
        self.plain = True
        return None

    def hold(self) -> int:
        return len(self.text) - self.sent  # nothing is content until the first character decides


