"""The stop-string matcher against a plain reference, and its cost on the longest stop strings a request may send."""

from __future__ import annotations

import tracemalloc
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from lmserve.frontend.detokenizer import IncrementalDetokenizer
from lmserve.frontend.stop_strings import StopStringMatcher
from lmserve.sampling_params import MAX_STOP_CHARS

ALPHABET = "ab\u00e9"  # few letters, so that stops overlap and repeat themselves


def reference(text: str, stops: list[str]) -> tuple[int, str] | None:
    """(end of the first match, stop): the match that ends first; among those, the longest."""
    best = None
    for stop in set(stops):
        start = text.find(stop)
        if start >= 0 and (best is None or (start + len(stop), -len(stop)) < (best[0], -len(best[1]))):
            best = (start + len(stop), stop)
    return best


def reference_hold_back(text: str, stops: list[str]) -> int:
    return max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(st.text(ALPHABET, max_size=6), max_size=12),
    stops=st.lists(st.text(ALPHABET, min_size=1, max_size=5), min_size=1, max_size=4),
)
def test_streamed_matches_equal_the_reference(pieces: list[str], stops: list[str]) -> None:
    matcher = StopStringMatcher(stops)
    seen = ""
    for piece in pieces:
        found = matcher.feed(piece)
        expected = reference(seen + piece, stops)
        if found is not None:
            end, stop = found
            assert expected == (len(seen) + end, stop)
            return
        assert expected is None
        seen += piece
        assert matcher.hold_back() == reference_hold_back(seen, stops)


def test_longest_allowed_stop_costs_linear_memory(tokenizer: Any) -> None:
    """One stop of MAX_STOP_CHARS characters: O(length) state (the old hold-back kept every prefix of every stop,
    O(length²): ~8 MB here), and text that could still become the stop is held back until it diverges."""
    stop = "ab" * (MAX_STOP_CHARS // 2)
    tracemalloc.start()
    detok = IncrementalDetokenizer(tokenizer, [], [stop], include_stop_str_in_output=False)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 1 << 20, f"{peak} bytes for one stop string of {len(stop)} characters"
    assert not detok.update(tokenizer.encode("ab" * 300, add_special_tokens=False))
    assert detok.get_delta(finished=False) == ""  # all of it may still grow into the stop
    assert not detok.update(tokenizer.encode("c", add_special_tokens=False))
    assert detok.get_delta(finished=False) == "ab" * 300 + "c"
