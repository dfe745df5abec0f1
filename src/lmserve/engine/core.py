"""The engine core: scheduler → model runner → update, one step at a time.

The offline `LLM` drives it in-process; the server runs the same class in its own process behind ZMQ.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

from lmserve.config import EngineConfig
from lmserve.engine.outputs import EngineCoreOutput
from lmserve.engine.request import Request, RequestStatus
from lmserve.engine.scheduler import Scheduler
from lmserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass
class StepStats:
    num_scheduled_tokens: int
    num_requests: int
    duration_s: float


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runner = ModelRunner(config.model, config.cache)
        eos = getattr(self.runner.hf_config, "eos_token_id", None)
        self.runner.eos_token_id = eos[0] if isinstance(eos, list) else eos
        self.scheduler = Scheduler(config.scheduler, config.cache, self.runner.num_blocks, self.runner.max_model_len)
        self.last_step: StepStats | None = None

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> list[EngineCoreOutput]:
        return self.scheduler.abort_requests(list(request_ids))

    def finish_requests(self, request_ids: Iterable[str]) -> None:
        """Ends requests that the front-end stopped (a stop string), freeing their blocks now."""
        self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_STOPPED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        started = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        runner_output = self.runner.execute(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        self.last_step = StepStats(
            scheduler_output.num_batched_tokens, len(scheduler_output.scheduled), time.perf_counter() - started
        )
        return outputs
