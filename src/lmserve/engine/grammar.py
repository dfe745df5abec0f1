"""Each constrained request's grammar matcher, in the engine (vLLM V1's StructuredOutputManager, smaller).

Grammars compile against the vocabulary on one background thread, so a slow schema never stalls the step loop: a
request waits in the queue until its grammar is ready, and the others run meanwhile. xgrammar caches compiled
grammars by their text, so a schema seen before is ready at once. The matcher lives with the request: preempted and
recomputed, the request keeps the matcher that accepted its output tokens, so nothing needs replaying.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from lmserve.engine.request import Request
from lmserve.models import load_tokenizer, resolve_model
from lmserve.structured_output import build_grammar, xgrammar

logger = logging.getLogger(__name__)


@dataclass
class GrammarState:
    compiled: Future
    matcher: Any = None  # xgrammar.GrammarMatcher once compiled
    error: str | None = None

    @property
    def ready(self) -> bool:
        return self.matcher is not None or self.error is not None


class GrammarManager:
    def __init__(self, tokenizer_name: str, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.tokenizer_name = tokenizer_name
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._compiler: Any = None  # built on the first constrained request: most servers never need one

    def add(self, request: Request) -> None:
        spec = request.sampling_params.structured_outputs
        if spec is not None:
            request.grammar = GrammarState(self._executor.submit(self._compile, *spec.key))

    def _compile(self, kind: str, text: str) -> Any:
        xgr = xgrammar()
        if self._compiler is None:
            tokenizer = load_tokenizer(resolve_model(self.tokenizer_name))
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.eos_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler.compile_grammar(build_grammar(kind, text))

    def is_ready(self, request: Request) -> bool:
        """Whether the request may be scheduled (a constrained one once its grammar compiled, or failed)."""
        state = request.grammar
        if state is None or state.ready:
            return True
        if not state.compiled.done():
            return False
        try:
            state.matcher = xgrammar().GrammarMatcher(state.compiled.result())
        except Exception as exc:  # noqa: BLE001 - the front-end checked the grammar; anything left fails one request
            logger.warning("grammar of request %s did not compile: %s", request.request_id, exc)
            state.error = str(exc)
        return True

    def bitmask(self, requests: list[Request]) -> tuple[Any, list[str]] | None:
        """The allowed next tokens of the constrained requests among these (packed bits, one row each), and their
        ids in row order; None when none is constrained."""
        constrained = [r for r in requests if r.grammar is not None and r.grammar.matcher is not None]
        if not constrained:
            return None
        xgr = xgrammar()
        mask = xgr.allocate_token_bitmask(len(constrained), self.vocab_size)
        for row, request in enumerate(constrained):
            request.grammar.matcher.fill_next_token_bitmask(mask, row)
        return mask, [r.request_id for r in constrained]

    @staticmethod
    def accept(request: Request, token_id: int) -> bool:
        """Advances the request's matcher; True when the grammar has ended (the request is complete)."""
        state = request.grammar
        if state is None or state.matcher is None:
            return False
        if not state.matcher.accept_token(token_id):
            logger.warning("request %s sampled token %d outside its grammar", request.request_id, token_id)
            return True
        return state.matcher.is_terminated()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
