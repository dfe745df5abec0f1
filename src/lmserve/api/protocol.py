"""OpenAI request and response schemas (pydantic v2), and their translation to lmserve's SamplingParams.

Requests ignore unknown fields (OpenAI clients send fields we do not implement) but reject fields of the wrong
type: they are parsed strictly from the JSON text (no "10" or true for a number, no NaN or Infinity, no lone
surrogates). Optional fields are `X | None = None` because clients send explicit nulls to mean "the default".
Ranges are SamplingParams' (lmserve.sampling_params) and the front-end's, so the offline LLM gets the same checks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_serializer,
    model_validator,
)

from lmserve.api.json_fields import JsonObject
from lmserve.api.request_error import RequestError
from lmserve.api.structured_request import ResponseFormat, StructuredOutputsRequest, structured_outputs_of
from lmserve.api.tools import ToolChoice, Tools
from lmserve.json_limits import MAX_JSON_DEPTH, JsonTooDeepError, check_json_depth, loads_bounded
from lmserve.outputs import Logprobs
from lmserve.sampling_params import MAX_TOKEN_ID_ENTRIES, SamplingParams

DecodeToken = Callable[[int], str]
Prompt = str | list[int]

# JSON has no -inf; OpenAI clients expect a number, so impossible tokens get vLLM's floor instead of null.
MIN_LOGPROB = -9999.0
MAX_COMPLETION_LOGPROBS = 5
MAX_CHAT_TOP_LOGPROBS = 20
DEFAULT_COMPLETION_MAX_TOKENS = 16
# Engine requests one HTTP request may start (prompts × n): each costs a detokenizer, a queue entry and KV.
MAX_CHOICES_PER_REQUEST = 1024
# vLLM's cache_salt: a tenant's secret that keys its prefix-cache blocks; it lives with every cached block.
MAX_CACHE_SALT_CHARS = 256
# A priority travels to the engine as a 64-bit integer.
PRIORITY_RANGE = (-(2**63), 2**63 - 1)
# OpenAI's bounds on `metadata` (chat and Responses): 16 pairs, keys up to 64 characters, values up to 512.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
# Turns of one chat (and input items of one response): each is rendered by the chat template, in Python.
MAX_CHAT_MESSAGES = 4096
# Calls of one assistant turn in a chat's history (as many as a request may have tools).
MAX_HISTORY_TOOL_CALLS = 128


def _now() -> int:
    return int(time.time())


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class OpenAIRequestModel(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


# ------------------------------------------------------------------------------------------------ requests


def _bounded_metadata(metadata: dict[str, str]) -> dict[str, str]:
    if len(metadata) > MAX_METADATA_PAIRS:
        raise ValueError(f"metadata has {len(metadata)} pairs; at most {MAX_METADATA_PAIRS} are allowed")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise ValueError(f"metadata key {key[:20]!r}... is {len(key)} characters; at most "
                             f"{MAX_METADATA_KEY_CHARS} are allowed")
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise ValueError(f"metadata[{key!r}] is {len(value)} characters; at most {MAX_METADATA_VALUE_CHARS} "
                             "are allowed")
    return metadata


Metadata = Annotated[dict[str, str], AfterValidator(_bounded_metadata)]


class StreamOptions(OpenAIRequestModel):
    include_usage: bool | None = False
    # vLLM's: with include_usage, every chunk carries the usage so far (not only the last one).
    continuous_usage_stats: bool | None = False


# Request fields copied to SamplingParams as they are when the client set them (None keeps SamplingParams' default).
_PASSTHROUGH_FIELDS = (
    "n", "temperature", "top_p", "stop", "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p",
    "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "include_stop_str_in_output",
    "skip_special_tokens", "prompt_logprobs", "truncate_prompt_tokens", "allowed_token_ids",
)


_GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


class _SamplingRequest(OpenAIRequestModel):
    """Fields shared by completions and chat completions (OpenAI's, then vLLM's extras).

    A field lmserve does not implement is a 400 naming it (as vLLM), never a silent ignore: a client that sends
    `suffix` or a format we do not know must not believe it was honoured. The few OpenAI fields that change nothing
    about the answer (user, store, metadata, ...) are accepted.
    """

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    model: str | None = None
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # OpenAI's bookkeeping fields: accepted, no effect on the answer.
    user: str | None = None
    store: bool | None = None
    metadata: Metadata | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # Structured output: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: JsonObject | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None  # vLLM's: only these may be drawn
    include_stop_str_in_output: bool | None = None
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob and the top k at its position
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last k tokens (-1: max_model_len)
    skip_special_tokens: bool | None = None
    priority: int | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    # lmserve's: put the request's timeline (lmserve.metrics.stats) in the final response or the last SSE chunk.
    return_timeline: bool | None = None

    @property
    def num_choices(self) -> int:
        return self.n if self.n is not None else 1

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)

    @model_validator(mode="before")
    @classmethod
    def _fields_that_ask_for_nothing(cls, data: Any) -> Any:
        """A field sent as null asks for nothing, even one lmserve does not implement (clients that serialize every
        field send `"suffix": null`), and so do best_of equal to n and modalities ["text"]: they are dropped. Any
        other value of an unknown field is still a 400 naming it."""
        if not isinstance(data, dict):
            return data
        known = cls.model_fields
        kept = {key: value for key, value in data.items() if value is not None or key in known}
        n = kept.get("n") if kept.get("n") is not None else 1
        if "best_of" not in known and type(kept.get("best_of")) is int and kept["best_of"] == n:
            del kept["best_of"]
        if "modalities" not in known and kept.get("modalities") == ["text"]:
            del kept["modalities"]
        return kept

    @model_validator(mode="after")
    def _stream_options_need_a_stream(self) -> _SamplingRequest:
        # As OpenAI and vLLM: options of a stream that is not there are a mistake, not a no-op.
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def _build_sampling_params(
        self, max_tokens: int | None, logprobs: int | None, defaults: Mapping[str, Any] | None, **own: Any
    ) -> SamplingParams:
        """`defaults`: the model's default sampling (--generation-config), for the fields the request left unset.
        A default max_tokens is applied by the front-end, which caps it by the room the prompt leaves (as vLLM).
        `own`: SamplingParams fields of one endpoint's request alone."""
        kwargs: dict[str, Any] = dict(defaults or {})
        uses_default_length = "max_tokens" in kwargs and not self.model_fields_set & {"max_tokens",
                                                                                       "max_completion_tokens"}
        kwargs["max_tokens"] = None if uses_default_length else max_tokens
        kwargs.update({name: value for name in _PASSTHROUGH_FIELDS if (value := getattr(self, name)) is not None})
        kwargs.update(logprobs=logprobs, logit_bias=self._token_logit_bias())
        kwargs.update({name: value for name, value in own.items() if value is not None})
        try:
            kwargs["structured_outputs"] = structured_outputs_of(
                self.response_format, self.structured_outputs,
                {name: value for name in _GUIDED_FIELDS if (value := getattr(self, name)) is not None},
            )
        except ValueError as exc:
            raise RequestError.from_value_error(exc) from None
        try:
            return SamplingParams(**kwargs)
        except ValueError as exc:
            raise RequestError.from_value_error(exc) from None

    def _token_logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        if len(self.logit_bias) > MAX_TOKEN_ID_ENTRIES:
            raise RequestError(f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_TOKEN_ID_ENTRIES} "
                               "are allowed", "logit_bias")
        bias: dict[int, float] = {}
        for key, value in self.logit_bias.items():
            if not (key.isascii() and key.isdigit() and len(key) <= 10):
                raise RequestError(f"logit_bias keys must be token ids, got {key[:20]!r}", "logit_bias")
            bias[int(key)] = value
        return bias

    def check_priority(self) -> int:
        priority = self.priority or 0
        if not PRIORITY_RANGE[0] <= priority <= PRIORITY_RANGE[1]:
            raise RequestError(f"priority must be a 64-bit integer, got {priority}", "priority")
        return priority


