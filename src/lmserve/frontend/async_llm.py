"""AsyncLLM: the server's front-end. Input processing, per-request output streams, detokenization, aborts.

Runs in the API-server process; the engine core runs in its own process behind EngineCoreClient.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from lmserve.config import EngineConfig
from lmserve.engine.dp_client import make_engine_client
from lmserve.engine.messages import (
    AbortRequests,
    AddRequest,
    EngineFailed,
    EngineInput,
    FinishRequests,
    GetStats,
    Ready,
    RequestRejected,
    StatsReply,
    StepOutputs,
)
from lmserve.frontend.errors import EngineDeadError, EngineNotReadyError, QueueFullError
from lmserve.frontend.input_processor import (
    MAX_PROMPT_CHARS_PER_TOKEN,
    InputProcessor,
    Prompt,
    PromptTooLongError,
    child_params,
)
from lmserve.frontend.output_processor import OutputProcessor
from lmserve.frontend.timelines import TimelineTracker
from lmserve.frontend.tokenizer import (
    load_frontend_tokenizer,
    tokenizer_chat_format,
    tokenizer_eos_token_ids,
    tokenizer_fim_tokens,
)
from lmserve.generation_config import default_sampling
from lmserve.metrics.clock import now
from lmserve.metrics.stats import EngineStats, RequestTimeline, StepRecord
from lmserve.models import read_config_dict, resolve_model
from lmserve.outputs import PoolingOutput, RequestOutput
from lmserve.plan.layout import check_layout
from lmserve.pooling_config import (
    YES_NO_INSTRUCTION,
    YES_NO_PAIR,
    YES_NO_PREFIX,
    YES_NO_SUFFIX,
    PoolingConfig,
    is_pooling_model,
    load_pooling_config,
)
from lmserve.pooling_params import PoolingParams
from lmserve.sampling_params import SamplingParams
from lmserve.structured_output import GrammarError, check_structured_outputs

logger = logging.getLogger(__name__)

ENGINE_CHECK_INTERVAL_S = 0.2
# Stats fields about the requests a caller asked for: at the top level only, not repeated per replica.
PER_REQUEST_FIELDS = ("request_positions", "request_status", "engines")


class RequestStream:
    """One request's outputs. A consumer slower than the engine gets the deltas merged, never dropped."""

    def __init__(self) -> None:
        self.pending: RequestOutput | None = None
        self.error: BaseException | None = None
        self.ready = asyncio.Event()

    def put(self, delta: RequestOutput) -> None:
        if self.pending is None:
            self.pending = delta
        else:
            merge_into(self.pending, delta)
        self.ready.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.ready.set()

    async def get(self) -> RequestOutput:
        """The outputs merged since the last get; then, once they are read, the error if the stream failed."""
        while self.pending is None and self.error is None:
            self.ready.clear()
            await self.ready.wait()
        if self.pending is not None:
            out, self.pending = self.pending, None
            return out
        raise self.error


def merge_into(pending: RequestOutput, delta: RequestOutput) -> None:
    by_index = {c.index: c for c in pending.outputs}
    for new in delta.outputs:
        old = by_index.get(new.index)
        if old is None:
            pending.outputs.append(new)
            by_index[new.index] = new
            continue
        old.text += new.text
        old.token_ids.extend(new.token_ids)
        if old.logprobs is not None and new.logprobs:
            old.logprobs.extend(new.logprobs)
        old.finish_reason, old.stop_reason, old.indent_stop = new.finish_reason, new.stop_reason, new.indent_stop
    pending.finished = delta.finished
    pending.num_cached_tokens = delta.num_cached_tokens
    if delta.prompt_logprobs is not None:
        pending.prompt_logprobs = delta.prompt_logprobs


# Grammars are checked on threads of their own, so that a slow one never takes a thread the API parses or renders
# with; one that takes longer than GRAMMAR_CHECK_TIMEOUT_S is refused (its build goes on and is cached, so it
# holds a thread until then: the request bounds of lmserve.structured_output keep any build well under a second).
GRAMMAR_CHECK_THREADS = 4
GRAMMAR_CHECK_TIMEOUT_S = 10.0
_grammar_checks = ThreadPoolExecutor(GRAMMAR_CHECK_THREADS, thread_name_prefix="grammar-check")


