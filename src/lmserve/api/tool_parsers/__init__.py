"""Tool calls in a model's own text format, found after generation (`extract`) or while it streams (`streaming`).

Parsers are chosen by vLLM's `--tool-call-parser` names (TOOL_PARSERS). They are pure text: no tokenizer, no engine.
One module per format (harmony, hermes, llama3_json, mistral, pythonic) over what they share (common: the call types, the JSON
scanner and re-serialiser, the streams' base).

Agreement between the two paths: for any output, the streamed content concatenates to `extract(text).content`
(or "" where that is None) and each streamed call's argument fragments concatenate to its `arguments`. A stream
gets there by emitting early only what can no longer change, and at `finish()` it reconciles with `extract` of the
whole text. The one exception: a malformed call *after* calls already streamed makes `extract` return the whole
text as content with no calls, but a stream cannot take back what it sent; it then sends nothing more.

Arguments are always `json.dumps(parsed, ensure_ascii=False)`, so both paths normalise the model's spacing the
same way. Hermes calls stream as vLLM's do: a first delta with the id and the name as soon as the name is complete
(and `"arguments": {` follows it), then the arguments piece by piece, re-serialised as they come (CanonicalJson), so
the pieces concatenate to the same text. A call written between the markers but malformed (its JSON does not parse)
contradicts what was sent; as in vLLM the stream then sends nothing more. The other formats send each call whole (id,
name and arguments in one delta) once it is complete: a bare JSON object (llama3_json) may still turn out to be
content, and the bracketed formats are only known at the end.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmserve.api.reasoning_parsers import REASONING_PARSERS
from lmserve.api.tool_parsers.common import ToolParser
from lmserve.api.tool_parsers.harmony import HarmonyToolParser
from lmserve.api.tool_parsers.hermes import HermesToolParser
from lmserve.api.tool_parsers.llama3_json import Llama3JsonToolParser
from lmserve.api.tool_parsers.mistral import MistralToolParser
from lmserve.api.tool_parsers.pythonic import PythonicToolParser

__all__ = ["HARMONY_PARSERS", "TOOL_PARSERS", "HarmonyToolParser", "HermesToolParser", "Llama3JsonToolParser", "MistralToolParser", "PythonicToolParser",
           "ToolConfig", "ToolParser", "get_tool_parser"]

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    HarmonyToolParser.name: HarmonyToolParser,
    "openai": HarmonyToolParser,  # vLLM's name for gpt-oss's
    HermesToolParser.name: HermesToolParser,
    Llama3JsonToolParser.name: Llama3JsonToolParser,
    MistralToolParser.name: MistralToolParser,
    PythonicToolParser.name: PythonicToolParser,
}


# The names of gpt-oss's parsers (lmserve's and vLLM's), reasoning and tools: they read the same messages, together.
HARMONY_PARSERS = {"harmony", "openai", "openai_gptoss"}


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]()


@dataclass
class ToolConfig:
    """How chat output is parsed: vLLM's --enable-auto-tool-choice, --tool-call-parser and --reasoning-parser."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"unknown --reasoning-parser {self.reasoning_parser!r}: use one of "
                             f"{', '.join(REASONING_PARSERS)}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"unknown --tool-call-parser {self.tool_call_parser!r}: use one of "
                             f"{', '.join(TOOL_PARSERS)}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError(f"--enable-auto-tool-choice needs --tool-call-parser ({', '.join(TOOL_PARSERS)})")
        harmony = {self.reasoning_parser in HARMONY_PARSERS, self.tool_call_parser in HARMONY_PARSERS}
        if harmony == {True, False} and None not in (self.reasoning_parser, self.tool_call_parser):
            raise ValueError(f"--reasoning-parser {self.reasoning_parser} and --tool-call-parser "
                             f"{self.tool_call_parser} read different formats: gpt-oss's harmony messages are read "
                             "by harmony for both")

    def for_chat_format(self, chat_format: str | None) -> ToolConfig:
        """A harmony model's output is read as harmony, reasoning and tool calls (tool_choice "auto" included: its
        calls are unambiguous), unless the server was told otherwise."""
        if chat_format != "harmony" or (self.reasoning_parser is not None and self.tool_call_parser is not None):
            return self
        return ToolConfig(enable_auto_tool_choice=self.enable_auto_tool_choice or self.tool_call_parser is None,
                          tool_call_parser=self.tool_call_parser or "harmony",
                          reasoning_parser=self.reasoning_parser or "harmony")
