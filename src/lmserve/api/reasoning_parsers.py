"""Reasoning models' thinking, split from their answer: vLLM's `--reasoning-parser` names.

A reasoning model writes its thinking between `<think>` and `</think>` and then its answer. The parser gives the
thinking to the message's `reasoning_content` and the rest to `content` (DeepSeek's API and vLLM's field), streamed
and not, so that tool calls are parsed from the answer only. Pure text, as the tool parsers are.

- `deepseek_r1`: DeepSeek-R1 and its distills. Their chat template ends the prompt with `<think>\\n`, so the output
  starts inside the thinking (a leading `<think>` is dropped if the model writes one anyway); all of it is reasoning
  until `</think>`, and an output cut off before `</think>` (max_tokens) is reasoning only.
- `qwen3`: Qwen3, whose output opens with `<think>` when it thinks; with `enable_thinking: false` (chat_template_kwargs)
  its template writes an empty `<think></think>` into the prompt and the output is the answer only. An output that
  does not open with `<think>` is content; one cut off inside the thinking is reasoning only.

- `harmony` (vLLM's `openai_gptoss`): gpt-oss, whose thinking is its analysis channel's messages (lmserve.harmony).
  The rest of the output is left whole, format and all, for the harmony tool parser, which takes the answer and the
  calls from it: the two always go together.

Agreement between the two paths: a stream's reasoning and content deltas concatenate to `extract` of the whole text.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmserve.harmony import HarmonyReader, is_function

THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class Reasoning:
    reasoning: str | None  # None: the output has no thinking
    content: str | None  # None: the output has no answer (yet)


def _partial_suffix(text: str, marker: str) -> int:
    """How many trailing characters of `text` could begin `marker` (held back until the next delta says)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningParser:
    name = ""
    starts_in_reasoning = False  # deepseek_r1: the prompt opened the thinking

    def extract(self, text: str) -> Reasoning:
        body = text.lstrip()
        opened = body.startswith(THINK_START)
        if not (opened or self.starts_in_reasoning):
            return Reasoning(None, text)
        if opened:
            body = body[len(THINK_START):]
        else:
            body = text
        thinking, ended, answer = body.partition(THINK_END)
        if not ended:
            return Reasoning(thinking, None)
        return Reasoning(thinking, answer or None)

    def streaming(self) -> ReasoningStream:
        return ReasoningStream(self)


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    starts_in_reasoning = True


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"


class ReasoningStream:
    """Text deltas in, (reasoning delta, content delta) out; a possible marker is held back until it is decided."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.text = ""  # everything fed so far
        self.state = "start"  # start (undecided), reasoning, content
        self.sent = 0  # characters of self.text already given out (or dropped: the markers)

    def feed(self, delta: str, finished: bool = False) -> tuple[str, str]:
        self.text += delta
        reasoning, content = "", ""
        if self.state == "start":
            body = self.text.lstrip()
            if body.startswith(THINK_START):
                self.state = "reasoning"
                self.sent = len(self.text) - len(body) + len(THINK_START)
            elif THINK_START.startswith(body) and not finished:
                return "", ""  # "", whitespace or a partial "<think>": undecided
            else:
                self.state = "reasoning" if self.parser.starts_in_reasoning else "content"
        if self.state == "reasoning":
            end = self.text.find(THINK_END, self.sent)
            if end < 0:
                hold = 0 if finished else _partial_suffix(self.text, THINK_END)
                reasoning = self.text[self.sent : len(self.text) - hold]
                self.sent = len(self.text) - hold
                return reasoning, ""
            reasoning = self.text[self.sent : end]
            self.sent = end + len(THINK_END)
            self.state = "content"
        content = self.text[self.sent :]
        self.sent = len(self.text)
        return reasoning, content


class HarmonyReasoningParser(ReasoningParser):
    name = "harmony"

    def extract(self, text: str) -> Reasoning:
        stream = self.streaming()
        reasoning, _ = stream.feed(text, finished=True)
        return Reasoning(reasoning if stream.thought else None, text or None)

    def streaming(self) -> HarmonyReasoningStream:
        return HarmonyReasoningStream(self)


class HarmonyReasoningStream(ReasoningStream):
    """Text deltas in; the analysis channel's text, and every delta as it came (for the harmony tool parser), out."""

    def __init__(self, parser: ReasoningParser) -> None:
        super().__init__(parser)
        self.reader = HarmonyReader()
        self.thought = False  # an analysis message began

    def feed(self, delta: str, finished: bool = False) -> tuple[str, str]:
        reasoning = []
        for piece in self.reader.feed(delta, finished):
            # A message to a function is a call, even on the analysis channel: the tool parser's.
            header = piece.header
            if header is not None and header.channel == "analysis" and not is_function(header.recipient):
                self.thought = True
                reasoning.append(piece.text)
        return "".join(reasoning), delta


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    DeepSeekR1ReasoningParser.name: DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser.name: Qwen3ReasoningParser,
    HarmonyReasoningParser.name: HarmonyReasoningParser,
    "openai_gptoss": HarmonyReasoningParser,  # vLLM's name for it
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {', '.join(sorted(REASONING_PARSERS))}")
    return REASONING_PARSERS[name]()
