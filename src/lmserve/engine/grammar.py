"""Each constrained request's grammar matcher, in the engine (vLLM V1's StructuredOutputManager, smaller).

Grammars compile against the vocabulary on one background thread, so a slow schema never stalls the step loop: a
request waits in the queue until its grammar is ready, and the others run meanwhile. xgrammar caches compiled
grammars by their text, so a schema seen before is ready at once. The matcher lives with the request: preempted and
recomputed, the request keeps the matcher that accepted its output tokens, so nothing needs replaying.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from lmserve.engine.request import Request
from lmserve.model_tokenizer import load_tokenizer
from lmserve.models import resolve_model
from lmserve.step import GrammarMasks
from lmserve.structured_output import TokenMatcher, build_grammar, xgrammar

logger = logging.getLogger(__name__)

MASK_THREADS = 1  # xgrammar's threads for one step's masks (the forward pass has the cores)
# Grammars compiling at once: a slow one (a large schema) must not hold up the other constrained requests' grammars.
COMPILE_THREADS = 4


@dataclass
class GrammarState:
    compiled: Future
    matcher: TokenMatcher | None = None  # xgrammar.GrammarMatcher once compiled
    error: str | None = None
    # The token the grammar starts after (StructuredOutputsParams.after_token_id) until the request samples it.
    waiting_for: int | None = None

    @property
    def ready(self) -> bool:
        return self.matcher is not None or self.error is not None


class GrammarManager:
    def __init__(self, tokenizer_name: str, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.tokenizer_name = tokenizer_name
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._executor = ThreadPoolExecutor(max_workers=COMPILE_THREADS, thread_name_prefix="grammar")
        self._batch_matcher: Any = None
        self._compiler: Any = None  # built on the first constrained request: most servers never need one
        self._compiler_lock = threading.Lock()

    def add(self, request: Request) -> None:
        spec = request.sampling_params.structured_outputs
        if spec is not None:
            request.grammar = GrammarState(self._executor.submit(self._compile, *spec.key),
                                           waiting_for=spec.after_token_id)
            if spec.after_token_id is not None and spec.after_token_id in request.output_token_ids:
                request.grammar.waiting_for = None  # resumed after a preemption past the thinking

    def _compile(self, kind: str, text: str, json_whitespace: bool) -> Any:
        xgr = xgrammar()
        with self._compiler_lock:  # built once, by the first of the threads
            self._make_compiler(xgr)
        return self._compiler.compile_grammar(build_grammar(kind, text, json_whitespace))

    def _make_compiler(self, xgr: Any) -> None:
        if self._compiler is None:
            tokenizer = load_tokenizer(resolve_model(self.tokenizer_name))
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.eos_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)

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

    def batch(self, requests: list[Request]) -> GrammarBatch | None:
        """The grammars of the constrained requests among this step's sampling ones (None when there are none)."""
        constrained = [r for r in requests if r.grammar is not None and r.grammar.matcher is not None
                       and r.grammar.waiting_for is None]
        if not constrained:
            return None
        if self._batch_matcher is None:
            self._batch_matcher = xgrammar().BatchGrammarMatcher(MASK_THREADS)
        return GrammarBatch(
            {r.request_id: r.grammar.matcher for r in constrained},
            [r.request_id for r in constrained if not _exact_by_rejection(r) or _seeded_draw(r)],
            self._batch_matcher, self.vocab_size,
        )

    @staticmethod
    def accept(request: Request, token_id: int) -> bool:
        """Advances the request's matcher; True when the grammar has ended (the request is complete)."""
        state = request.grammar
        if state is None or state.matcher is None:
            return False
        if state.waiting_for is not None:  # still thinking: the grammar starts after this token
            if token_id == state.waiting_for:
                state.waiting_for = None
            return False
        if not state.matcher.accept_token(token_id):
            logger.warning("request %s sampled token %d outside its grammar", request.request_id, token_id)
            return True
        return state.matcher.is_terminated()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)



def _seeded_draw(request: Request) -> bool:
    """A seeded random request is masked before its draw too. Both ways give the masked distribution, but they
    consume the seed's stream differently, and ranks in other processes can only mask first (their masks come
    precomputed): a seeded request must draw the same tokens whichever executor runs it."""
    params = request.sampling_params
    return params.seed is not None and not params.greedy


def _exact_by_rejection(request: Request) -> bool:
    """Whether drawing without the mask and redrawing with it only when the token breaks the grammar gives exactly
    the masked distribution. It does for greedy rows (the argmax, if allowed, is the masked argmax) and for plain
    temperature sampling (rejection sampling: p(t) + (1 - p(A)) p(t) / p(A) = p(t) / p(A) for t in the allowed set
    A). top-k, top-p and min-p cut the distribution before drawing, and cutting the masked one is not the same, so
    those rows get their mask up front."""
    params = request.sampling_params
    return params.greedy or (params.top_k == 0 and params.top_p >= 1.0 and params.min_p == 0.0)


@dataclass
class GrammarBatch:
    """One step's constrained requests, for the runner's sampler (lmserve.step.StepGrammar, with live matchers).

    A mask costs up to a millisecond per request (xgrammar checks every token one by one inside a maxLength string,
    and holds the GIL for a single fill), while the model's own choice is almost always allowed. So the runner
    draws first and fills masks only for the requests whose token the grammar refuses, and for those whose sampling
    needs the mask up front (`masked_first`).
    """

    matchers: dict[str, TokenMatcher]  # request id -> xgrammar.GrammarMatcher
    masked_first: list[str]
    batch_matcher: Any
    vocab_size: int

    def fill(self, request_ids: list[str]) -> Any:
        """The allowed next tokens of these requests, packed as xgrammar's bitmask (int32, one row each)."""
        mask = xgrammar().allocate_token_bitmask(len(request_ids), self.vocab_size)
        self.batch_matcher.batch_fill_next_token_bitmask([self.matchers[r] for r in request_ids], mask)
        return mask

    @property
    def request_ids(self) -> Collection[str]:
        return self.matchers.keys()

    def allows(self, request_id: str, token_id: int) -> bool:
        matcher = self.matchers[request_id]
        if not matcher.accept_token(token_id):
            return False
        matcher.rollback(1)  # only a test: the engine accepts the token after the step
        return True

    def accept(self, request_id: str, token_id: int) -> bool:
        return self.matchers[request_id].accept_token(token_id)

    def rollback(self, request_id: str, num_tokens: int) -> None:
        self.matchers[request_id].rollback(num_tokens)

    def for_ranks_elsewhere(self) -> GrammarMasks:
        """The same constraints for ranks in other processes, which cannot reach the matchers: every row masked
        before its first draw (the masked distribution, as masked_first gives it). Its mask is fill_all()'s."""
        ids = list(self.matchers)
        return GrammarMasks({rid: i for i, rid in enumerate(ids)}, ids)

    def fill_all(self) -> Any:
        """Every row's mask, in for_ranks_elsewhere()'s row order."""
        return self.fill(list(self.matchers))