async def check_grammar(params: SamplingParams, timeout: float = GRAMMAR_CHECK_TIMEOUT_S) -> None:
    """A bad schema is the client's 400 here, not a failed request later; building it can take a while for a large
    schema, so off the event loop (the grammar cache makes a repeated schema instant), and within `timeout`."""
    check = asyncio.get_running_loop().run_in_executor(_grammar_checks, check_structured_outputs,
                                                       params.structured_outputs)
    try:
        await asyncio.wait_for(asyncio.shield(check), timeout)
    except TimeoutError:
        raise GrammarError(f"invalid sampling parameter structured_outputs: its grammar took more than {timeout:g} "
                           "s to build; simplify the schema, regex or grammar") from None


class AsyncLLM:
    def __init__(
        self, config: EngineConfig, served_model_name: str | None = None, log_level: str = "INFO",
        max_queued_requests: int | None = None,
    ) -> None:
        """`max_queued_requests`: engine requests that may wait for their first step before new ones get
        QueueFullError (None: no limit)."""
        self.config = config
        check_layout(config)  # the model splits as asked and the ranks fit: before the engine starts
        speculative = config.scheduler.speculative_config
        if speculative is not None and speculative.model is not None:
            resolve_model(speculative.model)  # a missing draft fails here, as a missing model does
        self.max_queued_requests = max_queued_requests
        # Engine requests sent but not yet in any step: what --max-queued-requests counts.
        self.queued: set[str] = set()
        self.model_name = served_model_name or config.model.model
        # An encoder makes this server a pooling runner (vLLM's --runner pooling): /v1/embeddings, no generation.
        source = resolve_model(config.model.model)
        task = config.model.task
        self.pooling: PoolingConfig | None = load_pooling_config(source, task) if is_pooling_model(source, task) \
            else None
        self.embedding_size = self.pooling.output_size(int(read_config_dict(source).get("hidden_size", 0))) \
            if self.pooling else 0
        self._pooled: dict[str, asyncio.Future[bytes]] = {}  # pooling requests in the engine -> their vector
        # One engine process, or with data_parallel_size N, N replicas behind one client that routes each request.
        # Started first: it loads the model while this process loads the tokenizer.
        self.engine = make_engine_client(config, log_level)
        try:
            self.tokenizer = load_frontend_tokenizer(config.model)
            self.tokenizer_eos_token_ids = tokenizer_eos_token_ids(config.model, self.tokenizer)
            self.fim_tokens = tokenizer_fim_tokens(config.model, self.tokenizer)
            self.chat_format = tokenizer_chat_format(config.model, self.tokenizer)
            self.default_sampling = default_sampling(
                resolve_model(config.model.model), config.model.generation_config,
                config.model.override_generation_config,
            )
        except BaseException:
            self.engine.shutdown()
            raise
        self.output_processor = OutputProcessor(self.tokenizer)
        self.input_processor: InputProcessor | None = None  # needs the engine's max_model_len: set on Ready
        self.streams: dict[str, RequestStream] = {}
        self.is_ready = False
        self.errored = False
        self.dead_reason = ""
        self.on_engine_dead: Callable[[], None] | None = None
        # Called with every engine step's record (Prometheus, the dashboard); must be quick.
        self.on_step: Callable[[StepRecord], None] | None = None
        self.timelines = TimelineTracker()
        self.max_model_len = 0
        self._ready = asyncio.Event()
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._tasks: list[asyncio.Task] = []

    # ---- lifecycle ---------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Starts the output and health loops on the running event loop."""
        self._tasks = [asyncio.create_task(self._output_loop()), asyncio.create_task(self._watch_engine())]

    async def wait_ready(self, timeout: float | None = None) -> None:
        await asyncio.wait_for(self._ready.wait(), timeout)
        if self.errored:
            raise EngineDeadError(self.dead_reason)

    async def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.to_thread(self.engine.shutdown)

    # ---- the EngineClient interface of the API room ----------------------------------------------------------
    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool, template_kwargs: dict[str, Any],
        add_special_tokens: bool = False,
    ) -> list[int]:
        self._check_generates()
        return self._inputs().render_chat(messages, add_generation_prompt, template_kwargs, add_special_tokens)

    def decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def tokenize(self, prompt: str, add_special_tokens: bool, split_special_tokens: bool = False) -> list[int]:
        return self._inputs().tokenize(prompt, add_special_tokens=add_special_tokens,
                                       split_special_tokens=split_special_tokens).token_ids

    def tokenize_pair(self, first: str, second: str) -> tuple[list[int], int]:
        """A cross-encoder's input: both texts as the tokenizer joins a pair ([CLS] first [SEP] second [SEP] for
        BERT), and where the second starts; a yes/no reranker's: the pair written into its prompt (YES_NO_PAIR),
        one segment. ValueError when a text is empty or the pair does not fit the model."""
        inputs = self._inputs()
        if not first or not second:
            raise ValueError("a text of the pair is empty")
        max_chars = self.max_model_len * MAX_PROMPT_CHARS_PER_TOKEN
        if len(first) + len(second) > max_chars:
            raise PromptTooLongError(f"This model's maximum context length is {self.max_model_len} tokens. However, "
                                     f"the pair has {len(first) + len(second)} characters, more than fit.")
        if self.pooling is not None and self.pooling.yes_no:
            # The pair's texts stay text: a special token's spelling inside them is not that token (as the chat
            # path keeps user content); only the prefix's and suffix's markers are.
            pair = YES_NO_PAIR.format(instruction=YES_NO_INSTRUCTION, query=first, document=second)
            token_ids = [*self.tokenizer.encode(YES_NO_PREFIX, add_special_tokens=False),
                         *self.tokenizer.encode(pair, add_special_tokens=False, split_special_tokens=True),
                         *self.tokenizer.encode(YES_NO_SUFFIX, add_special_tokens=False)]
            inputs.check_pooling_length(len(token_ids))
            return token_ids, len(token_ids)
        encoded = self.tokenizer(first, second, return_token_type_ids=True)
        token_ids, types = list(encoded["input_ids"]), list(encoded["token_type_ids"])
        inputs.check_pooling_length(len(token_ids))
        return token_ids, types.index(1) if 1 in types else len(token_ids)

    def detokenize(self, token_ids: list[int]) -> str:
        inputs = self._inputs()
        bad = next((t for t in token_ids if not 0 <= t < inputs.vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {inputs.vocab_size})")
        return self.tokenizer.decode(token_ids)

    async def generate(
        self, prompt: Prompt, params: SamplingParams, request_id: str, priority: int = 0,
        arrival_time: float | None = None, final_only: bool = False, cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields delta outputs until the request finishes (with `final_only`, the whole output once, at the end).
        Closing the iterator early aborts the request. Requests hit each other's cached prefix blocks only when
        their `cache_salt` is the same (None included).

        `arrival_time` (a lmserve.metrics.clock stamp) is when the request reached the caller; default: now.
        """
        self._check_generates()
        inputs = self._inputs()
        arrival = now() if arrival_time is None else arrival_time
        if request_id in self.streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        inputs.check_params(params, priority)  # before the tokenizer spends anything on the prompt
        self._check_queue_room(params.n)
        if params.structured_outputs is not None:
            await check_grammar(params)
        processed = inputs.tokenize(prompt, truncate_to=params.truncate_prompt_tokens)
        requests = [inputs.make_request(request_id, processed, p, priority, arrival, cache_salt)
                    for p in child_params(params)]
        child_ids = self.output_processor.add_request(
            request_id, processed.text, processed.token_ids, [r.sampling_params for r in requests]
        )
        self.timelines.add(request_id, child_ids, arrival, now(), len(processed.token_ids),
                           requests[0].sampling_params.max_tokens)
        stream = self.streams[request_id] = RequestStream()
        finished = False
        try:
            parent_id = request_id if len(requests) > 1 else None
            for index, (child_id, request) in enumerate(zip(child_ids, requests, strict=True)):
                self.queued.add(child_id)
                self._send(AddRequest(child_id, request.prompt_token_ids, request.sampling_params,
                                      request.eos_token_ids, priority, arrival, parent_id, index, cache_salt))
            while not finished:
                out = await stream.get()
                finished = out.finished
                if not final_only:
                    yield out
                elif finished and (parent := self.output_processor.get_parent(request_id)) is not None:
                    yield parent.full_output()
        finally:
            # Runs on normal end, on error, and when the consumer goes away (cancel or aclose).
            self.streams.pop(request_id, None)
            self.queued.difference_update(child_ids)
            if not finished:
                self.timelines.abort(request_id)
                self._abort_now(request_id)
            self.output_processor.remove(request_id)

    def _check_generates(self) -> None:
        if self.pooling is not None:
            raise ValueError(f"the model {self.model_name!r} is an embedding model: it serves /v1/embeddings, not "
                             "text generation (serve a generative model for completions and chat)")

    async def embed(
        self, prompt: Prompt, params: PoolingParams, request_id: str, priority: int = 0,
        arrival_time: float | None = None,
    ) -> PoolingOutput:
        """One prompt's pooled vector: a pooling request through the same engine queue, token budget and timelines
        as a generation, that ends with its vector. ValueError for bad input (a prompt longer than the model, a
        generative model); cancelling the call aborts the request."""
        if self.pooling is None:
            raise ValueError(f"the model {self.model_name!r} generates text: it has no embeddings (serve an "
                             "embedding model, such as a BERT sentence-transformers directory, for /v1/embeddings)")
        inputs = self._inputs()
        arrival = now() if arrival_time is None else arrival_time
        if request_id in self.streams or request_id in self._pooled:
            raise ValueError(f"request id {request_id!r} is already in use")
        inputs.check_params(SamplingParams(max_tokens=1), priority)  # the scheduling policy's priority rule
        self._check_queue_room(1)
        processed = inputs.tokenize(prompt, truncate_to=params.truncate_prompt_tokens, pooling=True)
        inputs.check_pooling_length(len(processed.token_ids))
        self.timelines.add(request_id, [request_id], arrival, now(), len(processed.token_ids))  # no max_tokens
        future = self._pooled[request_id] = asyncio.get_running_loop().create_future()
        finished = False
        try:
            self.queued.add(request_id)
            self._send(AddRequest(request_id, processed.token_ids, SamplingParams(max_tokens=1), [], priority,
                                  arrival, pooling_params=params))
            vector = await future
            finished = True
            return PoolingOutput(request_id, processed.token_ids, vector)
        finally:
            self._pooled.pop(request_id, None)
            self.queued.discard(request_id)
            if not finished:
                self.timelines.abort(request_id)
                if not self.errored:
                    try:
                        self._send(AbortRequests([request_id]))
                    except EngineDeadError:
                        pass

    async def abort(self, request_id: str) -> None:
        self.timelines.abort(request_id)
        self._abort_now(request_id)

    def get_timelines(self, request_id: str) -> list[RequestTimeline]:
        """The timelines of a request's engine requests (one per choice), finished or not; empty if unknown."""
        return self.timelines.get(request_id)

    def pop_timelines(self, request_id: str) -> list[RequestTimeline]:
        """Like get_timelines, and forgets them: the caller records them once its response is written."""
        return self.timelines.pop(request_id)

    async def get_stats(self, request_ids: list[str] | None = None) -> dict:
        """The engine's counters; under data parallel their sums, and in `engines` each replica's own (one entry,
        the same counters, for a single engine), so that a consumer reads one shape."""
        stats = await self.engine_stats(request_ids or [])
        flat = {f: getattr(stats, f) for f in stats.__struct_fields__ if f != "engines"}
        replicas = stats.engines or [stats]
        flat["engines"] = [
            {"engine": str(index), **{f: getattr(r, f) for f in r.__struct_fields__ if f not in PER_REQUEST_FIELDS}}
            for index, r in enumerate(replicas)
        ]
        return flat

    async def engine_stats(self, request_ids: list[str]) -> EngineStats:
        if self.errored:
            raise EngineDeadError(self.dead_reason)
        call_id = next(self._call_ids)
        future = self._calls[call_id] = asyncio.get_running_loop().create_future()
        self._send(GetStats(call_id, request_ids))
        try:
            return await asyncio.wait_for(future, timeout=10)
        finally:
            self._calls.pop(call_id, None)

    # ---- internals -----------------------------------------------------------------------------------------
    def _inputs(self) -> InputProcessor:
        if self.errored:
            raise EngineDeadError(self.dead_reason)
        if self.input_processor is None:
            raise EngineNotReadyError("the engine is still loading the model")
        return self.input_processor

    def num_waiting(self, num_new: int = 0) -> int:
        """Engine requests that must wait (with `num_new` more): not yet in any step, beyond the running slots still
        free. A burst on an idle server is admitted at the next step; it does not queue."""
        num_running = len(self.output_processor.children) - len(self.queued)
        slots = self.config.scheduler.max_num_seqs * self.config.parallel.data_parallel_size  # per replica
        free_slots = max(0, slots - num_running)
        return max(0, len(self.queued) + num_new - free_slots)

    def _check_queue_room(self, num_new: int) -> None:
        limit = self.max_queued_requests
        if limit is not None and self.num_waiting(num_new) > limit:
            raise QueueFullError(
                f"the server is overloaded: {self.num_waiting()} requests already wait for the engine "
                f"(--max-queued-requests {limit}); retry later"
            )

    def _send(self, message: EngineInput) -> None:
        if self.errored:
            raise EngineDeadError(self.dead_reason)
        if not self.engine.send(message):
            if not self.is_ready:
                raise EngineNotReadyError("the engine is still starting; retry shortly")
            self._engine_dead("the engine process is gone (its input socket has no reader)")
            raise EngineDeadError(self.dead_reason)

    def _abort_now(self, request_id: str) -> None:
        child_ids = self.output_processor.child_ids(request_id)
        if child_ids and not self.errored:
            try:
                self._send(AbortRequests(child_ids))
            except EngineDeadError:
                pass  # the engine's requests died with it
        self.output_processor.remove(request_id)

    async def _output_loop(self) -> None:
        while True:
            message = await self.engine.recv()
            if isinstance(message, StepOutputs):
                self._deliver(message)
            elif isinstance(message, StatsReply):
                future = self._calls.get(message.call_id)
                if future is not None and not future.done():
                    future.set_result(message.stats)
            elif isinstance(message, Ready):
                self.max_model_len = message.max_model_len
                self.input_processor = InputProcessor(
                    self.tokenizer, message.max_model_len, message.vocab_size,
                    max_num_seqs=self.config.scheduler.max_num_seqs,
                    scheduling_policy=self.config.scheduler.policy, model_eos_token_ids=[*message.eos_token_ids, *self.tokenizer_eos_token_ids],
                    default_max_tokens=self.default_sampling.get("max_tokens"), chat_format=self.chat_format,
                )
                self.is_ready = True
                self._ready.set()
                logger.info("engine ready: %d KV blocks, max_model_len %d", message.num_blocks, message.max_model_len)
            elif isinstance(message, RequestRejected):
                stream = self.streams.get(self.output_processor.parent_id_of(message.request_id) or "")
                if stream is not None:
                    stream.fail(ValueError(message.message))
            elif isinstance(message, EngineFailed):
                self._engine_dead(f"engine failed: {message.message}")

    def _deliver(self, message: StepOutputs) -> None:
        self.timelines.on_engine_message(message)
        if message.step is not None and self.queued:
            self.queued.difference_update(message.step.prefill)
            self.queued.difference_update(message.step.decode)
        for finished in (o.request_id for o in message.outputs if o.finish_reason is not None):
            self.queued.discard(finished)
        if self._pooled:
            self._deliver_pooled(message)
        if message.step is not None and self.on_step is not None:
            try:
                self.on_step(message.step)
            except Exception:  # a broken observer must not stop the outputs
                logger.exception("the step observer failed")
        processed = self.output_processor.process_outputs(message.outputs)
        if processed.requests_to_abort:
            try:
                self._send(FinishRequests(processed.requests_to_abort))
            except EngineDeadError:
                pass
        for delta in processed.deltas:
            parent = self.output_processor.get_parent(delta.request_id)
            for out in delta.outputs if parent is not None else ():
                child = parent.children[out.index]
                self.timelines.on_text(child.request_id, bool(out.text), len(child.output.token_ids),
                                       out.finish_reason)
            stream = self.streams.get(delta.request_id)
            if stream is not None:
                stream.put(delta)

    def _deliver_pooled(self, message: StepOutputs) -> None:
        """Pooling requests' vectors to their callers; an output without one (an abort) fails the call."""
        for output in message.outputs:
            future = self._pooled.get(output.request_id)
            if future is None or future.done():
                continue
            if output.pooled is not None:
                self.timelines.on_text(output.request_id, True, 0, output.finish_reason)
                future.set_result(output.pooled)
            elif output.finish_reason is not None:
                future.set_exception(ValueError(f"the engine ended the request ({output.finish_reason})"))

    async def _watch_engine(self) -> None:
        while self.engine.is_alive:
            await asyncio.sleep(ENGINE_CHECK_INTERVAL_S)
        if not self.errored:
            # Exit code 0 is a clean stop on a signal (SIGTERM to the process group: systemd, `timeout`): with nothing
            # in flight, nothing failed.
            stopped = self.engine.exitcode == 0 and not self.streams
            self._engine_dead(self.engine.exit_description(), logging.INFO if stopped else logging.ERROR)

    def _engine_dead(self, reason: str, level: int = logging.ERROR) -> None:
        logger.log(level, "%s; failing %d in-flight requests", reason, len(self.streams))
        self.errored, self.is_ready, self.dead_reason = True, False, reason
        self._ready.set()
        for stream in self.streams.values():
            stream.fail(EngineDeadError(reason))
        for future in self._pooled.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))
        if self.on_engine_dead is not None:
            self.on_engine_dead()

