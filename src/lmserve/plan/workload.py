"""The workloads the schedule explainer replays: requests as `name:prompt_len:output_len[@arrival_iteration]`, on the
command line or in a JSON file."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

_REQUEST = re.compile(r"(?P<name>[^:@\s]+):(?P<prompt>\d+):(?P<output>\d+)(?:@(?P<arrival>\d+))?")
REQUEST_SYNTAX = "name:prompt_len:output_len[@arrival_iteration], e.g. p:10:3@2"


@dataclass(frozen=True)
class RequestSpec:
    name: str
    prompt_len: int
    output_len: int
    arrival: int = 1

    def __post_init__(self) -> None:
        if self.prompt_len < 1 or self.output_len < 1:
            raise ValueError(f"request {self.name!r}: prompt_len and output_len must be >= 1")
        if self.arrival < 1:
            raise ValueError(f"request {self.name!r}: iterations are numbered from 1, got arrival {self.arrival}")


def parse_request(text: str) -> RequestSpec:
    match = _REQUEST.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"malformed request {text!r}: expected {REQUEST_SYNTAX}")
    return RequestSpec(
        match["name"], int(match["prompt"]), int(match["output"]), int(match["arrival"] or 1)
    )


def load_requests(path: str | Path) -> list[RequestSpec]:
    """A JSON list (or {"requests": [...]}) of objects {name, prompt_len, output_len, arrival?} or request strings."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    match data:
        case {"requests": list() as items} | (list() as items):
            pass
        case _:
            raise ValueError(f"{path}: expected a list of requests or {{\"requests\": [...]}}")
    specs = []
    for item in items:
        if isinstance(item, str):
            specs.append(parse_request(item))
        elif isinstance(item, dict) and {"name", "prompt_len", "output_len"} <= item.keys():
            specs.append(RequestSpec(
                str(item["name"]), int(item["prompt_len"]), int(item["output_len"]), int(item.get("arrival", 1))
            ))
        else:
            raise ValueError(f"{path}: bad request {item!r}: expected {{name, prompt_len, output_len, arrival?}}")
    return specs
