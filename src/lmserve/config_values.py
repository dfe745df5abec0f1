"""Setting values as flags and keywords give them: sizes ('2GiB'), CPU lists ('0-3'), vLLM's JSON objects. Below
every config module (config.py, kv_transfer_config.py, speculative_config.py), importing none."""

from __future__ import annotations

import json
import os
import typing
from typing import Any

MiB = 1 << 20
GiB = 1 << 30
MAX_CPUS = 8192  # Linux's largest CONFIG_NR_CPUS: a CPU id is below it


def parse_memory(value: float | str | None) -> int | None:
    """Bytes from an int, a float meaning GiB, or a string such as '2GiB', '512MiB', '1e9'."""
    if value is None or isinstance(value, int):
        return value
    try:
        if isinstance(value, float):
            return int(value * GiB)
        text = value.strip().lower().replace(" ", "")
        for suffix, mult in (("gib", GiB), ("gb", 10**9), ("mib", 1 << 20), ("mb", 10**6), ("kib", 1024),
                             ("g", GiB)):
            if text.endswith(suffix):
                return int(float(text[: -len(suffix)]) * mult)
        number = float(text)
        # A bare small number is GiB (as in VLLM_CPU_KVCACHE_SPACE); a large one is bytes.
        return int(number * GiB) if number < 4096 else int(number)
    except (ValueError, OverflowError, AttributeError):  # not a number, inf, not text
        raise ValueError(f"bad memory size {value!r}: use e.g. 2GiB, 512MiB or a number of bytes") from None


def parse_cpus(value: str | None) -> list[int] | None:
    """CPU ids from a list such as '1', '0-3' or '0,2-3' (as taskset -c takes them)."""
    if value is None or value == "":
        return None
    cpus: set[int] = set()
    try:
        for part in value.split(","):
            first, dash, last = part.strip().partition("-")
            low, high = int(first), int(last if dash else first)
            if not 0 <= low <= high < MAX_CPUS:
                raise ValueError(value)
            cpus.update(range(low, high + 1))
    except ValueError:
        cpus = set()
    if not cpus:
        raise ValueError(f"bad CPU list {value!r}: use e.g. '1', '0-3' or '0,2' (CPU ids from 0 to {MAX_CPUS - 1})")
    return sorted(cpus)


def cpus_not_here(cpus: list[int] | None) -> str | None:
    """Why this process cannot run on `cpus` (some are not among the CPUs it may use), or None when it can."""
    if not cpus:
        return None
    here = os.sched_getaffinity(0)
    missing = [cpu for cpu in cpus if cpu not in here]
    if not missing:
        return None
    return (f"CPU(s) {', '.join(map(str, missing))} are not among this process's CPUs "
            f"({', '.join(map(str, sorted(here)))})")


class JsonConfig(typing.Protocol):
    """A setting given as vLLM's JSON (kv_transfer_config.py, speculative_config.py)."""

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> typing.Self: ...


ConfigType = typing.TypeVar("ConfigType", bound=JsonConfig)


def parse_json_config(value: Any, cls: type[ConfigType]) -> ConfigType | None:
    """A vLLM-style JSON setting (text from a flag, a dict from a keyword, or already the config) as `cls`."""
    if value is None or isinstance(value, cls):
        return value
    parsed = parse_json_object(value)
    return None if parsed is None else cls.from_json(parsed)


def parse_json_object(value: Any) -> dict[str, Any] | None:
    """A JSON object given as text (a flag) or as a dict (a keyword)."""
    if value is None or isinstance(value, dict):
        return value
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON: {value!r} ({exc})") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"expected a JSON object, got {value!r}")  # noqa: TRY004 - a bad flag value
    return parsed
