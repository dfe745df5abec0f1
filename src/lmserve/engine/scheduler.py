"""The scheduler: one token budget per step, no prefill/decode phases.

Every request carries num_computed_tokens (positions whose K/V are in the cache) and each step hands out up to
max_num_batched_tokens positions so that it catches up with num_tokens. Prefill, chunked prefill, prefix-cache hits,
resumed requests and decode are all the same rule.

As in vLLM V1, schedule() advances num_computed_tokens as soon as it plans the positions, so the next step's plan
needs nothing from this step's output except the sampled tokens. After update_from_output a request that sampled has
num_computed_tokens == num_tokens - 1: its newest token is the one position the next step computes.

Batches in flight: pipeline stages keep one batch per stage in flight, and a request in one of them is not scheduled
again until its output is back. With async scheduling (one stage, vLLM's --async-scheduling) the engine plans the
next batch while the current one computes, and a request in that batch may go ahead (`_ahead`): for the rest of its
prompt (the chunk in flight samples nothing), or, when the batch in flight samples its next token, for that one
position with a placeholder token the runner fills in (ScheduledRequest.uses_previous_token). Its num_computed_tokens
is then num_tokens + 1 until the token arrives. A token that comes back for a request that ended meanwhile is
dropped; one for a request preempted meanwhile is kept (it is the token the request would sample next anyway).
"""

from __future__ import annotations

import bisect
import logging
from collections import Counter, deque
from collections.abc import Iterable