def _is_token_ids(value: list) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _is_prompt_list(value: list) -> bool:
    return (
        _is_token_ids(value)
        or all(isinstance(p, str) for p in value)
        or all(isinstance(p, list) and _is_token_ids(p) for p in value)
    )


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = DEFAULT_COMPLETION_MAX_TOKENS  # explicit null: up to the context length
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool | None = False
    add_special_tokens: bool | None = True  # vLLM's: false leaves out the BOS the tokenizer would add
    # OpenAI's fill-in-the-middle: the text after the insertion point; the prompt is the text before it (api/fim.py).
    suffix: str | None = None
    # llama.cpp's, which its completion endpoints accept too: a later line indented less ends the text (SamplingParams).
    n_indent: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt_shape(cls, value: Any) -> Any:
        # One clear message instead of one error per member of the union.
        if isinstance(value, str) or (isinstance(value, list) and _is_prompt_list(value)):
            return value
        raise ValueError("prompt must be a string, a list of strings, a list of token ids or a list of such lists")

    def prompts(self) -> list[Prompt]:
        """The prompts as a list (one engine request each), every one non-empty."""
        prompt = self.prompt
        prompts: list[Prompt]
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompts = [prompt]  # type: ignore[list-item]
        else:
            prompts = list(prompt)  # type: ignore[arg-type]
        if not prompts or any(len(p) == 0 for p in prompts):
            raise RequestError("prompt must not be empty", "prompt")
        if self.num_choices > MAX_CHOICES_PER_REQUEST:
            raise RequestError(f"n={self.num_choices}: one request may start at most {MAX_CHOICES_PER_REQUEST} "
                               "generations", "n")
        if len(prompts) * self.num_choices > MAX_CHOICES_PER_REQUEST:
            raise RequestError(
                f"{len(prompts)} prompts × n={self.num_choices} would start {len(prompts) * self.num_choices} "
                f"generations; one request may start at most {MAX_CHOICES_PER_REQUEST}", "prompt",
            )
        return prompts

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt (and its logprobs) back, nothing generated (lm-eval's scoring)."""
        return bool(self.echo) and self.max_tokens == 0

    def to_sampling_params(self, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        # As vLLM: echo with logprobs scores the prompt too; max_tokens 0 runs one step whose token is dropped.
        params = self._build_sampling_params(1 if self.echo_only else self.max_tokens, self.logprobs, defaults,
                                             n_indent=self.n_indent)
        if self.echo and self.logprobs is not None and params.prompt_logprobs is None:
            params.prompt_logprobs = self.logprobs
        return params


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


# apply_chat_template's own parameters: what the server decides, not the client.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt", "tokenize",
    "padding", "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs", "continue_final_message",
})

