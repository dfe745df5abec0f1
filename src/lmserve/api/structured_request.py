"""The request forms of structured output users send: OpenAI's `response_format`, vLLM's `structured_outputs` object,
and vLLM's older `guided_*` fields. All of them become one StructuredOutputsParams (or a 400 saying why not)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from lmserve.api.json_fields import JsonObject
from lmserve.sampling_params import MAX_GRAMMAR_CHARS, StructuredOutputsParams


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class JsonSchemaFormat(_Strict):
    name: str = Field(default="response", max_length=256)
    description: str | None = Field(default=None, max_length=4096)
    schema_: JsonObject | None = Field(default=None, alias="schema")
    strict: bool | None = None  # lmserve always follows the schema


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Strict):
    """vLLM's `structured_outputs`: one constraint, and options that shape the request's JSON constraint (this one,
    or response_format's). `disable_any_whitespace: false` lets the JSON have free whitespace (lmserve's default is
    compact JSON, which `true` or leaving it out keeps). The fallback knob is accepted (xgrammar is the only backend,
    so nothing falls back), and so is `disable_additional_properties` (xgrammar's strict mode already keeps objects
    to their schema's properties unless the schema allows more, as in vLLM's xgrammar backend)."""

    json_: JsonObject | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None
    disable_fallback: bool | None = None
    disable_additional_properties: bool | None = None

    @property
    def asks_for_a_constraint(self) -> bool:
        """False when only options are set (they then apply to response_format's constraint, as in vLLM)."""
        return any(value is not None for value in (self.json_, self.regex, self.choice, self.grammar)) \
            or bool(self.json_object)


def structured_outputs_of(
    response_format: ResponseFormat | None, structured: StructuredOutputsRequest | None, guided: dict[str, Any],
) -> StructuredOutputsParams | None:
    """The one constraint a request asks for; ValueError when it asks for more than one or for an impossible one."""
    asked: list[tuple[str, StructuredOutputsParams]] = []
    if response_format is not None and response_format.type != "text":
        if response_format.type == "json_object":
            asked.append(("response_format", StructuredOutputsParams(json_object=True)))
        else:
            if response_format.json_schema is None or response_format.json_schema.schema_ is None:
                raise ValueError("response_format json_schema needs json_schema.schema")
            asked.append(("response_format", StructuredOutputsParams(json=_schema_text(
                response_format.json_schema.schema_))))
    if structured is not None and structured.asks_for_a_constraint:
        value = structured.json_
        asked.append(("structured_outputs", StructuredOutputsParams(
            json=_schema_text(value) if isinstance(value, dict) else value, regex=structured.regex,
            choice=structured.choice, grammar=structured.grammar, json_object=structured.json_object,
        )))
    if guided:
        asked.append(("guided_*", StructuredOutputsParams(
            json=_schema_text(guided["guided_json"]) if isinstance(guided.get("guided_json"), dict)
            else guided.get("guided_json"),
            regex=guided.get("guided_regex"), choice=guided.get("guided_choice"), grammar=guided.get("guided_grammar"),
        )))
    if len(asked) > 1:
        raise ValueError(f"invalid sampling parameter structured_outputs: {' and '.join(n for n, _ in asked)} each "
                         "ask for a constraint; send one")
    if not asked:
        if structured is not None:  # options with nothing to shape
            raise ValueError("invalid sampling parameter structured_outputs: set exactly one of json, regex, "
                             "choice, grammar or json_object (or response_format), got only options")
        return None
    params = asked[0][1]
    if structured is not None and structured.disable_any_whitespace is False:
        params.json_whitespace = True
    return params


def _schema_text(schema: dict[str, Any]) -> str:
    text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
    if len(text) > MAX_GRAMMAR_CHARS:
        raise ValueError(f"invalid sampling parameter structured_outputs: the JSON schema is {len(text)} characters; "
                         f"at most {MAX_GRAMMAR_CHARS} are allowed")
    return text
