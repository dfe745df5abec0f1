"""Incremental detokenization with stop-string handling for streamed outputs.

Text is produced token by token with the prefix/read offset method (as in vLLM's and HF TGI's
``detokenize_incrementally``): the tokens after ``read_offset`` are decoded together with a few tokens
before them (from ``prefix_offset``), and the new text is the difference to the decoding without the new
tokens. Decoding a small window keeps the cost per token constant, and decoding *with* context keeps
tokenizers whose decoding depends on neighbours (SentencePiece's leading space, byte-level BPE characters
split over tokens) correct.

Stop strings: generation stops at the first stop string to *appear* in the text (the occurrence that
ends first; among those ending at the same character, the one starting first). That is the only rule
that does not depend on how the text happened to be split into tokens. llama.cpp's `n_indent` (code
completion) is checked on the same text, character by character: whichever of the two comes first ends it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tokenizers

from lmserve.frontend.stop_strings import IndentationLimit, StopStringMatcher

_REPLACEMENT_CHAR = "\ufffd"

# Prompt tokens decoded ahead of the first output token, so that it is decoded in context
# (e.g. SentencePiece drops the leading space of the first token of a decoded sequence).
_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas that are safe to send.

    Call ``update`` with each batch of new token ids, then ``get_delta(finished=...)`` for the text that
    may be sent now. Call ``get_delta(finished=True)`` exactly once when the request ends (stop string,
    EOS, length, abort): it flushes text held back for a partial character or a possible stop string.
    The deltas concatenate to ``output_text``. ``n_indent`` > 0: llama.cpp's indentation stop (IndentationLimit).
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str],
        include_stop_str_in_output: bool,
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
        n_indent: int = 0,
    ) -> None:
        self._decode_ids = _make_decoder(tokenizer, skip_special_tokens)
        self._stops = StopStringMatcher(stop)
        self._include_stop = include_stop_str_in_output
        # As vLLM: a stop string counts only in the text of output tokens after the first min_tokens.
        self._min_tokens = min_tokens
        self._indentation = IndentationLimit(n_indent) if n_indent > 0 else None

        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        if context and self._decode_ids(context).endswith(_REPLACEMENT_CHAR):
            # The prompt ends inside a character: its bytes would leak into the first output text.
            context = []
        # Only the decode window is kept, so memory and slicing stay O(1) per token.
        self._window: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        # Characters of the window's new text already emitted while waiting for a partial character.
        self._num_emitted = 0

        self._num_output_tokens = 0
        self._pending = ""  # decoded, but its tail could still become a stop string
        self._sent: list[str] = []  # text already returned by get_delta
        self._unsent: list[str] = []  # text released from hold-back, not yet returned
        self._stop_string: str | None = None
        self._indent_stop = False
        self._finished = False

    @property
    def output_text(self) -> str:
        """All text released so far; after ``get_delta(finished=True)`` it is the final text."""
        text = "".join(self._sent)
        self._sent = [text] if text else []
        return text + "".join(self._unsent)

    @property
    def num_output_tokens_used(self) -> int:
        """Output tokens kept: tokens after the one that completed a stop string are dropped."""
        return self._num_output_tokens

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the output, if any."""
        return self._stop_string

    @property
    def stopped_by_indent(self) -> bool:
        """Whether a line indented less than n_indent ended the output."""
        return self._indent_stop

    @property
    def stopped(self) -> bool:
        """Whether the text itself ended the output (a stop string or n_indent), not the engine."""
        return self._stop_string is not None or self._indent_stop

    def update(self, new_token_ids: Sequence[int]) -> bool:
        """Consumes new tokens; returns whether a stop string or n_indent ended the text (later tokens are
        ignored; ``stop_string`` and ``stopped_by_indent`` say which)."""
        if self.stopped or self._finished:
            return False
        for token_id in new_token_ids:
            self._num_output_tokens += 1
            self._window.append(token_id)
            text = self._decode_new(final=False)
            # Checked per token so that tokens after the stop are not counted as used.
            if text and self._add_text(text):
                return True
        return False

    def get_delta(self, finished: bool) -> str:
        """Returns the text that may be sent now; with ``finished`` also everything still held back."""
        if finished and not self._finished:
            self._finished = True
            if not self.stopped:
                # A partial character at the very end is emitted as U+FFFD, as a full decode would.
                text = self._decode_new(final=True)
                if text:
                    self._add_text(text)
                self._release(len(self._pending))
        delta = "".join(self._unsent)
        self._unsent.clear()
        if delta:
            self._sent.append(delta)
        return delta

    def _decode_new(self, final: bool) -> str:
        """Returns the text added by the tokens after ``read_offset`` that is complete by now."""
        if self._read_offset == len(self._window):
            return ""
        prefix_text = self._decode_ids(self._window[self._prefix_offset : self._read_offset])
        full_text = self._decode_ids(self._window[self._prefix_offset :])
        start = len(prefix_text) + self._num_emitted
        if not final and full_text.endswith(_REPLACEMENT_CHAR):
            # Most likely a multi-byte character split over tokens: keep the window until its last
            # byte arrives, but emit the text before it now (later bytes cannot change that text).
            stable = full_text.rstrip(_REPLACEMENT_CHAR)
            new_text = stable[start:] if len(stable) > start else ""
            self._num_emitted += len(new_text)
            return new_text
        new_text = full_text[start:] if len(full_text) > start else ""
        if not new_text and not final:
            # Nothing visible yet (e.g. a skipped special token): keep it as context for the next one.
            return new_text
        # The new tokens become the context for the next ones; older tokens are no longer needed.
        del self._window[: self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._window)
        self._num_emitted = 0
        return new_text

    def _add_text(self, text: str) -> bool:
        """Appends decoded text, checks for stop strings and n_indent, releases what cannot become a stop string;
        returns whether the text has ended."""
        report = self._num_output_tokens > self._min_tokens
        cut = self._indentation.feed(text, report) if self._indentation is not None else None
        if cut is not None:
            text = text[:cut]  # a stop string that ends before the cut still ends the text first
        old_len = len(self._pending)
        buf = self._pending + text
        match = self._stops.feed(text, report) if self._stops.stops else None
        if match is not None:
            end, stop = match
            self._stop_string = stop
            end += old_len  # in buf
            self._pending = buf[: end if self._include_stop else end - len(stop)]
            self._release(len(self._pending))
            return True
        self._pending = buf
        if cut is not None:
            self._indent_stop = True
            self._release(len(buf))  # the text ends here: nothing can become a stop string any more
            return True
        self._release(len(buf) - self._stops.hold_back())
        return False

    def _release(self, n: int) -> None:
        """Moves the first ``n`` characters of the pending text to the sendable text."""
        if n > 0:
            self._unsent.append(self._pending[:n])
            self._pending = self._pending[n:]


def _make_decoder(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """Returns ``ids -> text`` decoding without clean-up, whose edits depend on neighbouring text."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None and isinstance(tokenizer, tokenizers.Tokenizer):
        backend = tokenizer
    if isinstance(backend, tokenizers.Tokenizer):
        # The Rust tokenizer directly: transformers' decode adds per-call overhead on the hot path.
        def decode(ids: list[int]) -> str:
            return backend.decode(ids, skip_special_tokens=skip_special_tokens)
    else:

        def decode(ids: list[int]) -> str:
            return tokenizer.decode(
                ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
            )

    return decode
