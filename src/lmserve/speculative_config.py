"""vLLM's --speculative-config: which drafts a step verifies (the lmserve.spec_decode package)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lmserve.config_values import parse_json_config

# Bounds of --speculative-config: drafts a step verifies per request, and the n-gram lengths looked up.
MAX_SPECULATIVE_TOKENS = 16
MAX_PROMPT_LOOKUP = 64
SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's --speculative-config. method ngram (prompt lookup): the tokens that followed the latest earlier
    occurrence of the sequence's last n tokens (n from prompt_lookup_max down to prompt_lookup_min) are proposed as
    the next num_speculative_tokens, and one forward pass verifies them. method draft_model (implied by `model`): a
    smaller model of the same vocabulary guesses them (spec_decode/draft_model.py)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 0
    prompt_lookup_max: int = 0
    model: str | None = None

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> SpeculativeConfig:
        """vLLM's keys and defaults (both lookup bounds 5 when neither is given, one from the other otherwise)."""
        known = {"method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        model = value.get("model")
        method = value.get("method") or ("draft_model" if model else None)
        if method in ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp"):
            raise ValueError(f"speculative_config: method {method} is not supported; use ngram or a draft model")
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config: unknown method {method!r}; use one of {', '.join(SPECULATIVE_METHODS)}")
        k = value.get("num_speculative_tokens")
        if method == "draft_model":
            if not isinstance(model, str) or not model:
                raise ValueError("speculative_config: method draft_model needs \"model\": the draft's path")
            if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
                raise ValueError(f"speculative_config: num_speculative_tokens must be an integer in "
                                 f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
            return cls(method, k, model=model)
        if model is not None:
            raise ValueError("speculative_config: method ngram takes no model")
        low, high = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        if low is None and high is None:
            low = high = 5
        low = high if low is None else low
        high = low if high is None else high
        for name, number, top in (("num_speculative_tokens", k, MAX_SPECULATIVE_TOKENS),
                                  ("prompt_lookup_min", low, MAX_PROMPT_LOOKUP),
                                  ("prompt_lookup_max", high, MAX_PROMPT_LOOKUP)):
            if isinstance(number, bool) or not isinstance(number, int) or not 1 <= number <= top:
                raise ValueError(f"speculative_config: {name} must be an integer in [1, {top}], got {number!r}")
        if low > high:
            raise ValueError(f"speculative_config: prompt_lookup_min ({low}) > prompt_lookup_max ({high})")
        return cls(method, k, low, high)


def parse_speculative_config(value: Any) -> SpeculativeConfig | None:
    return parse_json_config(value, SpeculativeConfig)