def checked_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """chat_template_kwargs are variables for the model's template, never options of the templating itself
    (a client-supplied template would run arbitrary loops in this process)."""
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(kwargs or {}))
    if reserved:
        raise RequestError(f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs")
    return kwargs or {}


def chat_template_options(req: ChatCompletionRequest | TokenizeRequest) -> dict[str, Any]:
    """What a chat request (or /tokenize's messages) hands the chat template besides the messages: the client's
    chat_template_kwargs, its tools, and continue_final_message (which leaves no room for a generation prompt)."""
    kwargs = dict(checked_template_kwargs(req.chat_template_kwargs))
    if isinstance(req, ChatCompletionRequest) and req.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)  # the client's own template variable wins
    if req.tools:
        kwargs["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
    if req.continue_final_message:
        if req.add_generation_prompt is not False:
            raise RequestError("continue_final_message and add_generation_prompt cannot both be true (send "
                               "add_generation_prompt: false to continue the last message)", "continue_final_message")
        kwargs["continue_final_message"] = True
    return kwargs


ChatRole = Literal["system", "developer", "user", "assistant", "tool"]
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]  # OpenAI's values


def _history_tool_calls_problem(tool_calls: Any) -> str | None:
    """What is wrong with an assistant turn's `tool_calls`, which chat templates index without checking; None when
    they are in OpenAI's shape: `[{"id": str, "type": "function", "function": {"name": str, "arguments": str}}]`
    (arguments may also be the object)."""
    if not isinstance(tool_calls, list):
        return "tool_calls must be a list of tool calls"
    if len(tool_calls) > MAX_HISTORY_TOOL_CALLS:
        return f"tool_calls has {len(tool_calls)} calls; at most {MAX_HISTORY_TOOL_CALLS} are allowed"
    for index, call in enumerate(tool_calls):
        where = f"tool_calls[{index}]"
        if not isinstance(call, dict):
            return f'{where} must be an object {{"id", "type": "function", "function": {{"name", "arguments"}}}}'
        function = call.get("function")
        if not isinstance(function, dict):
            return f"{where}.function must be an object with a name and arguments"
        if not isinstance(function.get("name"), str):
            return f"{where}.function.name must be a string"
        if not isinstance(function.get("arguments", ""), str | dict):
            return f"{where}.function.arguments must be a JSON string (or an object)"
        if call.get("id") is not None and not isinstance(call["id"], str):
            return f"{where}.id must be a string"
        if call.get("type", "function") != "function":
            return f"{where}.type must be 'function'"
    return None


