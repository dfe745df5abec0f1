"""The logic behind /v1/completions and /v1/chat/completions: requests in, choices out, streamed or whole."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from lmserve.api.anthropic import (
    CountTokensRequest,
    MessageBody,
    MessageEvents,
    MessageShell,
    MessagesRequest,
    message_body,
    sse_error_event,
    typed_event,
)
from lmserve.api.choices import ChatChoices, Choices, CompletionChoices, ReasoningOutput
from lmserve.api.errors import InvalidBodyError, ModelNotFoundError
from lmserve.api.fim import InfillBody, InfillRequest, fim_prompt, infill_body, no_fim_tokens_error
from lmserve.api.middleware import arrival_time
from lmserve.api.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    Prompt,
    TokenizeRequest,
    TokenizeResponse,
    chat_template_options,
)
from lmserve.api.reasoning_parsers import THINK_END, THINK_START, get_reasoning_parser
from lmserve.api.request_error import RequestError
from lmserve.api.responses import (
    ResponseBody,
    ResponseEvents,
    ResponseShell,
    ResponsesRequest,
    output_items,
    status_of,
    typed_sse,
)
from lmserve.api.sse import SSE_DONE, EventStreamResponse, RecordedJSONResponse, sse, sse_error, trailer
from lmserve.api.tool_output import ToolOutput
from lmserve.api.tool_parsers import HARMONY_PARSERS, HarmonyToolParser, ToolConfig, get_tool_parser
from lmserve.api.tools import check_tool_choice, constraint_schema, resolve_tool_choice
from lmserve.frontend.engine_client import EngineClient
from lmserve.frontend.request_group import RequestGroup
from lmserve.harmony import STOP_TEXTS as HARMONY_STOP_TEXTS
from lmserve.metrics.recorder import StatsRecorder
from lmserve.model_tokenizer import FimTokens
from lmserve.sampling_params import MAX_GRAMMAR_CHARS, SamplingParams, StructuredOutputsParams
from lmserve.structured_output import GrammarError


class OpenAIServing:
    """The logic behind /v1/completions and /v1/chat/completions."""

    def __init__(
        self, client: EngineClient, model_name: str, recorder: StatsRecorder, tools: ToolConfig | None = None,
        aliases: Sequence[str] = (),
    ) -> None:
        self.client = client
        self.model_name = model_name  # what responses name (vLLM's first --served-model-name)
        self.model_names = list(dict.fromkeys([model_name, *aliases]))  # what requests may name
        self.recorder = recorder
        self.tools = (tools or ToolConfig()).for_chat_format(getattr(client, "chat_format", None))
        # gpt-oss's format: its output is read as harmony messages whatever the request asks (lmserve.harmony).
        self.harmony = self.tools.reasoning_parser in HARMONY_PARSERS or self.tools.tool_call_parser in HARMONY_PARSERS
        self.num_requests_aborted = 0  # by this server (client disconnects, failures); for /metrics

    def check_model(self, requested: str | None) -> None:
        # A missing model means the served one, as in vLLM; a wrong one must not silently run another model.
        if requested is not None and requested not in self.model_names:
            served = ", ".join(repr(name) for name in self.model_names)
            raise ModelNotFoundError(f"the model {requested!r} does not exist; this server serves {served}")

    def _count_abort(self) -> None:
        self.num_requests_aborted += 1

    def _group(
        self, req: CompletionRequest | ChatCompletionRequest, prompts: Sequence[Prompt], params: SamplingParams,
        request_ids: Sequence[str], raw: Request,
    ) -> RequestGroup:
        # A whole response takes each output whole from the front-end, which alone accumulates the text.
        return RequestGroup(self.client, prompts, params, request_ids, req.check_priority(), self._count_abort,
                            arrival_time(raw), self.recorder, final_only=not req.stream, cache_salt=req.cache_salt,
                            client_gone=raw.is_disconnected)

    async def _answer(
        self, group: RequestGroup, choices: Choices, stream: bool, whole: Callable[[], BaseModel],
        events: Callable[[], AsyncIterator[str]],
    ) -> Response:
        """Starts the group, then answers with one JSON body (`whole()`, once every output is in the choices) or an
        event stream (`events()`, which reads the group's outputs). The group owns its life (frontend/
        request_group.py); the response leaves the group's context once its last byte is written or its client is
        gone, and the group then aborts what has not finished and records it."""
        async with AsyncExitStack() as group_life:
            try:
                await group_life.enter_async_context(group)
            except RequestError:
                raise
            except GrammarError as exc:  # the front-end's grammar check: response_format, structured_outputs, a tool
                raise RequestError(str(exc), "structured_outputs") from exc
            except ValueError as exc:  # the engine client's input validation (PromptTooLongError included)
                raise RequestError.from_value_error(exc) from exc
            if not stream:
                for prompt_index, out in await group.collect():
                    choices.add(prompt_index, out)
                return RecordedJSONResponse(whole(), group_life.pop_all())
            return EventStreamResponse(events(), group_life.pop_all())

    async def _serve(
        self, req: CompletionRequest | ChatCompletionRequest, raw: Request, group: RequestGroup, choices: Choices,
        response_id: str, response_type: type[BaseModel], chunk_type: type[BaseModel], prelude: Sequence[list[Any]],
    ) -> Response:
        def whole() -> BaseModel:
            return response_type(
                id=response_id, model=self.model_name, choices=choices.final_choices(), usage=choices.usage(),
                timelines=group.timeline_dicts() if req.return_timeline else None, **choices.response_fields(),
            )

        def chunk(items: list[Any], usage: Any = None, timelines: list | None = None) -> str:
            return sse(chunk_type(id=response_id, model=self.model_name, choices=items, usage=usage,
                                  timelines=timelines))

        async def events() -> AsyncIterator[str]:
            try:
                for items in prelude:
                    yield chunk(items)
                async with aclosing(group.outputs()) as outputs:  # closed (aborting the rest) however the loop ends
                    async for prompt_index, out in outputs:
                        for choice in choices.stream_choices(prompt_index, out):
                            # One choice per chunk, as OpenAI (and clients reading choices[0]).
                            yield chunk([choice], choices.usage() if req.continuous_usage else None)
                if last := trailer(choices, group, req.include_usage, bool(req.return_timeline)):
                    yield chunk([], *last)
            except Exception as exc:  # noqa: BLE001 - headers are sent: report in-band (sse_error logs the unexpected)
                yield sse_error(exc)
            yield SSE_DONE

        return await self._answer(group, choices, bool(req.stream), whole, events)

    def _fim_tokens(self, param: str) -> FimTokens:
        fim = self.client.fim_tokens
        if fim is None:
            raise no_fim_tokens_error(param)
        return fim

    def _fim_prompt(self, fim: FimTokens, prefix: str, suffix: str, max_tokens: int | None, prompt: str = "",
                    extra: list[tuple[str, str]] | None = None) -> list[int]:
        """An infill prompt (api/fim.py) in the room the context leaves max_tokens (the rest is cut)."""

        def tokenize_code(text: str) -> list[int]:  # as llama.cpp: a special token's text in code stays text
            return self.client.tokenize(text, add_special_tokens=False, split_special_tokens=True) if text else []

        def tokenize_prompt(text: str) -> list[int]:  # llama.cpp parses special tokens in /infill's `prompt`
            return self.client.tokenize(text, add_special_tokens=False) if text else []

        try:
            with_bos, without = self.client.tokenize("\n", True), self.client.tokenize("\n", False)
            bos = with_bos[:len(with_bos) - len(without)]
            room = self.client.max_model_len - (max_tokens if max_tokens is not None else 1)
            return fim_prompt(fim, tokenize_code, bos, prefix, suffix, prompt, extra, max(room, 0), tokenize_prompt)
        except RequestError:
            raise
        except ValueError as exc:
            raise RequestError.from_value_error(exc) from exc

    def _fim_prompts(self, req: CompletionRequest, prompts: list[Prompt], params: SamplingParams) -> list[Prompt]:
        """OpenAI's suffix: each prompt the prefix of an infill prompt; generation stops where the middle ends."""
        fim = self._fim_tokens("suffix")
        if req.echo:
            raise RequestError("echo cannot be combined with suffix", "echo")
        if any(not isinstance(p, str) for p in prompts):
            raise RequestError("suffix needs text prompts (the infill prompt is built from text)", "prompt")
        params.stop_token_ids = [*params.stop_token_ids, *fim.stop_ids]
        return [self._fim_prompt(fim, str(p), req.suffix or "", params.max_tokens) for p in prompts]

    async def create_completion(self, req: CompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        prompts = req.prompts()
        params = req.to_sampling_params(self.client.default_sampling)
        if req.suffix is not None:
            prompts = await asyncio.to_thread(self._fim_prompts, req, prompts, params)
        elif req.add_special_tokens is False:  # vLLM's: the text's tokens alone, no BOS the tokenizer would add
            try:
                prompts = [self.client.tokenize(p, add_special_tokens=False) if isinstance(p, str) else p
                           for p in prompts]
            except ValueError as exc:
                raise RequestError.from_value_error(exc) from exc
        response_id = f"cmpl-{uuid.uuid4().hex}"
        request_ids = [f"{response_id}-{i}" for i in range(len(prompts))]
        group = self._group(req, prompts, params, request_ids, raw)
        choices = CompletionChoices(req.num_choices, prompts, bool(req.echo), req.logprobs, self.client.decode_token,
                                    req.prompt_logprobs, req.echo_only)
        return await self._serve(req, raw, group, choices, response_id, CompletionResponse, CompletionStreamResponse,
                                 prelude=())

    def _infill(self, req: InfillRequest, raw: Request) -> tuple[RequestGroup, CompletionChoices, CompletionRequest]:
        fim = self._fim_tokens("input_prefix")
        try:
            completion = CompletionRequest.model_validate({**req.completion_fields(), "prompt": [0]})
        except ValidationError as exc:
            raise InvalidBodyError(exc) from None
        self.check_model(completion.model)
        params = completion.to_sampling_params(self.client.default_sampling)
        params.stop_token_ids = [*params.stop_token_ids, *fim.stop_ids]
        prompt = self._fim_prompt(fim, req.input_prefix, req.input_suffix, params.max_tokens, req.prompt,
                                  req.extra_files())
        request_id = f"infill-{uuid.uuid4().hex}"
        group = self._group(completion, [prompt], params, [request_id], raw)
        choices = CompletionChoices(1, [prompt], False, None, self.client.decode_token)
        return group, choices, completion

    async def create_infill(self, req: InfillRequest, raw: Request) -> Response:
        """llama.cpp's /infill (api/fim.py): a completion of the infill prompt, answered in llama.cpp's shape."""
        group, choices, completion = await asyncio.to_thread(self._infill, req, raw)
        num_prompt_tokens = len(group.prompts[0])

        def indent_stop() -> bool:  # llama.cpp's stop_type tells n_indent's stop from EOS
            state = choices.states.get(0)
            return state is not None and state.indent_stop

        def whole() -> BaseModel:
            (choice,), usage = choices.final_choices(), choices.usage()
            return InfillBody(**infill_body(self.model_name, choice.text, [], choice.finish_reason,
                                            choice.stop_reason, num_prompt_tokens, usage.completion_tokens,
                                            indent_stop()))

        async def events() -> AsyncIterator[str]:
            try:
                finish_reason = stop_reason = None
                async with aclosing(group.outputs()) as outputs:
                    async for prompt_index, out in outputs:
                        for choice in choices.stream_choices(prompt_index, out):
                            if choice.text:
                                yield sse(InfillBody(index=0, content=choice.text, tokens=[], stop=False, id_slot=0))
                            if choice.finish_reason is not None:
                                finish_reason, stop_reason = choice.finish_reason, choice.stop_reason
                last = infill_body(self.model_name, "", [], finish_reason, stop_reason, num_prompt_tokens,
                                   choices.usage().completion_tokens, indent_stop())
                yield sse(InfillBody(**last))
            except Exception as exc:  # noqa: BLE001 - headers are sent: report in-band (sse_error logs the unexpected)
                yield sse_error(exc)

        return await self._answer(group, choices, bool(completion.stream), whole, events)

    def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        self.check_model(req.model)
        try:
            if req.messages is not None:
                kwargs = chat_template_options(req)
                messages = [m.to_template_dict() for m in req.messages]
                tokens = self.client.render_chat(messages, req.add_generation_prompt is not False, kwargs,
                                                 bool(req.add_special_tokens))
            else:
                tokens = self.client.tokenize(req.prompt or "", req.add_special_tokens is not False)
        except RequestError:
            raise
        except ValueError as exc:
            raise RequestError.from_value_error(exc) from exc
        token_strs = [self.client.decode_token(t) for t in tokens] if req.return_token_strs else None
        return TokenizeResponse(count=len(tokens), max_model_len=self.client.max_model_len, tokens=tokens,
                                token_strs=token_strs)

    def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(req.model)
        try:
            return DetokenizeResponse(prompt=self.client.detokenize(req.tokens))
        except ValueError as exc:
            raise RequestError(str(exc), "tokens") from exc

    def _tool_output(self, req: ChatCompletionRequest, params: SamplingParams) -> ToolOutput | None:
        """What the chat's tools make of its output; a forced call (required, named) constrains the decoding to the
        function's schema, so its arguments always parse."""
        choice = resolve_tool_choice(req.tools, req.tool_choice)  # OpenAI's and vLLM's default: "auto" with tools
        if choice == "auto" and req.tools and not self.tools.enable_auto_tool_choice:
            # As vLLM: a silent "none" would put the model's tool-call text into content as an answer.
            raise RequestError('"auto" tool choice (the default when a request has tools) requires the server to '
                               "run with --enable-auto-tool-choice and --tool-call-parser; or send tool_choice "
                               '"none", "required" or a named function', "tool_choice")
        check_tool_choice(req.tools, choice)
        if choice == "none" or not req.tools:
            return None
        max_calls = 1 if req.parallel_tool_calls is False else None
        if choice == "auto":
            parser = get_tool_parser(self.tools.tool_call_parser or "")
            if parser.needs_special_tokens:  # as vLLM: Mistral's [TOOL_CALLS] must reach the parser
                params.skip_special_tokens = False
            return ToolOutput(choice, parser, max_calls)
        if params.structured_outputs is not None:
            raise RequestError("a forced tool call cannot be combined with response_format or structured_outputs",
                               "tool_choice")
        schema = constraint_schema(req.tools, choice, max_calls)
        text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"))  # as MAX_TOOL_PARAMETERS_BYTES counts
        try:
            params.structured_outputs = StructuredOutputsParams(json=text)
        except ValueError:
            what = "the tools' schemas together" if choice == "required" else "the named tool's schema"
            raise RequestError(f"a forced tool call constrains the output to {what}, {len(text)} characters of "
                               f"JSON; a grammar may be at most {MAX_GRAMMAR_CHARS}", "tools") from None
        return ToolOutput(choice, max_calls=max_calls)

    def _harmony_output(self, params: SamplingParams, tool_output: ToolOutput | None) -> ToolOutput:
        """gpt-oss's output: its format's tokens kept in the text for the parsers, its turn ended by <|return|> or
        <|call|> (not <|end|>, after which it goes on), and its answer (the final channel) read from the messages
        even when the request has no tools (a call it makes then is dropped, as tool_choice "none" means)."""
        params.skip_special_tokens = False
        stops = [token for text in HARMONY_STOP_TEXTS if (token := self._single_token(text)) is not None]
        params.stop_token_ids = [*params.stop_token_ids, *(t for t in stops if t not in params.stop_token_ids)]
        if tool_output is None:
            return ToolOutput("none", HarmonyToolParser(), max_calls=0)
        return tool_output

    def _reasoning_output(
        self, req: ChatCompletionRequest, params: SamplingParams, prompt_token_ids: list[int]
    ) -> ReasoningOutput | None:
        """The thinking to split from the answer, under --reasoning-parser. A grammar (response_format,
        structured_outputs, a forced tool call) then constrains the answer only: it starts after `</think>`, as
        vLLM's does, so the model thinks freely first. Where the prompt already closed the thinking (Qwen3's
        enable_thinking false) or the vocabulary has no single `</think>` token, the grammar runs from the first
        token and the whole output is the answer."""
        if self.tools.reasoning_parser is None or req.echo:
            return None
        spec = params.structured_outputs
        if spec is not None:
            end, start = self._single_token(THINK_END), self._single_token(THINK_START)
            if end is None:
                return None
            last = {token: i for i, token in enumerate(prompt_token_ids) if token in (start, end)}
            if end in last and last[end] > last.get(start, -1):
                return None  # the template closed the thinking: no reasoning to split
            spec.after_token_id = end
        return ReasoningOutput(get_reasoning_parser(self.tools.reasoning_parser), req.include_reasoning is not False)

    def _single_token(self, text: str) -> int | None:
        try:
            ids = self.client.tokenize(text, add_special_tokens=False)
        except ValueError:
            return None
        return ids[0] if len(ids) == 1 else None

    async def create_chat_completion(self, req: ChatCompletionRequest, raw: Request) -> Response:
        # The chat template is Python over every message: on a worker thread, so that a long conversation never
        # holds up the other clients' requests (its bytecode lets the event loop's thread in every few ms).
        group, choices, response_id = await asyncio.to_thread(self._chat, req, raw)
        # OpenAI's first chunk of each choice carries the role; with echo, the next one the echoed text (as vLLM).
        prelude = [[ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))]
                   for i in range(choices.n)]
        if choices.echoed:
            prelude += [[ChatCompletionStreamChoice(index=i, delta=DeltaMessage(content=choices.echoed))]
                        for i in range(choices.n)]
        return await self._serve(req, raw, group, choices, response_id, ChatCompletionResponse,
                                 ChatCompletionStreamResponse, prelude=prelude)

    def _chat(self, req: ChatCompletionRequest, raw: Request) -> tuple[RequestGroup, ChatChoices, str]:
        """A chat request's engine requests (not started yet) and the choices their outputs fold into."""
        self.check_model(req.model)
        params = req.to_sampling_params(self.client.default_sampling)
        tool_output = self._tool_output(req, params)
        if self.harmony:
            tool_output = self._harmony_output(params, tool_output)
        messages, template_kwargs = req.template_messages(), req.template_kwargs()
        try:
            prompt_token_ids = self.client.render_chat(messages, req.add_generation_prompt is not False,
                                                       template_kwargs, bool(req.add_special_tokens))
        except ValueError as exc:
            raise RequestError(str(exc), "messages") from exc
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        reasoning = self._reasoning_output(req, params, prompt_token_ids)  # may defer the grammar: before the group
        group = self._group(req, [prompt_token_ids], params, [response_id], raw)
        num_top = (req.top_logprobs or 0) if req.logprobs else None
        echoed = req.echoed_text()
        choices = ChatChoices(req.num_choices, num_top, self.client.decode_token, req.prompt_logprobs, tool_output,
                              echoed, reasoning)
        return group, choices, response_id

    def _response_chat(
        self, req: ResponsesRequest, raw: Request
    ) -> tuple[ChatCompletionRequest, tuple[RequestGroup, ChatChoices, str]]:
        try:
            chat = ChatCompletionRequest.model_validate(req.to_chat())
        except ValidationError as exc:
            raise InvalidBodyError(exc) from None
        return chat, self._chat(chat, raw)

    async def create_response(self, req: ResponsesRequest, raw: Request) -> Response:
        """/v1/responses: the chat request it means (api/responses.py), its one choice as Responses output."""
        chat, (group, choices, _) = await asyncio.to_thread(self._response_chat, req, raw)
        shell = ResponseShell(req, self.model_name)

        def whole() -> BaseModel:
            choice = choices.final_choices()[0]
            return ResponseBody(**shell.body(status_of(choice.finish_reason), output_items(choice), choices.usage()))

        async def events() -> AsyncIterator[str]:
            translate = ResponseEvents(shell)
            try:
                for event in translate.start():
                    yield typed_sse(event)
                finish_reason = None
                async with aclosing(group.outputs()) as outputs:
                    async for prompt_index, out in outputs:
                        for choice in choices.stream_choices(prompt_index, out):
                            finish_reason = choice.finish_reason or finish_reason
                            for event in translate.delta(choice):
                                yield typed_sse(event)
                for event in translate.finish(finish_reason, choices.usage()):
                    yield typed_sse(event)
            except Exception as exc:  # noqa: BLE001 - headers are sent: report in-band (sse_error logs the unexpected)
                yield sse_error(exc)

        return await self._answer(group, choices, bool(chat.stream), whole, events)

    def _message_chat(
        self, req: CountTokensRequest, raw: Request | None
    ) -> tuple[ChatCompletionRequest, tuple[RequestGroup, ChatChoices, str] | None]:
        try:
            chat = ChatCompletionRequest.model_validate(req.to_chat())
        except ValidationError as exc:
            raise InvalidBodyError(exc) from None
        return chat, (self._chat(chat, raw) if raw is not None else None)

    def count_message_tokens(self, req: CountTokensRequest) -> dict[str, int]:
        """/v1/messages/count_tokens: the prompt the chat template renders for these messages, tools included."""
        chat, _ = self._message_chat(req, None)
        self.check_model(chat.model)
        try:
            tokens = self.client.render_chat(chat.template_messages(), True, chat.template_kwargs(), False)
        except ValueError as exc:
            raise RequestError(str(exc), "messages") from exc
        return {"input_tokens": len(tokens)}

    async def create_message(self, req: MessagesRequest, raw: Request) -> Response:
        """/v1/messages: the chat request it means (api/anthropic.py), its one choice as an Anthropic Message."""
        chat, started = await asyncio.to_thread(self._message_chat, req, raw)
        assert started is not None
        group, choices, _ = started
        shell = MessageShell(self.model_name, req)

        def whole() -> BaseModel:
            return MessageBody(**message_body(shell, choices.final_choices()[0], choices.usage()))

        async def events() -> AsyncIterator[str]:
            translate = MessageEvents(shell)
            try:
                for event in translate.start(len(group.prompts[0])):
                    yield typed_event(event)
                finish_reason = stop_reason = None
                async with aclosing(group.outputs()) as outputs:
                    async for prompt_index, out in outputs:
                        for choice in choices.stream_choices(prompt_index, out):
                            if choice.finish_reason is not None:
                                finish_reason, stop_reason = choice.finish_reason, choice.stop_reason
                            for event in translate.delta(choice):
                                yield typed_event(event)
                for event in translate.finish(finish_reason, stop_reason, choices.usage()):
                    yield typed_event(event)
            except Exception as exc:  # noqa: BLE001 - headers are sent: report in-band (errors.py logs the unexpected)
                yield sse_error_event(exc)

        return await self._answer(group, choices, bool(chat.stream), whole, events)
