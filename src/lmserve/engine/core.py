"""The engine core: scheduler → executor → update, one step at a time.

The offline `LLM` drives it in-process; the server runs the same class in its own process (core_proc.py). The
executor runs each step on the engine's ranks (lmserve.executor). With pipeline stages the engine keeps one batch in
flight per stage (vLLM V1's batch queue): it schedules the next batch while the earlier ones move down the stages,
and the scheduler never puts a request in two batches in flight. Async scheduling (one rank) uses the same queue
with two batches: the engine plans step N+1 and processes step N's output while the executor computes, and the
scheduler lets decoding requests go ahead of their in-flight token (see engine/scheduler.py).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

from lmserve.config import EngineConfig
from lmserve.engine.grammar import GrammarManager
from lmserve.engine.kv_transfer import keyed_to_model
from lmserve.engine.outputs import EngineCoreOutput
from lmserve.engine.request import Request, RequestStatus
from lmserve.engine.scheduler import Scheduler
from lmserve.executor.base import Executor
from lmserve.executor.factory import make_executor
from lmserve.metrics.clock import now
from lmserve.metrics.stats import EngineStats, StepRecord
from lmserve.models import load_model_config, model_eos_token_ids, resolve_model
from lmserve.step import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

# How many recent requests keep their position counts for debugging (bounded: the server runs for days).
TRACKED_REQUESTS = 4096
GRAMMAR_WAIT_S = 0.002


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        config = keyed_to_model(config)  # before the ranks start: they file blocks where the scheduler looks
        self.config = config
        self.executor: Executor = make_executor(config)
        info = self.executor.info
        self.num_blocks = info.num_blocks
        self._vocab_size = info.vocab_size
        source = resolve_model(config.model.model)
        # All of the model's EOS ids (config and generation_config.json); requests carry their own copy.
        self.eos_token_ids = model_eos_token_ids(source, load_model_config(source))
        pooling = info.runner == "pooling"  # an encoder: no grammars (nothing is sampled), no KV cache
        self.grammar = None if pooling else GrammarManager(config.model.tokenizer or config.model.model,
                                                           info.vocab_size, self.eos_token_ids)
        self.scheduler = Scheduler(config.scheduler, config.cache, info.num_blocks, info.max_model_len, self.grammar,
                                   key_generated_blocks=info.prompt_rows_computed_apart, kv_groups=info.kv_groups,
                                   draft_constrained=self.executor.in_process,
                                   world_size=config.parallel.world_size, pooling=pooling,
                                   num_state_slots=info.num_state_slots)
        self.batch_queue: deque[tuple[SchedulerOutput, Future[ModelRunnerOutput], float]] = deque()
        self._finished_not_sent: set[str] = set()
        self.last_step: StepRecord | None = None
        self.num_steps = 0
        self.num_preemptions = 0
        self.num_aborted = 0
        self.positions_computed: OrderedDict[str, int] = OrderedDict()
        self.children: OrderedDict[str, list[str]] = OrderedDict()  # parent id -> child ids, for stats()

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)
        if request.parent_id is not None:
            self.children.setdefault(request.parent_id, []).append(request.request_id)
            while len(self.children) > TRACKED_REQUESTS:
                self.children.popitem(last=False)

    def abort_requests(self, request_ids: Iterable[str]) -> list[EngineCoreOutput]:
        outputs = self.scheduler.abort_requests(list(request_ids))
        self.num_aborted += len(outputs)
        return outputs

    def finish_requests(self, request_ids: Iterable[str]) -> None:
        """Ends requests that the front-end stopped (a stop string), freeing their blocks now."""
        self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_STOPPED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.batch_queue)

    def check_health(self) -> None:
        """Raises when a rank is gone (the engine checks while idle too, so a dead rank never waits for traffic)."""
        self.executor.check_health()

    def shutdown(self) -> None:
        self.executor.shutdown()
        if self.scheduler.kv_transfer is not None:
            self.scheduler.kv_transfer.close()

    def _count_positions(self, scheduler_output: SchedulerOutput) -> None:
        """Counted when the step is handed to the ranks, not when its output comes back: an abort that arrives while
        a step computes (after_execute, or a batch in flight) makes the request "gone" at once, and a count that
        grew after that looked like computing after the abort. No step handed over later holds an aborted request,
        so from "gone" on its count is final."""
        for scheduled in scheduler_output.scheduled:
            rid = scheduled.request_id
            self.positions_computed[rid] = self.positions_computed.pop(rid, 0) + scheduled.num_tokens
        while len(self.positions_computed) > TRACKED_REQUESTS:
            self.positions_computed.popitem(last=False)

    def _submit(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        self._count_positions(scheduler_output)
        grammar = scheduler_output.grammar
        if self.executor.in_process or grammar is None:
            return self.executor.submit(scheduler_output)
        # Remote ranks cannot call into this process's grammar matchers: they get the masks, filled here while they
        # run the step's forward pass (up to a millisecond a row), or before the step where the executor cannot
        # take them later.
        masks = scheduler_output.grammar = grammar.for_ranks_elsewhere()
        if not self.executor.takes_grammar_masks_later:
            masks.mask = grammar.fill_all()
            return self.executor.submit(scheduler_output)
        future = self.executor.submit(scheduler_output)
        self.executor.send_grammar_masks(grammar.fill_all())
        return future

    def step(self, after_execute: Callable[[], None] | None = None) -> list[EngineCoreOutput]:
        """One iteration. `after_execute` runs between the forward pass and the update, so that aborts arriving
        during the step stop their requests before any of their output is processed.

        With several batches in flight, an iteration that only started a batch returns no outputs and leaves
        last_step None; the one that finishes a batch records it."""
        if self.executor.max_concurrent_batches > 1:
            return self._step_with_batch_queue(after_execute)
        started = now()
        scheduler_output = self.scheduler.schedule()
        if not scheduler_output.scheduled and (self.scheduler.num_waiting or scheduler_output.kv_loads_pending):
            # Only grammars still compiling, or stored KV still loading: give their threads the CPU, do not spin.
            time.sleep(GRAMMAR_WAIT_S)
        forward_started = now()
        runner_output = self._submit(scheduler_output).result()
        return self._update(scheduler_output, runner_output, started, now() - forward_started, after_execute)

    def _step_with_batch_queue(self, after_execute: Callable[[], None] | None) -> list[EngineCoreOutput]:
        started = now()
        if len(self.batch_queue) < self.executor.max_concurrent_batches:
            scheduler_output = self.scheduler.schedule()
            scheduler_output.finished_request_ids |= self._finished_not_sent
            if scheduler_output.is_empty:
                self._finished_not_sent = scheduler_output.finished_request_ids
            else:
                self._finished_not_sent = set()
                self.batch_queue.append((scheduler_output, self._submit(scheduler_output), started))
                if len(self.batch_queue) < self.executor.max_concurrent_batches:
                    self.last_step = None
                    return []  # fill the pipeline before waiting for its first batch
        if not self.batch_queue:
            self.last_step = None
            if self.scheduler.num_waiting:
                time.sleep(GRAMMAR_WAIT_S)
            return []
        if not self.batch_queue[0][0].scheduled and self.batch_queue[0][0].kv_loads_pending:
            time.sleep(GRAMMAR_WAIT_S)  # a step that only asks the ranks which loads are done: do not spin
        scheduler_output, future, started = self.batch_queue.popleft()
        forward_started = now()
        runner_output = future.result()
        return self._update(scheduler_output, runner_output, started, now() - forward_started, after_execute)

    def _update(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput, started: float,
                forward_s: float, after_execute: Callable[[], None] | None) -> list[EngineCoreOutput]:
        if after_execute is not None:
            after_execute()
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        self.num_steps += 1
        self.num_preemptions += len(scheduler_output.preempted_request_ids)
        self.last_step = self._step_record(scheduler_output, started, forward_s)
        self.last_step.num_sampled = len(runner_output.sampled_token_ids)
        self.last_step.draft_tokens = sum(len(s.draft_token_ids) for s in scheduler_output.scheduled)
        self.last_step.accepted_tokens = sum(len(t) for t in runner_output.accepted_draft_token_ids.values())
        return outputs

    def _step_record(self, scheduler_output: SchedulerOutput, started: float, forward_s: float) -> StepRecord:
        prefill, decode = {}, {}
        for s in scheduler_output.scheduled:
            kind = decode if s.start_position >= len(s.prompt_token_ids) else prefill
            kind[s.request_id] = s.num_tokens
        return StepRecord(
            index=self.num_steps, start=started, end=now(), forward_s=forward_s, prefill=prefill, decode=decode,
            preempted=sorted(scheduler_output.preempted_request_ids),
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
        )

    def _speculation_stats(self) -> dict[str, Any]:
        speculator = self.scheduler.speculator
        if speculator is None:
            return {}
        stats = speculator.stats
        return {
            "spec_decode_num_drafts": stats.num_drafts,
            "spec_decode_num_draft_tokens": stats.num_draft_tokens,
            "spec_decode_num_accepted_tokens": stats.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(stats.accepted_per_position),
        }

    def _transfer_stats(self) -> dict[str, int]:
        transfer = self.scheduler.kv_transfer
        if transfer is None:
            return {}
        return {"kv_transfer_loaded_tokens": transfer.num_loaded_blocks * self.scheduler.kv_cache_manager.block_size,
                "kv_transfer_saved_blocks": transfer.num_saved_blocks,
                "kv_transfer_failed_loads": transfer.num_failed_loads,
                "kv_transfer_failed_saves": transfer.num_failed_saves}

    def stats(self, request_ids: Iterable[str] = ()) -> EngineStats:
        kv = self.scheduler.kv_cache_manager
        positions, status = {}, {}
        for rid in request_ids:
            ids = self.children.get(rid) or [rid]  # a parent id covers its n>1 children
            positions[rid] = sum(self.positions_computed.get(t, 0) for t in ids)
            live = [r for r in map(self.scheduler.get_request, ids) if r is not None]
            status[rid] = live[0].status.value if live else "gone"
        return EngineStats(
            num_requests_running=self.scheduler.num_running,
            num_requests_waiting=self.scheduler.num_waiting,
            kv_blocks_total=kv.num_blocks,
            kv_blocks_used=kv.num_used_blocks,
            kv_blocks_free=kv.num_free_blocks,
            kv_blocks_cached_free=kv.num_cached_free_blocks,
            kv_cache_usage_perc=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            num_requests_aborted=self.num_aborted,
            num_steps=self.num_steps,
            **self._speculation_stats(),
            **self._transfer_stats(),
            moe_expert_tokens=self.executor.expert_load(),
            request_positions=positions,
            request_status=status,
        )