class ChatMessage(BaseModel):
    # Extra keys (name, tool_calls, tool_call_id, ...) travel to the chat template untouched.
    model_config = ConfigDict(extra="allow", strict=True)
    role: ChatRole
    content: str | list[ContentPart] | None = None

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        # As OpenAI: only an assistant turn that calls tools may come without content.
        if self.content is None and not (self.role == "assistant" and getattr(self, "tool_calls", None)):
            raise ValueError(f"a {self.role!r} message needs content")
        extra = self.model_extra or {}
        check_json_depth(extra, "a message", MAX_JSON_DEPTH)
        for key in ("name", "tool_call_id"):
            if extra.get(key) is not None and not isinstance(extra[key], str):
                raise ValueError(f"{key} must be a string")
        if extra.get("tool_calls") is not None and (problem := _history_tool_calls_problem(extra["tool_calls"])):
            raise ValueError(problem)
        return self

    def to_template_dict(self) -> dict[str, Any]:
        message = self.model_dump(exclude={"content"})
        message["content"] = self._text_content()
        # OpenAI sends a call's arguments as JSON text; chat templates (Qwen's, Llama's) render them with tojson and
        # expect the object, as vLLM hands them over.
        for call in message.get("tool_calls") or ():
            function = call["function"]
            if isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = loads_bounded(function["arguments"], "a tool call's arguments")
                except JsonTooDeepError as exc:
                    raise RequestError(str(exc), "messages") from None
                except ValueError:
                    pass  # not JSON: the template gets the text as sent
        return message

    def _text_content(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for part in self.content:
            if part.type != "text":
                raise RequestError(f"only text content parts are supported, got type {part.type!r}", "messages")
            if part.text is None:
                raise RequestError("a content part of type 'text' needs its text", "messages")
            texts.append(part.text)
        return "\n".join(texts)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_CHAT_MESSAGES)
    max_tokens: int | None = None  # None: up to the context length
    max_completion_tokens: int | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)
    tools: Tools | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call (the "required" grammar, the parsed calls)
    # vLLM extras
    add_generation_prompt: bool | None = True
    # The last message left open for the model to go on with (a prefilled assistant turn), as vLLM.
    continue_final_message: bool | None = False
    add_special_tokens: bool | None = False  # on top of the template's own (which hold BOS and turn markers)
    chat_template_kwargs: JsonObject | None = None
    # vLLM's: the answer starts with the last message's text when that message is the assistant's (a prefill the
    # model continued), so the client gets the whole turn back.
    echo: bool | None = False
    # vLLM's: false leaves the thinking out of the answer (under --reasoning-parser); it is still generated.
    include_reasoning: bool | None = True
    # OpenAI's: how long a reasoning model should think. As vLLM, a variable for the chat template (gpt-oss's
    # reads it; a template that does not ignores it), so agent frameworks that always send it are served.
    reasoning_effort: ReasoningEffort | None = None

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.to_template_dict() for m in self.messages]

    def echoed_text(self) -> str | None:
        last = self.messages[-1]
        return last._text_content() if self.echo and last.role == "assistant" else None

    def template_kwargs(self) -> dict[str, Any]:
        return chat_template_options(self)

    def to_sampling_params(self, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        if self.top_logprobs and not self.logprobs:  # 0 without logprobs asks for nothing: accepted, as vLLM
            raise RequestError("top_logprobs requires logprobs to be true", "top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._build_sampling_params(max_tokens, logprobs, defaults)


# ------------------------------------------------------------------------------------------------ responses


class UsageInfo(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ErrorInfo(OpenAIModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIModel):
    error: ErrorInfo


class TokenizeRequest(OpenAIRequestModel):
    """vLLM's /tokenize: a completion prompt, or chat messages through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, max_length=MAX_CHAT_MESSAGES)
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (the template has them)
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: JsonObject | None = None
    tools: Tools | None = None  # in the template, as a chat request puts them: they count
    return_token_strs: bool | None = False  # each token's own text beside its id

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send either prompt or messages")
        return self


class TokenizeResponse(OpenAIModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIRequestModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIModel):
    prompt: str


class ModelCard(OpenAIModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "lmserve"
    max_model_len: int | None = None


class ModelList(OpenAIModel):
    object: str = "list"
    data: list[ModelCard]


class CompletionLogprobs(OpenAIModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)

    def __add__(self, other: CompletionLogprobs) -> CompletionLogprobs:
        return CompletionLogprobs(
            text_offset=self.text_offset + other.text_offset,
            token_logprobs=self.token_logprobs + other.token_logprobs,
            tokens=self.tokens + other.tokens,
            top_logprobs=self.top_logprobs + other.top_logprobs,
        )


class PromptLogprob(OpenAIModel):
    """vLLM's Logprob, as its prompt_logprobs carry it: keyed by token id."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(OpenAIModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or token id that ended the choice
    prompt_logprobs: PromptLogprobs | None = None  # with the prompt_logprobs field; left out when None


class CompletionResponse(OpenAIModel):
    id: str
    object: str = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    timelines: list[dict[str, Any]] | None = None  # with return_timeline; left out when None


class CompletionStreamResponse(OpenAIModel):
    id: str
    object: str = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    timelines: list[dict[str, Any]] | None = None  # with return_timeline; left out when None


class ChatTokenLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobEntry(ChatTokenLogprob):
    top_logprobs: list[ChatTokenLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(OpenAIModel):
    content: list[ChatLogprobEntry] | None = None


class FunctionCallOut(OpenAIModel):
    name: str
    arguments: str  # JSON text, as OpenAI


class ToolCallOut(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class DeltaFunctionCall(OpenAIModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIModel):
    """A streamed piece of a tool call: the first carries id, type and name; later ones argument fragments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer(mode="wrap")
    def _drop_unset_keys(self, handler: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
        data = handler(self)
        data["function"] = {k: v for k, v in data["function"].items() if v is not None}
        return {k: v for k, v in data.items() if v is not None}


class ChatMessageOut(OpenAIModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCallOut] | None = None
    reasoning_content: str | None = None  # --reasoning-parser: the model's thinking (DeepSeek's and vLLM's field)

    @model_serializer(mode="wrap")
    def _drop_unset_tool_calls(self, handler: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
        data = handler(self)
        for key in ("tool_calls", "reasoning_content"):
            if data.get(key) is None:
                data.pop(key, None)
        return data


class ChatCompletionChoice(OpenAIModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIModel):
    id: str
    object: str = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    timelines: list[dict[str, Any]] | None = None  # with return_timeline; left out when None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, with the prompt_logprobs field; left out when None


class DeltaMessage(OpenAIModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset_keys(self, handler: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
        # OpenAI sends the role only in the first delta; a `"role": null` in every later one confuses some clients.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionStreamChoice(OpenAIModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIModel):
    id: str
    object: str = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    timelines: list[dict[str, Any]] | None = None  # with return_timeline; left out when None


# ------------------------------------------------------------------------------------------------ logprobs


def _finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def completion_logprobs(
    entries: Sequence[Logprobs], decode_token: DecodeToken, num_top: int, text_offset: int
) -> CompletionLogprobs:
    """OpenAI's legacy shape; `text_offset` is where the first of these tokens starts in the choice's text.

    The sampled token is always in its position's top_logprobs, so there may be num_top + 1 entries (as OpenAI).
    """
    out = CompletionLogprobs()
    for entry in entries:
        token = decode_token(entry.token_id)
        top = {decode_token(t): _finite(lp) for t, lp in entry.top[:num_top]}
        top.setdefault(token, _finite(entry.logprob))
        out.tokens.append(token)
        out.token_logprobs.append(_finite(entry.logprob))
        out.top_logprobs.append(top)
        out.text_offset.append(text_offset)
        text_offset += len(token)
    return out


def echo_logprobs(
    prompt_token_ids: Sequence[int], entries: Sequence[Logprobs | None], decode_token: DecodeToken, num_top: int
) -> CompletionLogprobs:
    """The echoed prompt's part of a completion's logprobs: null for the first token, which nothing predicts."""
    out = CompletionLogprobs()
    text_offset = 0
    for token_id, entry in zip(prompt_token_ids, entries, strict=True):
        if entry is None:
            token = decode_token(token_id)
            out.tokens.append(token)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            out.text_offset.append(text_offset)
            text_offset += len(token)
        else:
            out += completion_logprobs([entry], decode_token, num_top, text_offset)
            text_offset += len(out.tokens[-1])
    return out


def prompt_logprobs_out(entries: Sequence[Logprobs | None], decode_token: DecodeToken, num_top: int) -> PromptLogprobs:
    """vLLM's prompt_logprobs: per prompt token, {token id: Logprob} for the prompt's token first, then the top k."""
    out: PromptLogprobs = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        by_id = {str(entry.token_id): PromptLogprob(
            logprob=_finite(entry.logprob), rank=entry.rank, decoded_token=decode_token(entry.token_id)
        )}
        for rank, (token_id, logprob) in enumerate(entry.top[:num_top], start=1):
            by_id.setdefault(str(token_id), PromptLogprob(
                logprob=_finite(logprob), rank=rank, decoded_token=decode_token(token_id)
            ))
        out.append(by_id)
    return out


def _chat_token(token_id: int, logprob: float, decode_token: DecodeToken) -> ChatTokenLogprob:
    token = decode_token(token_id)
    return ChatTokenLogprob(token=token, logprob=_finite(logprob), bytes=list(token.encode("utf-8")))


def chat_logprobs(entries: Sequence[Logprobs], decode_token: DecodeToken, num_top: int) -> ChatChoiceLogprobs:
    content = []
    for entry in entries:
        sampled = _chat_token(entry.token_id, entry.logprob, decode_token)
        top = [_chat_token(t, lp, decode_token) for t, lp in entry.top[:num_top]]
        content.append(ChatLogprobEntry(**sampled.model_dump(), top_logprobs=top))
    return ChatChoiceLogprobs(content=content)
