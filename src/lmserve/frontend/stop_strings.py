"""Finding stop strings in streamed text in time linear in the text, whatever the stop strings are; and
llama.cpp's other text stop for code, `n_indent` (IndentationLimit).

One Knuth–Morris–Pratt automaton per stop string: its state is the longest suffix of the text so far that is a
prefix of the stop string. A state equal to the stop's length is a match; the largest state below it is how many
characters at the end of the text could still grow into a stop (the hold-back). Memory is linear in the stop strings'
length, and each new character costs amortised O(1) per stop string.
"""

from __future__ import annotations

from collections.abc import Sequence


def _failure(pattern: str) -> list[int]:
    """failure[i]: length of the longest proper prefix of pattern[:i + 1] that is also its suffix."""
    failure = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = failure[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        failure[i] = k
    return failure


class StopStringMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in dict.fromkeys(stops) if s]
        self._failures = [_failure(s) for s in self.stops]
        self._states = [0] * len(self.stops)

    def feed(self, text: str, report: bool = True) -> tuple[int, str] | None:
        """Consumes `text`; with `report`, stops at the first match and returns (characters of `text` up to and
        including the match's end, stop string). Among stops ending at the same character the longest wins (it
        starts first). Without `report`, matches are passed over (min_tokens not reached yet)."""
        stops, failures, states = self.stops, self._failures, self._states
        for end, char in enumerate(text, 1):
            found: str | None = None
            for k, stop in enumerate(stops):
                state = states[k]
                while state and stop[state] != char:
                    state = failures[k][state - 1]
                if stop[state] == char:
                    state += 1
                if state == len(stop):
                    if report and (found is None or len(stop) > len(found)):
                        found = stop
                    state = failures[k][state - 1]
                states[k] = state
            if found is not None:
                return end, found
        return None

    def hold_back(self) -> int:
        """Characters at the end of the text fed so far that are a proper prefix of some stop string."""
        return max(self._states, default=0)


class IndentationLimit:
    """llama.cpp's `n_indent` (tools/server/server-context.cpp, process_token): once a newline has been generated,
    the first line whose indentation (spaces and tabs) is less than `n_indent` ends the text, cut at that line's
    first other character. As llama.cpp, the newline and the line's blanks are kept, an empty line counts as
    indented 0 (its first other character is the newline, or the `\r` of a CRLF), the first line (the rest of the
    cursor's line) is never checked, and 0 turns the rule off.

    Unlike llama.cpp, every line is checked as its first other character arrives: llama.cpp looks at one line per
    sampled token (the first a token late), so lines that come several to a token wait their turn and the last ones
    go unchecked when generation ends first. And since what precedes the cut is kept whatever comes next, no text
    needs holding back for this rule (llama.cpp's stream sends the cut line's first token before it cuts)."""

    BLANKS = " \t"

    def __init__(self, n_indent: int) -> None:
        self.n_indent = n_indent
        # Blanks so far at the start of the current line; None once its first other character has come (and on the
        # first line, which is never checked).
        self._indent: int | None = None

    def feed(self, text: str, report: bool = True) -> int | None:
        """Consumes `text`; with `report`, returns the index in `text` of the first character of the first line
        indented less than n_indent (the text ends before it). Without `report` such lines are passed over
        (min_tokens not reached yet)."""
        if self.n_indent <= 0:
            return None
        index = 0
        while index < len(text):
            if self._indent is None:  # the rest of the line does not matter: on to the next one
                newline = text.find("\n", index)
                if newline < 0:
                    return None
                self._indent, index = 0, newline + 1
            elif text[index] in self.BLANKS:
                self._indent += 1
                index += 1
            else:  # the line's first other character (a newline itself for an empty line: it is looked at again)
                under, self._indent = self._indent < self.n_indent, None
                if under and report:
                    return index
        return None
