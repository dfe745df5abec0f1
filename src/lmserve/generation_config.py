"""A model's default sampling, as vLLM's `--generation-config` and `--override-generation-config` read it.

Model authors ship their recommended sampling in generation_config.json (Llama 3: temperature 0.6, top_p 0.9). vLLM
applies it to every request field the client left unset; so does lmserve, with the same keys. `vllm` ignores the file
(SamplingParams' own defaults: temperature 1, no top-p); a directory reads its generation_config.json instead. The
overrides go on top of either. Torch-free: the API process reads it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lmserve.models import ModelSource
from lmserve.sampling_params import SamplingParams

# generation_config.json key -> SamplingParams field (vLLM's list: do_sample and the rest are not read).
SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def default_sampling(
    source: ModelSource, generation_config: str = "auto", overrides: dict[str, Any] | None = None
) -> dict[str, Any]:
    """SamplingParams fields that requests get unless they set them. ValueError names a bad file or value."""
    if generation_config == "auto":
        file = source.path / "generation_config.json" if source.kind == "hf" else None
    elif generation_config == "vllm":
        file = None
    else:
        file = Path(generation_config) / "generation_config.json"
        if not file.is_file():
            raise ValueError(f"--generation-config {generation_config}: no generation_config.json there")
    settings = _read(file) if file is not None and file.is_file() else {}
    defaults = {field: settings[key] for key, field in SAMPLING_KEYS.items() if settings.get(key) is not None}
    for key, value in (overrides or {}).items():
        field = SAMPLING_KEYS.get(key, key)
        if field not in SamplingParams.__dataclass_fields__ or field == "n":
            raise ValueError(f"--override-generation-config: {key!r} is not a sampling parameter")
        defaults[field] = value
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"the model's default sampling is not valid: {exc}") from None
    return defaults


def _read(file: Path) -> dict[str, Any]:
    try:
        settings = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {file}: {exc}") from None
    if not isinstance(settings, dict):
        raise ValueError(f"{file} does not hold a JSON object")  # noqa: TRY004 - a bad file, reported as such
    return settings


def load_chat_template(value: str | None) -> str | None:
    """--chat-template: a file's text when the value names a file, else the value itself (an inline template)."""
    if value is None:
        return None
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text()
    except OSError:  # a long inline template is not a valid path on every system
        pass
    if "{" not in value:  # neither a file nor Jinja: most likely a mistyped path
        raise ValueError(f"--chat-template {value!r}: no such file, and not a Jinja template")
    return value