from lmserve.config import CacheConfig, SchedulerConfig
from lmserve.engine.grammar import GrammarManager
from lmserve.engine.kv_cache import KVCacheManager
from lmserve.engine.kv_transfer import KVConnectorScheduler, scheduler_connector
from lmserve.engine.outputs import EngineCoreOutput
from lmserve.engine.request import Request, RequestStatus
from lmserve.kv_groups import KVCacheGroups, kv_capacity_tokens
from lmserve.spec_decode.speculator import Speculator
from lmserve.step import PLACEHOLDER_TOKEN_ID, ModelRunnerOutput, ScheduledRequest, SchedulerOutput

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        max_model_len: int,
        grammar: GrammarManager | None = None,
        key_generated_blocks: bool = False,
        kv_groups: KVCacheGroups | None = None,
        draft_constrained: bool = True,
        world_size: int = 1,
        pooling: bool = False,
        num_state_slots: int = 0,
    ) -> None:
        """`grammar`: compiles and advances constrained requests' grammars (None: no structured output).
        `key_generated_blocks`: the model computes prompt and generated tokens differently (KVCacheManager).
        `kv_groups`: the model's KV-cache groups (None: one, full attention). `draft_constrained`: speculative
        drafts for constrained requests (the runner shares this process's grammar matchers). `world_size`: the
        engine's ranks, each of which stores its own part of a transferred block (--kv-transfer-config).
        `pooling`: the runner is a pooling runner (an encoder, worker/pooling_runner.py) that keeps no KV cache:
        every request is a pooling request, scheduled whole in one step, and no block is ever allocated for it.
        `num_state_slots`: a hybrid model's per-request state slots (KVCacheManager's StateSlots; 0: none): a request
        holds one from admission to its end, and one that cannot get one waits as for blocks."""
        self.config = scheduler_config
        self.pooling = pooling
        self.grammar = grammar
        # Outputs made outside a step's update (a grammar that failed to compile): returned by the next update.
        self._pending_outputs: list[EngineCoreOutput] = []
        self.cache_config = cache_config
        self.kv_groups = kv_groups
        windows = kv_groups.windows if kv_groups is not None else (0,)
        prefix_caching = cache_config.enable_prefix_caching
        if num_state_slots and prefix_caching:
            # A prefix hit would need the linear layers' state at the hit's end, which nothing keeps yet. vLLM does
            # the same for hybrid models without state snapshots: it turns prefix caching off and says so.
            logger.warning("prefix caching is off for this hybrid linear-attention model (a hit would need the "
                           "recurrent state at its end, which is not kept yet); --enable-prefix-caching ignored")
            prefix_caching = False
        self.kv_cache_manager = KVCacheManager(
            max(num_blocks, 1) if pooling else num_blocks,  # a pooling runner's: unused
            cache_config.block_size, prefix_caching, key_generated_blocks,
            windows=windows, max_chunk_tokens=scheduler_config.max_num_batched_tokens,
            num_state_slots=num_state_slots,
        )
        # A request longer than the whole pool could never be admitted again once preempted, so the pool caps
        # the usable context: such a request finishes with "length" instead of waiting forever.
        self.kv_capacity = kv_capacity_tokens(num_blocks, cache_config.block_size, max_model_len, kv_groups,
                                              scheduler_config.max_num_batched_tokens)
        self.configured_max_model_len = max_model_len
        self.max_model_len = max_model_len if pooling else min(max_model_len, self.kv_capacity)
        self.requests: dict[str, Request] = {}  # live (waiting or running) requests
        self.waiting: deque[Request] = deque()  # in admission order (see _enqueue)
        self.running: list[Request] = []  # in admission order, which is the order they get positions
        # Ended since the last schedule(): the next SchedulerOutput tells the runner to drop their state.
        self._finished_ids: set[str] = set()
        # Request id -> batches in flight that hold it (their output has not come back). Such a request waits for
        # its output before it is scheduled again, unless async scheduling lets it go ahead (_ahead).
        self._in_flight: Counter[str] = Counter()
        spec = scheduler_config.speculative_config
        self.speculator = Speculator(spec, draft_constrained) if spec is not None else None
        transfer = cache_config.kv_transfer_config
        self.kv_transfer: KVConnectorScheduler | None = (
            scheduler_connector(transfer, world_size, self.kv_cache_manager) if transfer is not None else None)

    # ---- queue management ----------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.num_prompt_tokens == 0:
            raise ValueError("the prompt must contain at least one token")
        if request.num_prompt_tokens > self.max_model_len:
            max_len = self.configured_max_model_len
            why = (
                f" (capped by the KV cache: {self.kv_capacity} positions)"
                if self.max_model_len < max_len
                else ""
            )
            raise ValueError(
                f"the prompt has {request.num_prompt_tokens} tokens, more than max_model_len="
                f"{self.max_model_len}{why}"
            )
        if (request.pooling_params is not None) != self.pooling:
            raise ValueError("this model is an embedding model: it serves pooling requests (/v1/embeddings) only"
                             if self.pooling else "this model generates text: it serves no pooling requests")
        if request.sampling_params.structured_outputs is not None:
            if self.grammar is None:
                raise ValueError("this engine has no grammar support for structured_outputs")
            self.grammar.add(request)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self._enqueue(request, front=False)

    def _next_admissible(self) -> Request | None:
        """The first waiting request that may start: one whose grammar is still compiling waits without holding up
        the others (vLLM's WAITING_FOR_FSM); one whose grammar failed ends here."""
        if self.grammar is None:
            head = self.waiting[0] if self.waiting else None
            return None if head is None or head.request_id in self._in_flight else head
        for request in list(self.waiting):
            if request.request_id in self._in_flight or not self.grammar.is_ready(request):
                continue
            if request.grammar is not None and request.grammar.error is not None:
                self._finish(request, RequestStatus.FINISHED_ABORTED)
                self._pending_outputs.append(self._output(request, []))
                continue
            return request
        return None

    def _priority_key(self, request: Request) -> tuple[float, float]:
        return (request.priority, request.arrival_time)

    def _enqueue(self, request: Request, front: bool) -> None:
        """FCFS: arrivals at the back, preempted requests at the front. Priority: ordered by (priority, arrival),
        where a preempted request goes ahead of equals, so resuming never jumps a more urgent request."""
        if self.config.policy == "priority":
            insert = bisect.bisect_left if front else bisect.bisect_right
            index = insert(self.waiting, self._priority_key(request), key=self._priority_key)
            self.waiting.insert(index, request)
        elif front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def abort_requests(self, request_ids: Iterable[str]) -> list[EngineCoreOutput]:
        """Ends live requests at once (blocks freed now). Unknown or already finished ids are ignored."""
        return self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[EngineCoreOutput]:
        """Ends live requests with the given finished status (abort, or a stop string found by the front-end).

        Returns one output per request that was still live; a runner output for them that is still in flight is
        ignored by update_from_output.
        """
        if not status.finished:
            raise ValueError(f"{status} is not a finished status")
        outputs = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            self._finish(request, status)
            outputs.append(self._output(request, []))
        return outputs

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = status
        self.kv_cache_manager.free(request)
        if self.speculator is not None:
            self.speculator.drop(request.request_id)
        if self.kv_transfer is not None:
            self.kv_transfer.drop(request.request_id)
        del self.requests[request.request_id]
        self._finished_ids.add(request.request_id)

    @staticmethod
    def _output(request: Request, new_token_ids: list[int], logprobs: list | None = None) -> EngineCoreOutput:
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            new_logprobs=logprobs or [],
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            num_cached_tokens=max(0, request.num_cached_tokens),
            num_preemptions=request.num_preemptions,
        )

    # ---- scheduling ----------------------------------------------------------------------------------------

    def _cap(self, num_tokens: int, budget: int) -> int:
        threshold = self.config.long_prefill_token_threshold
        if threshold > 0:
            num_tokens = min(num_tokens, threshold)
        return min(num_tokens, budget)

    def _pick_victim(self) -> Request:
        """The lowest-priority running request: latest arrival (FCFS), or largest priority value, then latest."""
        by_priority = self.config.policy == "priority"

        def rank(item: tuple[int, Request]) -> tuple[bool, float, float, int]:
            index, request = item
            # A request whose blocks are loading goes last: preempting it throws the load away (safe all the same:
            # a rank finishes a load before any step that may reuse its blocks).
            return (not request.kv_loading, request.priority if by_priority else 0, request.arrival_time, index)

        return max(enumerate(self.running), key=rank)[1]

    def _blocks_promised_to_prefills(self) -> int:
        """Blocks that admitted requests still need to finish their prompts (chunked prefill in progress)."""
        kv = self.kv_cache_manager
        return sum(kv.num_blocks_to_finish(r) for r in self.running if r.num_computed_tokens < r.num_tokens - 1)

    def _ahead(self, request: Request) -> tuple[int, bool]:
        """For a request in a batch still in flight: the positions it may take now (0: it waits for that batch's
        output), and whether they are the one position of the token that batch samples (a placeholder)."""
        if (
            not self.config.async_scheduling
            or self._in_flight[request.request_id] > 1
            # Kept synchronous: a grammar must accept the previous token before it can mask the next one, and
            # prompt logprobs are kept off this path for simplicity.
            or request.grammar is not None
            or request.sampling_params.prompt_logprobs is not None
        ):
            return 0, False
        known = request.num_tokens - request.num_computed_tokens
        if known > 0:
            return known, False  # the rest of its prompt: the chunk in flight samples nothing
        if known < 0:
            return 0, False  # already planned ahead of its token
        # The batch in flight samples its next token. Not past max_tokens or max_model_len, counting that token.
        max_tokens = request.sampling_params.max_tokens
        if (max_tokens is not None and request.num_output_tokens + 1 >= max_tokens) or (
            request.num_tokens + 1 >= self.max_model_len
        ):
            return 0, False
        return 1, True

    def _draft_room(self, request: Request, budget: int) -> int:
        """How many drafts a decoding request may verify this step: what the budget leaves beyond its own position,
        no position at or past max_model_len, and no more tokens than max_tokens still allows."""
        room = min(budget - 1, self.max_model_len - request.num_tokens)
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - request.num_output_tokens - 1)
        return room

    def _schedule_one(self, request: Request, num_new_tokens: int, placeholder: bool = False,
                      drafts: list[int] | None = None) -> ScheduledRequest:
        start = request.num_computed_tokens
        request.num_computed_tokens += num_new_tokens
        # A decode needs one token; token_slice past the prompt would copy prompt + outputs every step.
        if placeholder:
            token_ids = [PLACEHOLDER_TOKEN_ID]
        elif drafts:
            token_ids = [request.token_at(start), *drafts]
        elif num_new_tokens == 1:
            token_ids = [request.token_at(start)]
        else:
            token_ids = request.token_slice(start, start + num_new_tokens)
        scheduled = ScheduledRequest(
            request_id=request.request_id,
            token_ids=token_ids,
            start_position=start,
            block_ids=self.kv_cache_manager.block_ids(request.request_id),
            state_slot=self.kv_cache_manager.state_slot(request.request_id),
            group_block_ids=(self.kv_cache_manager.group_block_ids(request.request_id)
                             if self.kv_cache_manager.num_groups > 1 else []),
            samples=request.pooling_params is None and (placeholder or bool(drafts)
                                                        or start + num_new_tokens == request.num_tokens),
            sampling_params=request.sampling_params,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            eos_token_ids=request.eos_token_ids,
            uses_previous_token=placeholder,
            draft_token_ids=drafts or [],
            pooling_params=request.pooling_params,
        )
        if request.num_prompt_logprobs_missing:
            # Position p's logits score prompt token p + 1; positions scored before a preemption are not redone.
            first = max(start, len(request.prompt_logprobs))
            end = min(start + num_new_tokens, request.num_prompt_tokens - 1)
            if first < end:
                scheduled.prompt_logprob_targets = request.prompt_token_ids[first + 1 : end + 1]
                scheduled.prompt_logprobs_row = first - start
                scheduled.num_prompt_logprobs = request.sampling_params.prompt_logprobs or 0
        return scheduled

    def _preempt(self, victim: Request, scheduled: dict[str, ScheduledRequest]) -> int:
        """Frees the victim's blocks and requeues it at the front; returns the budget it gives back. A victim in a
        batch still in flight is safe to free: the runner computes batches in order, so that batch writes the freed
        blocks before any later batch may reuse them, and its sampled token is still appended."""
        given_back = 0
        planned = scheduled.pop(victim.request_id, None)
        if planned is not None:
            # Take back this step's plan first, so the cache drops blocks whose K/V will now never be written.
            victim.num_computed_tokens = planned.start_position
            given_back = planned.num_tokens
        self.running.remove(victim)
        self.kv_cache_manager.free(victim)
        victim.num_computed_tokens = 0  # recompute: prompt and outputs so far become its prompt
        victim.kv_loading = False  # its load is thrown away; admitted again, it may pin and load anew
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self._enqueue(victim, front=True)
        return given_back

    def schedule(self) -> SchedulerOutput:
        kv = self.kv_cache_manager
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, ScheduledRequest] = {}  # insertion order = batch order
        preempted: set[str] = set()

        # Running requests first, in order: decodes take one position each, unfinished prefills what they can.
        for request in list(self.running):
            if budget <= 0:
                break
            if request.status != RequestStatus.RUNNING or request.kv_loading or request.pooling_params is not None:
                # Preempted earlier in this loop, its stored blocks still being read in, or a pooling request (its
                # one step is in flight: it ends when that step's output comes back).
                continue
            placeholder = False
            if self._in_flight[request.request_id]:
                num_new, placeholder = self._ahead(request)
            else:
                num_new = request.num_tokens - request.num_computed_tokens
            num_new = self._cap(num_new, budget)
            if num_new <= 0:
                continue
            if num_new == 1 and not placeholder and self.speculator is not None:
                drafts = self.speculator.drafts(request, self._draft_room(request, budget))
                # Drafts never preempt anyone: without the blocks for them, the request decodes plainly.
                if drafts and kv.allocate_slots(request, 1 + len(drafts)):
                    scheduled[request.request_id] = self._schedule_one(request, 1 + len(drafts), drafts=drafts)
                    budget -= 1 + len(drafts)
                    continue
            while not kv.allocate_slots(request, num_new):
                victim = self._pick_victim()
                budget += self._preempt(victim, scheduled)
                preempted.add(victim.request_id)
                if victim is request:
                    break
            else:
                scheduled[request.request_id] = self._schedule_one(request, num_new, placeholder)
                budget -= num_new

        # Then waiting requests, in policy order, with what is left. Never in a step that preempted: the blocks
        # just freed belong to the preempted requests at the head of the queue, and taking them would start a storm.
        promised = self._blocks_promised_to_prefills() if self.waiting and not preempted else 0
        kv_loads: list[tuple[str, int, str]] = []
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self._next_admissible()
            if request is None:
                break
            if request.pooling_params is not None:
                if not self._admit_pooling(request, budget, scheduled):
                    break
                budget -= request.num_tokens
                continue
            hits, num_hit = kv.get_computed_blocks(request, record_stats=False)
            # Admit only when the whole remaining prompt fits in blocks nobody else was promised, so an admitted
            # prefill is never preempted by its own later chunks, nor by another admitted prefill's.
            # Head-of-line: if it does not fit, nobody behind it jumps ahead.
            if not kv.can_fit(request, request.num_tokens, hits, reserved=promised):
                break
            # Blocks a prefill instance stored (--kv-transfer-config): allocated like computed ones and read in by
            # the ranks beside later steps; the request runs once they are in.
            pinned = self.kv_transfer.pin(request, len(hits)) if self.kv_transfer is not None else []
            num_loaded = len(pinned) * kv.block_size
            num_new = 0 if pinned else self._cap(request.num_tokens - num_hit - num_loaded, budget)
            if not kv.allocate_slots(request, num_loaded + num_new, hits, num_hit):
                if pinned:
                    self.kv_transfer.unpin(pinned)
                break
            if pinned:
                kv_loads += self.kv_transfer.loads(request, len(hits), pinned)
                kv.uncache_from(request, len(hits))  # hittable once loaded and run, not while their bytes arrive
                request.kv_loading = True
                request.kv_load_start = num_hit
            kv.record_prefix_lookup(request.num_tokens, num_hit)
            self.waiting.remove(request)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit + num_loaded
            request.num_computed_tokens = num_hit + num_loaded
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if not request.kv_loading:
                scheduled[request.request_id] = self._schedule_one(request, num_new)
                budget -= num_new
            promised += kv.num_blocks_to_finish(request)

        finished, self._finished_ids = self._finished_ids | preempted, set()
        batch = list(scheduled.values())
        self._in_flight.update(scheduled.keys())
        output = SchedulerOutput(
            scheduled=batch,
            finished_request_ids=finished,
            preempted_request_ids=preempted,
            num_batched_tokens=sum(s.num_tokens for s in batch),
            kv_loads=kv_loads,
            kv_loads_pending=any(request.kv_loading for request in self.running),
        )
        if self.kv_transfer is not None:
            output.kv_saves = self.kv_transfer.saves(self.requests[s.request_id] for s in batch)
        if self.grammar is not None:
            sampling = [self.requests[s.request_id] for s in batch if s.samples]
            output.grammar = self.grammar.batch(sampling)
        return output

    def _admit_pooling(self, request: Request, budget: int, scheduled: dict[str, ScheduledRequest]) -> bool:
        """A pooling request runs its whole prompt in one step (bidirectional attention needs every position at
        once), from the step's token budget, with no KV blocks: the encoder's K/V live only inside its forward pass
        (worker/pooling_runner.py), so nothing is allocated, nothing enters the prefix cache and nothing is left to
        free. A prompt longer than the budget runs alone in a step of its own rather than never (add_request bounds
        it by max_model_len). Head-of-line: when it does not fit, nobody behind it jumps ahead."""
        if request.num_tokens > budget and scheduled:
            return False
        self.waiting.remove(request)
        request.num_cached_tokens = 0
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        scheduled[request.request_id] = self._schedule_one(request, request.num_tokens)
        return True

    # ---- results -------------------------------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Appends each sampled token, ends requests that stop, and returns one output per request that got a
        token. Requests that ended while the step ran (aborts, stop strings, or, with async scheduling, a stop in
        the batch before) are skipped. A request preempted while its batch was in flight keeps its token."""
        outputs, self._pending_outputs = self._pending_outputs, []
        failed_loads = set(runner_output.failed_kv_loads)
        for request_id in runner_output.finished_kv_loads:
            loaded = self.requests.get(request_id)
            if loaded is None or not loaded.kv_loading:
                continue  # gone meanwhile: aborted, or preempted and requeued (it will load again)
            loaded.kv_loading = False
            if request_id in failed_loads:  # its blocks hold nothing usable: it computes those positions itself
                self.kv_transfer.load_failed(loaded)
                loaded.num_computed_tokens = loaded.kv_load_start
                loaded.num_cached_tokens = min(loaded.num_cached_tokens, loaded.kv_load_start)
        if self.kv_transfer is not None:
            self.kv_transfer.num_failed_saves += runner_output.failed_kv_saves
        for planned in scheduler_output.scheduled:
            rid = planned.request_id
            if self._in_flight[rid] > 1:
                self._in_flight[rid] -= 1
            else:
                self._in_flight.pop(rid, None)
            request = self.requests.get(rid)
            if request is None:
                continue
            if planned.pooling_params is not None:
                pooled = runner_output.pooled.get(rid)
                if pooled is not None:
                    self._finish(request, RequestStatus.FINISHED_STOPPED)
                    output = self._output(request, [])
                    output.pooled = pooled
                    outputs.append(output)
                continue
            request.prompt_logprobs.extend(runner_output.prompt_logprobs.get(planned.request_id, ()))
            token = runner_output.sampled_token_ids.get(planned.request_id)
            if not planned.samples or token is None:
                continue
            if planned.draft_token_ids:
                outputs.append(self._update_drafted(request, planned, runner_output, token))
                continue
            request.output_token_ids.append(token)
            status = self._check_stop(request, token)
            if request.grammar is not None and self.grammar is not None and self.grammar.accept(request, token):
                status = status or RequestStatus.FINISHED_STOPPED  # the grammar is complete
            if status is not None:
                self._finish(request, status)
            logprobs = runner_output.logprobs.get(planned.request_id)
            output = self._output(request, [token], [logprobs] if logprobs is not None else None)
            if request.num_output_tokens == 1 and request.sampling_params.prompt_logprobs is not None:
                output.prompt_logprobs = request.prompt_logprobs
            outputs.append(output)
        return outputs

    def _update_drafted(self, request: Request, planned: ScheduledRequest, runner_output: ModelRunnerOutput,
                        token: int) -> EngineCoreOutput:
        """A step that verified drafts: the accepted drafts and the runner's own next token, each checked for a stop
        as if it had been decoded alone (what follows a stop is dropped); then the positions of the rejected drafts
        are given back (their K/V is overwritten by later steps; blocks wholly past the request's tokens are freed,
        and none of them was ever put in the prefix cache, which keys only blocks of known tokens)."""
        rid = request.request_id
        accepted = runner_output.accepted_draft_token_ids.get(rid, [])
        assert self.speculator is not None
        self.speculator.record(request, len(planned.draft_token_ids), len(accepted))
        final_logprobs = runner_output.logprobs.get(rid)
        all_logprobs: list = [None] * (len(accepted) + 1)
        if final_logprobs is not None:  # the request asked for them: every kept draft has its own too
            all_logprobs = [*runner_output.accepted_draft_logprobs[rid], final_logprobs]
        new_tokens, new_logprobs = [], []
        status = None
        for new_token, logprobs in zip([*accepted, token], all_logprobs, strict=True):
            request.output_token_ids.append(new_token)
            new_tokens.append(new_token)
            if logprobs is not None:
                new_logprobs.append(logprobs)
            status = self._check_stop(request, new_token)
            if request.grammar is not None and self.grammar is not None and self.grammar.accept(request, new_token):
                status = status or RequestStatus.FINISHED_STOPPED  # the grammar is complete
            if status is not None:
                break
        if status is not None:
            self._finish(request, status)
        elif request.status == RequestStatus.RUNNING:  # a request preempted meanwhile recomputes from 0 anyway
            request.num_computed_tokens = request.num_tokens - 1
            self.kv_cache_manager.free_beyond(request, request.num_tokens)
        return self._output(request, new_tokens, new_logprobs)

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if token in request.eos_token_ids and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED  # stop_reason stays None for EOS, as in vLLM
            if token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
