"""lmserve's harmony reader and renderer (src/lmserve/harmony.py) beside openai-harmony, OpenAI's reference library.

openai-harmony is not a dependency: it downloads its o200k tokenizer file on first use. It runs offline when
TIKTOKEN_ENCODINGS_BASE names a folder holding o200k_base.tiktoken, which `--write-encoding DIR RANKS_JS` writes from
the npm package js-tiktoken's dist/ranks/o200k_base.js (the same ranks; the file is checked against the sha256
openai-harmony checks it with). Then:

    pip install openai_harmony==0.0.8
    TIKTOKEN_ENCODINGS_BASE=DIR python benchmarks/harmony_reference.py

reads a set of model outputs token by token with both (each output's messages: channel, recipient, content type,
text; lmserve's reader gets each token's decoded text, as the server's detokenizer gives it) and renders one
conversation with both. lmserve renders as gpt-oss's chat template does (tests/api/test_harmony.py); where the
template and openai-harmony differ, the difference is printed.
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import sys
from pathlib import Path

from lmserve.harmony import HarmonyReader, render_harmony

O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"

OUTPUTS = [
    ("<|channel|>analysis<|message|>The user wants the weather.<|end|><|start|>assistant<|channel|>final<|message|>"
    "It is sunny.<|return|>"),
    ("<|channel|>analysis<|message|>Need the tool.<|end|><|start|>assistant to=functions.get_weather<|channel|>"
    'commentary <|constrain|>json<|message|>{"city":"Paris"}<|call|>'),
    '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Rome"}<|call|>',
    ("<|channel|>commentary<|message|>Let me check.<|end|><|start|>assistant to=functions.f<|channel|>commentary json"
    "<|message|>{}<|call|>"),
    "<|channel|>analysis to=python code<|message|>print(1)<|call|>",
    "<|channel|>final<|message|>Unicode é 日本 and <|< not a marker<|return|>",
]
WEATHER = {"name": "get_weather", "description": "Current weather in a city.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "description": "The city's name."}},
    "required": ["city"]}}


def write_encoding(directory: Path, ranks_js: Path) -> None:
    """o200k_base.tiktoken (`base64 rank` lines) from js-tiktoken's ranks: lines of `! OFFSET TOKEN TOKEN ...`."""
    source = ranks_js.read_text()
    ranks: dict[str, int] = {}
    for line in json.loads(source[source.index("{"):source.rindex("}") + 1])["bpe_ranks"].split("\n"):
        if line:
            _, offset, *tokens = line.split(" ")
            ranks.update((token, int(offset) + i) for i, token in enumerate(tokens))
    text = "".join(f"{token} {rank}\n" for token, rank in sorted(ranks.items(), key=lambda item: item[1]))
    if hashlib.sha256(text.encode()).hexdigest() != O200K_SHA256:
        sys.exit("the ranks do not give o200k_base.tiktoken (sha256 differs)")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "o200k_base.tiktoken").write_text(text)
    print(f"wrote {directory / 'o200k_base.tiktoken'} ({len(ranks)} ranks, sha256 checked)")


def compare() -> bool:
    import openai_harmony as oh

    encoding = oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)
    agree = True
    for text in OUTPUTS:
        tokens = encoding.encode(text, allowed_special="all")
        parser = oh.StreamableParser(encoding, role=oh.Role.ASSISTANT)
        for token in tokens:
            parser.process(token)
        theirs = [(m.channel, m.recipient, (m.content_type or "").replace("<|constrain|>", "") or None,
                   "".join(c.text for c in m.content)) for m in parser.messages]
        reader, ours = HarmonyReader(), {}
        for i, token in enumerate(tokens):
            for piece in reader.feed(encoding.decode([token]), finished=i == len(tokens) - 1):
                header = piece.header
                first = (header.channel, header.recipient, header.content_type, "") if header else (None,) * 3 + ("",)
                channel, recipient, content_type, body = ours.get(piece.message, first)
                ours[piece.message] = (channel, recipient, content_type, body + piece.text)
        same = list(ours.values()) == theirs
        agree &= same
        print("same     " if same else "DIFFERENT", repr(text[:70]))
        if not same:
            print("  lmserve       ", list(ours.values()), "\n  openai-harmony", theirs)

    conversation = oh.Conversation.from_messages([
        oh.Message.from_role_and_content(oh.Role.SYSTEM, oh.SystemContent.new().with_reasoning_effort(
            oh.ReasoningEffort.HIGH).with_conversation_start_date("2026-01-01")),
        oh.Message.from_role_and_content(oh.Role.DEVELOPER, oh.DeveloperContent.new().with_instructions(
            "Answer briefly.").with_function_tools([oh.ToolDescription.new(**WEATHER)])),
        oh.Message.from_role_and_content(oh.Role.USER, "Weather in Paris?"),
        oh.Message.from_role_and_content(oh.Role.ASSISTANT, "Need the tool.").with_channel("analysis"),
        oh.Message.from_role_and_content(oh.Role.ASSISTANT, '{"city": "Paris"}').with_channel("commentary")
        .with_recipient("functions.get_weather").with_content_type("<|constrain|>json"),
        oh.Message.from_author_and_content(oh.Author.new(oh.Role.TOOL, "functions.get_weather"), '{"sky": "clear"}')
        .with_channel("commentary").with_recipient("assistant"),
    ])
    theirs = encoding.decode(encoding.render_conversation_for_completion(conversation, oh.Role.ASSISTANT))
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    ours = render_harmony([
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": "Need the tool.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'},
    ], tools=[{"type": "function", "function": WEATHER}], reasoning_effort="high", today="2026-01-01")
    print("rendering: same" if ours == theirs else "rendering: gpt-oss's template (lmserve) and openai-harmony differ:")
    for line in difflib.unified_diff(theirs.replace("<|", "\n<|").splitlines(), ours.replace("<|", "\n<|").splitlines(),
                                     "openai-harmony", "lmserve", lineterm="", n=0):
        print("  " + line)
    return agree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write-encoding", nargs=2, metavar=("DIR", "RANKS_JS"), type=Path)
    args = parser.parse_args()
    if args.write_encoding:
        write_encoding(*args.write_encoding)
        return
    sys.exit(0 if compare() else 1)


if __name__ == "__main__":
    main()
