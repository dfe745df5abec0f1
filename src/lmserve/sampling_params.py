"""Per-request sampling and stopping parameters (vLLM's names, so users' code ports)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

# Temperatures at or below this are treated as greedy (argmax), as in vLLM.
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20

# Bounds on what one request may ask for, checked before anything is allocated for it (docs/limits.md lists them
# with the server's own limits). Above these, work or memory would grow with a client's whim, not with the model.
MAX_TEMPERATURE = 100.0
MAX_PENALTY = 2.0  # presence and frequency penalties, OpenAI's range [-2, 2]
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 4096  # all stop strings together
MAX_TOKEN_ID_ENTRIES = 2048  # logit_bias entries, stop_token_ids, allowed_token_ids: each at most this many
MAX_LOGIT_BIAS = 100.0
MAX_COUNT = 2**31 - 1  # n, max_tokens, min_tokens, top_k: the front-end then bounds them by the model and server
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes
# n_indent counts columns of indentation: no code is indented a thousand columns, so more is a client's mistake.
MAX_INDENT = 1024


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# A grammar is a few KiB in practice; these bound what one request may make the grammar compiler chew on.
MAX_GRAMMAR_CHARS = 64 * 1024  # a JSON schema (as text), a regex or an EBNF grammar
MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 64 * 1024  # all choices together


@dataclass
class StructuredOutputsParams:
    """vLLM's `structured_outputs`: exactly one constraint on what the request may generate."""

    json: str | dict | None = None  # a JSON schema (as a dict or as its text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (xgrammar's dialect, GBNF-like)
    json_object: bool | None = None  # any JSON object
    # The grammar starts after this token (a reasoning model's end of thinking, `</think>`): the thinking before it
    # is free, the answer after it constrained. Set by the server under --reasoning-parser, not by clients.
    after_token_id: int | None = None
    # Free whitespace between a JSON answer's tokens (vLLM's `disable_any_whitespace: false`). Off by default: the
    # answer is compact JSON, and a small model cannot wander into an endless run of spaces or newlines.
    json_whitespace: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            self.json = json.dumps(self.json, ensure_ascii=False)  # key order kept: it is the generation order
        if not isinstance(self.json_whitespace, bool):
            raise ValueError("invalid sampling parameter structured_outputs.json_whitespace: must be a boolean")  # noqa: TRY004 - a 400, as every bad parameter
        set_fields = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        set_fields += ["json_object"] if self.json_object else []
        if len(set_fields) != 1:
            raise ValueError("invalid sampling parameter structured_outputs: set exactly one of json, regex, choice, "
                             f"grammar or json_object (got {', '.join(set_fields) or 'none'})")
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value or len(value) > MAX_GRAMMAR_CHARS):
                raise ValueError(f"invalid sampling parameter structured_outputs.{name}: must be a non-empty string "
                                 f"of at most {MAX_GRAMMAR_CHARS} characters")
        if self.choice is not None and (
            not isinstance(self.choice, list) or not self.choice or len(self.choice) > MAX_CHOICES
            or any(not isinstance(c, str) or not c for c in self.choice) or sum(map(len, self.choice)) > MAX_CHOICE_CHARS
        ):
            raise ValueError(f"invalid sampling parameter structured_outputs.choice: 1 to {MAX_CHOICES} non-empty "
                             f"strings, at most {MAX_CHOICE_CHARS} characters together")

    @property
    def kind(self) -> str:
        return next(name for name in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, name))

    @property
    def key(self) -> tuple[str, str, bool]:
        """What identifies the compiled grammar (the cache key): kind, text, and free JSON whitespace."""
        kind = self.kind
        value = getattr(self, kind)
        text = "\x00".join(value) if kind == "choice" else ("" if kind == "json_object" else str(value))
        return kind, text, self.json_whitespace and kind in ("json", "json_object")


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k: the sampled token plus the top k
    # vLLM's: None, or k: each prompt token's logprob (given the tokens before it) plus the top k at its position.
    # The request then skips the prefix cache, since a cached position is never computed.
    prompt_logprobs: int | None = None
    # Constrained decoding (xgrammar): the output follows this JSON schema, regex, choice list or grammar.
    structured_outputs: StructuredOutputsParams | None = None
    skip_special_tokens: bool = True
    # vLLM's: keep only the prompt's last k tokens (-1: the last max_model_len), cut after tokenization.
    truncate_prompt_tokens: int | None = None
    # llama.cpp's (code completion): after the first newline, the first line indented less than this many spaces and
    # tabs ends the text, cut at its first other character; 0: off. The front-end applies it, as stop strings.
    n_indent: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        """Every field's type and range; raises ValueError naming the field ("parameter NAME=...")."""

        def bad(name: str, why: str) -> None:
            value = repr(getattr(self, name))
            if len(value) > 80:
                value = value[:77] + "..."
            raise ValueError(f"invalid sampling parameter {name}={value}: {why}")

        def check_int(name: str, low: int, high: int) -> None:
            value = getattr(self, name)
            if not _is_int(value) or not low <= value <= high:
                bad(name, f"must be an integer in [{low}, {high}]")

        def check_number(name: str, low: float, high: float, low_open: bool = False) -> None:
            value = getattr(self, name)
            if not _is_number(value) or not (low < value if low_open else low <= value) or value > high:
                where = f"{'(' if low_open else '['}{low}, {high}]" if high < math.inf else f"> {low}"
                bad(name, f"must be a finite number {'in ' if high < math.inf else ''}{where}")

        check_int("n", 1, MAX_COUNT)
        if self.max_tokens is not None:
            check_int("max_tokens", 1, MAX_COUNT)
        check_int("min_tokens", 0, MAX_COUNT)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must not exceed max_tokens={self.max_tokens}")
        check_number("temperature", 0.0, MAX_TEMPERATURE)
        check_number("top_p", 0.0, 1.0, low_open=True)
        if not _is_int(self.top_k) or not 0 <= self.top_k <= MAX_COUNT:
            bad("top_k", f"must be -1, 0 (disabled) or a positive integer up to {MAX_COUNT}")
        check_number("min_p", 0.0, 1.0)
        check_number("presence_penalty", -MAX_PENALTY, MAX_PENALTY)
        check_number("frequency_penalty", -MAX_PENALTY, MAX_PENALTY)
        check_number("repetition_penalty", 0.0, math.inf, low_open=True)  # as vLLM: any finite value > 0
        if self.seed is not None:
            check_int("seed", *SEED_RANGE)
        if self.logprobs is not None:
            check_int("logprobs", 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            check_int("prompt_logprobs", 0, MAX_LOGPROBS)
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens != -1:
            check_int("truncate_prompt_tokens", 1, MAX_COUNT)
        check_int("n_indent", 0, MAX_INDENT)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            bad("structured_outputs", "must be a StructuredOutputsParams")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be true or false")
        if len(self.stop) > MAX_STOP_STRINGS:
            bad("stop", f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "stop strings must be non-empty strings")
        if sum(len(s) for s in self.stop) > MAX_STOP_CHARS:
            bad("stop", f"the stop strings together must be at most {MAX_STOP_CHARS} characters")
        self._check_token_ids("stop_token_ids", self.stop_token_ids)
        if self.allowed_token_ids is not None:
            self._check_token_ids("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                bad("allowed_token_ids", "must not be empty")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                bad("logit_bias", "must map token ids to biases")
            self._check_token_ids("logit_bias", list(self.logit_bias))
            if not all(_is_number(v) and abs(v) <= MAX_LOGIT_BIAS for v in self.logit_bias.values()):
                bad("logit_bias", f"biases must be finite numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")

    def _check_token_ids(self, name: str, token_ids: list[int]) -> None:
        """Count and sign here; the front-end checks the upper end against the model's vocabulary."""
        if len(token_ids) > MAX_TOKEN_ID_ENTRIES:
            raise ValueError(f"invalid sampling parameter {name}=<{len(token_ids)} entries>: at most "
                             f"{MAX_TOKEN_ID_ENTRIES} token ids")
        bad = next((t for t in token_ids if not _is_int(t) or t < 0), None)
        if bad is not None:
            raise ValueError(f"invalid sampling parameter {name}={bad!r}: token ids must be integers >= 0")

    def token_ids_used(self) -> dict[str, list[int]]:
        """The token ids this request names, by field, for the front-end's vocabulary check."""
        return {
            "stop_token_ids": self.stop_token_ids,
            "allowed_token_ids": self.allowed_token_ids or [],
            "logit_bias": list(self.logit_bias or ()),
            "structured_outputs": [t for t in [getattr(self.structured_outputs, "after_token_id", None)]
                                   if t is not None],
        }

    @property
    def greedy(self) -> bool:
        return self.temperature <= GREEDY_TEMPERATURE
