"""Request fields that take any JSON (schemas, template variables, Responses items): bounded in depth, so that no
walker of them (json, copy.deepcopy, a chat template's tojson, the grammar compiler) meets a value nested thousands
deep (lmserve.json_limits)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator

from lmserve.json_limits import MAX_JSON_DEPTH, check_json_depth


def bounded_depth(value: Any) -> Any:
    return check_json_depth(value, "the value", MAX_JSON_DEPTH)


JsonObject = Annotated[dict[str, Any], AfterValidator(bounded_depth)]
JsonValue = Annotated[Any, AfterValidator(bounded_depth)]
