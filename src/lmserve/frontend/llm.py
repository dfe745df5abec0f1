"""The offline entry point: the engine core in-process, no server, vLLM's LLM interface."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any, Self

from lmserve.config import DEFAULT_MODEL, make_engine_config
from lmserve.engine.core import EngineCore
from lmserve.engine.request import Request
from lmserve.frontend.input_processor import InputProcessor, Prompt, child_params
from lmserve.frontend.output_processor import OutputProcessor
from lmserve.frontend.tokenizer import load_frontend_tokenizer, tokenizer_chat_format, tokenizer_eos_token_ids
from lmserve.generation_config import default_sampling
from lmserve.models import read_config_dict, resolve_model
from lmserve.outputs import PoolingOutput, RequestOutput
from lmserve.plan.layout import check_layout
from lmserve.pooling_config import is_pooling_model, load_pooling_config
from lmserve.pooling_params import PoolingParams
from lmserve.sampling_params import SamplingParams
from lmserve.structured_output import check_structured_outputs

# vLLM's prompt dicts (TextPrompt, TokensPrompt): the one key each that this engine reads.
PROMPT_DICT_KEYS = ("prompt", "prompt_token_ids")


def plain_prompt(prompt: object) -> Prompt:
    """A prompt as text or token ids, from any shape vLLM's LLM.generate takes: a string, a list of ids, or a
    TextPrompt ({"prompt": str}) / TokensPrompt ({"prompt_token_ids": [int, ...]}) dict. Anything else is refused
    in words (a dict must not be read as a sequence of token ids: its keys are no ids)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict):
        keys = set(prompt)
        unknown = sorted(map(str, keys - set(PROMPT_DICT_KEYS)))
        if unknown:
            raise ValueError(f"a prompt dict takes 'prompt' (vLLM's TextPrompt) or 'prompt_token_ids' (TokensPrompt); "
                             f"{', '.join(repr(k) for k in unknown)} is not supported here")
        if len(keys) != 1:
            raise ValueError("a prompt dict takes exactly one of 'prompt' (text) and 'prompt_token_ids' (token ids)")
        if "prompt" in prompt:
            if not isinstance(prompt["prompt"], str):
                raise ValueError(f"a TextPrompt's 'prompt' must be a string, got {type(prompt['prompt']).__name__}")
            return prompt["prompt"]
        ids = prompt["prompt_token_ids"]
        if not isinstance(ids, Sequence) or isinstance(ids, str | bytes) or \
                not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ValueError("a TokensPrompt's 'prompt_token_ids' must be a list of integer token ids")
        return list(ids)
    if isinstance(prompt, Sequence) and not isinstance(prompt, bytes) and \
            all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
        return list(prompt)
    raise ValueError(f"a prompt is a string, a list of token ids, or a dict with 'prompt' or 'prompt_token_ids'; "
                     f"got {type(prompt).__name__}")


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, **kwargs: Any) -> None:
        """Keyword arguments are those of lmserve.config.make_engine_config (dtype, max_model_len, num_blocks, ...)."""
        self.config = make_engine_config(model, **kwargs)
        if self.config.parallel.data_parallel_size > 1:
            # Replicas are separate engine processes behind the server's router; the offline engine is one
            # in-process engine, and one batch is better served by one engine than split across several.
            raise ValueError(
                f"data_parallel_size={self.config.parallel.data_parallel_size}: data parallel is a server feature; "
                f"use `lmserve serve -dp {self.config.parallel.data_parallel_size}` (offline LLM runs one engine)"
            )
        check_layout(self.config)  # the model splits as asked and the ranks fit: before any weight loads
        self.tokenizer = load_frontend_tokenizer(self.config.model)
        self.default_sampling = default_sampling(
            resolve_model(model), self.config.model.generation_config, self.config.model.override_generation_config
        )
        self.engine = EngineCore(self.config)
        self.input_processor = InputProcessor(
            self.tokenizer, self.engine.max_model_len, self.engine.vocab_size,
            scheduling_policy=self.config.scheduler.policy, model_eos_token_ids=[*self.engine.eos_token_ids, *tokenizer_eos_token_ids(self.config.model, self.tokenizer)],
            chat_format=tokenizer_chat_format(self.config.model, self.tokenizer),
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | dict | Sequence[Prompt | dict],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion in one continuous batch; outputs come back in prompt order."""
        if isinstance(prompts, str | dict) or (isinstance(prompts, Sequence) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = [plain_prompt(p) for p in prompts]  # type: ignore[union-attr]
        params = self._per_prompt(sampling_params, len(prompts))
        ids: list[str] = []
        try:
            for i, (p, sp) in enumerate(zip(prompts, params)):
                ids.append(self._add(p, sp, priority[i] if priority else 0))
        except Exception:
            # A bad prompt rejects the whole call: drop the ones already queued, as vLLM does.
            for request_id in ids:
                self.engine.abort_requests(self.output_processor.child_ids(request_id))
                self.output_processor.remove(request_id)
            raise
        done: dict[str, RequestOutput] = {}
        for output in self._run():
            done[output.request_id] = output
        return [done[i] for i in ids]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        ids = [
            self.input_processor.render_chat(conv, add_generation_prompt, chat_template_kwargs or {})
            for conv in conversations  # type: ignore[arg-type]
        ]
        return self.generate(ids, sampling_params)

    def embed(self, prompts: Prompt | dict | Sequence[Prompt | dict],
              pooling_params: PoolingParams | None = None) -> list[PoolingOutput]:
        """Each prompt's pooled vector (an embedding model, vLLM's LLM.embed), in prompt order, in one continuous
        batch. Texts are tokenized with the model's special tokens, as the server's /v1/embeddings does."""
        source = resolve_model(self.config.model.model)
        if not is_pooling_model(source):
            raise ValueError(f"the model {self.config.model.model!r} generates text: it has no embeddings")
        params = pooling_params or PoolingParams()
        if params.dimensions is not None:
            pooling = load_pooling_config(source)
            size = pooling.output_size(int(read_config_dict(source)["hidden_size"]))
            if not pooling.accepts_dimensions(params.dimensions, size):
                raise ValueError(f"invalid pooling parameter dimensions={params.dimensions}: the model declares "
                                 f"{list(pooling.matryoshka_dimensions) or 'no'} Matryoshka dimensions")
        if isinstance(prompts, str | dict) or (isinstance(prompts, Sequence) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        added: list[tuple[str, list[int]]] = []
        try:
            for prompt in prompts:  # type: ignore[union-attr]
                processed = self.input_processor.tokenize(plain_prompt(prompt), pooling=True,
                                                          truncate_to=params.truncate_prompt_tokens)
                request_id = f"embed-{next(self._ids)}"
                self.engine.add_request(Request(request_id, processed.token_ids, SamplingParams(max_tokens=1),
                                                pooling_params=params))
                added.append((request_id, processed.token_ids))
        except Exception:
            self.engine.abort_requests([request_id for request_id, _ in added])  # one bad prompt fails the call
            raise
        vectors: dict[str, bytes] = {}
        while self.engine.has_unfinished_requests():
            vectors.update((o.request_id, o.pooled) for o in self.engine.step() if o.pooled is not None)
        return [PoolingOutput(request_id, token_ids, vectors[request_id]) for request_id, token_ids in added]

    def stream(self, prompt: Prompt | dict, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yields text deltas of one request as the engine produces them."""
        request_id = self._add(plain_prompt(prompt), sampling_params or self.get_default_sampling_params(), 0)
        while self.engine.has_unfinished_requests():
            processed = self._step()
            yield from (d for d in processed if d.request_id == request_id)
        self.output_processor.remove(request_id)

    def shutdown(self) -> None:
        """Stops the engine's ranks (processes or Ray actors with more than one rank); idempotent."""
        self.engine.shutdown()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def get_default_sampling_params(self) -> SamplingParams:
        """As vLLM's: SamplingParams with the model's generation_config.json defaults (--generation-config)."""
        return SamplingParams(**self.default_sampling)

    def _per_prompt(self, params, n: int) -> list[SamplingParams]:
        if params is None:
            return [self.get_default_sampling_params()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        if len(params) != n:
            raise ValueError(f"got {len(params)} sampling params for {n} prompts")
        return list(params)

    def _add(self, prompt: Prompt, params: SamplingParams, priority: int) -> str:
        request_id = str(next(self._ids))
        if params.structured_outputs is not None:
            check_structured_outputs(params.structured_outputs)
        processed = self.input_processor.tokenize(prompt, truncate_to=params.truncate_prompt_tokens)
        children = child_params(params)
        requests = [
            self.input_processor.make_request(f"{request_id}", processed, p, priority) for p in children
        ]  # validates every child before anything is registered
        child_ids = self.output_processor.add_request(
            request_id, processed.text, processed.token_ids, [r.sampling_params for r in requests]
        )
        for index, (child_id, request) in enumerate(zip(child_ids, requests, strict=True)):
            request.request_id = child_id
            if len(requests) > 1:
                request.parent_id, request.index = request_id, index
            self.engine.add_request(request)
        return request_id

    def _step(self) -> list[RequestOutput]:
        processed = self.output_processor.process_outputs(self.engine.step())
        if processed.requests_to_abort:
            self.engine.finish_requests(processed.requests_to_abort)
        return processed.deltas

    def _run(self) -> Iterator[RequestOutput]:
        while self.engine.has_unfinished_requests():
            for delta in self._step():
                if delta.finished:
                    parent = self.output_processor.get_parent(delta.request_id)
                    assert parent is not None
                    yield parent.full_output()
                    self.output_processor.remove(delta.request_id)
