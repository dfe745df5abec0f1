"""llama.cpp's `n_indent` (IndentationLimit): against a literal port of llama.cpp's loop, and through the incremental
detokenizer and the output processor as a request's text arrives token by token."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmserve.engine.outputs import EngineCoreOutput
from lmserve.frontend.detokenizer import IncrementalDetokenizer
from lmserve.frontend.output_processor import OutputProcessor
from lmserve.frontend.stop_strings import IndentationLimit
from lmserve.sampling_params import MAX_INDENT, SamplingParams


def llama_cpp_n_indent(tokens: list[str], n_indent: int) -> str:
    """llama.cpp's server-context.cpp process_token, the n_indent part, line for line: the text it keeps."""
    generated, last_nl_pos, has_new_line = "", 0, False
    for token in tokens:
        generated += token
        if has_new_line and n_indent > 0:
            if last_nl_pos > 0:
                pos, indent = last_nl_pos, 0
                while pos < len(generated) and generated[pos] in " \t":
                    indent, pos = indent + 1, pos + 1
                if pos < len(generated) and indent < n_indent:
                    return generated[:pos]  # "cut the last line"
            newline = generated.find("\n", last_nl_pos)
            if newline >= 0:
                last_nl_pos = newline + 1
        if "\n" in token:
            has_new_line = True
    return generated


def cut_streamed(pieces: list[str], n_indent: int) -> str:
    limit, kept = IndentationLimit(n_indent), ""
    for piece in pieces:
        cut = limit.feed(piece)
        if cut is not None:
            return kept + piece[:cut]
        kept += piece
    return kept


@settings(max_examples=400, deadline=None)
@given(text=st.text(" \t\n\rab", max_size=40), n_indent=st.integers(0, 4), data=st.data())
def test_the_cut_is_llama_cpps_however_the_text_is_split(text: str, n_indent: int, data: st.DataObject) -> None:
    """One character per token (then two tokens without text, as an end of generation), llama.cpp's loop keeps
    exactly what IndentationLimit keeps fed in any pieces. (With longer tokens llama.cpp checks one line per token
    and can leave the last lines unchecked: IndentationLimit looks at every line.)"""
    expected = llama_cpp_n_indent([*text, "", ""], n_indent)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assert cut_streamed(pieces, n_indent) == expected


@pytest.mark.parametrize(("text", "n_indent", "kept"), [
    # the first line (the rest of the cursor's line) is never checked, however little it is indented
    ("x = 1\n    y = 2\nz = 3\n", 4, "x = 1\n    y = 2\n"),
    # the under-indented line's blanks are kept, as llama.cpp keeps them; the cut is at its first other character
    ("    a\n  b\n    c\n", 4, "    a\n  "),
    # tabs count one each
    ("\tif x:\n\t\treturn 1\n\telse:\n\t\treturn 2\n", 2, "\tif x:\n\t\treturn 1\n\t"),
    # an empty line is indented 0 (llama.cpp: its first other character is the newline); with CRLF, the \r
    ("    a\r\n    b\r\n\r\n    c\r\n", 4, "    a\r\n    b\r\n"),
    ("    a\n\n    c\n", 4, "    a\n"),
    ("    a\n        \n    c\n", 4, "    a\n        \n    c\n"),  # blanks enough: a line like any other
    # 0 turns the rule off
    ("    a\nb\n", 0, "    a\nb\n"),
    # nothing after the newline yet but blanks: no decision
    ("    a\n   ", 4, "    a\n   "),
])
def test_the_rule(text: str, n_indent: int, kept: str) -> None:
    assert cut_streamed([text], n_indent) == kept
    assert cut_streamed(list(text), n_indent) == kept
    assert llama_cpp_n_indent([*text, "", ""], n_indent) == kept


def detokenizer(tokenizer: Any, n_indent: int, stop: tuple[str, ...] = (), min_tokens: int = 0) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tokenizer, [], list(stop), include_stop_str_in_output=False, min_tokens=min_tokens,
                                  n_indent=n_indent)


def encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_a_line_split_over_tokens_is_cut_where_its_text_starts(tokenizer: Any) -> None:
    """SmolLM2's tokens put a newline with the next line's first blanks ("\\n "), and the last blank with the word
    (" return"): the cut falls inside a token; that token is the last one used, the ones after it are not."""
    text = "total = 0\n    for v in values:\n        total += v\n  return total\nprint(total)\n"
    ids = encode(tokenizer, text)
    pieces = [tokenizer.decode([i]) for i in ids]
    assert "\n " in pieces and " return" in pieces  # the split this test is about
    detok = detokenizer(tokenizer, n_indent=4)
    deltas = []
    for used, token_id in enumerate(ids, 1):
        stopped = detok.update([token_id])
        deltas.append(detok.get_delta(finished=stopped))
        if stopped:
            break
    expected = "total = 0\n    for v in values:\n        total += v\n  "
    assert (detok.stopped, detok.stopped_by_indent, detok.stop_string) == (True, True, None)
    assert "".join(deltas) == detok.output_text == expected
    assert pieces[used - 1] == " return" and detok.num_output_tokens_used == used
    assert not detok.update(encode(tokenizer, "more"))  # ignored once stopped
    assert detok.get_delta(finished=True) == ""


def test_the_line_start_is_not_held_back(tokenizer: Any) -> None:
    """What precedes the cut is kept whatever comes next, so a newline and blanks go out at once."""
    detok = detokenizer(tokenizer, n_indent=8)
    assert not detok.update(encode(tokenizer, "a = 1\n   "))
    assert detok.get_delta(finished=False) == "a = 1\n   "
    assert detok.update(encode(tokenizer, " b"))
    assert detok.get_delta(finished=True) == " "


def test_a_stop_string_before_the_cut_wins_and_after_it_loses(tokenizer: Any) -> None:
    detok = detokenizer(tokenizer, n_indent=4, stop=("STOP",))
    detok.update(encode(tokenizer, "    a STOP\nb"))
    assert (detok.stop_string, detok.stopped_by_indent, detok.get_delta(finished=True)) == ("STOP", False, "    a ")
    detok = detokenizer(tokenizer, n_indent=4, stop=("STOP",))
    detok.update(encode(tokenizer, "    a\nb STOP"))
    assert (detok.stop_string, detok.stopped_by_indent, detok.get_delta(finished=True)) == (None, True, "    a\n")
    # a partial stop string held back is let go at the cut: the text ends there
    detok = detokenizer(tokenizer, n_indent=4, stop=("a\nSTOP",))
    detok.update(encode(tokenizer, "    a\nb"))
    assert detok.stopped_by_indent and detok.get_delta(finished=True) == "    a\n"


def test_min_tokens_passes_over_lines_as_it_passes_over_stop_strings(tokenizer: Any) -> None:
    ids = encode(tokenizer, "    a\nb\n    c\nd")
    detok = detokenizer(tokenizer, n_indent=4, min_tokens=len(encode(tokenizer, "    a\nb")))
    for token_id in ids:
        if detok.update([token_id]):
            break
    assert detok.stopped_by_indent and detok.get_delta(finished=True) == "    a\nb\n    c\n"


def test_the_output_processor_finishes_the_request_with_stop_and_aborts_it_in_the_engine(tokenizer: Any) -> None:
    processor = OutputProcessor(tokenizer)
    (child,) = processor.add_request("r", None, [1], [SamplingParams(max_tokens=100, n_indent=4)])
    ids = encode(tokenizer, "    a = 1\nb = 2\n    c = 3\n")
    first = processor.process_outputs([EngineCoreOutput(child, ids[:2])])
    assert first.requests_to_abort == [] and not first.deltas[0].outputs[0].finish_reason
    rest = processor.process_outputs([EngineCoreOutput(child, ids[2:])])
    (out,) = rest.deltas[0].outputs
    assert rest.requests_to_abort == [child]  # the engine would go on computing it otherwise
    assert (out.finish_reason, out.stop_reason, out.indent_stop) == ("stop", None, True)
    full = processor.get_parent("r").full_output().outputs[0]
    assert full.text == "    a = 1\n" and full.token_ids == ids[:len(encode(tokenizer, "    a = 1\nb"))]
    # a stop string is no n_indent stop
    (child,) = processor.add_request("s", None, [1], [SamplingParams(max_tokens=100, stop=["b"])])
    (out,) = processor.process_outputs([EngineCoreOutput(child, ids)]).deltas[0].outputs
    assert (out.finish_reason, out.stop_reason, out.indent_stop) == ("stop", "b", False)


@pytest.mark.parametrize("n_indent", [-1, MAX_INDENT + 1, True, 2.0])
def test_n_indent_is_bounded(n_indent: Any) -> None:
    with pytest.raises(ValueError, match="n_indent"):
        SamplingParams(n_indent=n_indent)
