"""One rank, in the engine process: a step is a function call.

With async scheduling the call runs on one step thread, so that the engine thread plans the next step and sends
this one's outputs while the forward pass computes (its torch and BLAS calls release the GIL). One thread runs the
steps in the order they were submitted, which the scheduler relies on (a step may use the previous one's tokens and
reuse blocks freed while it was queued). Without it there is no thread: the step runs inside submit().
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from lmserve.config import EngineConfig
from lmserve.executor.base import Executor, batches_in_flight
from lmserve.step import ModelRunnerOutput, SchedulerOutput
from lmserve.worker.model_runner import ModelRunner
from lmserve.worker.worker import Worker


class UniProcExecutor(Executor):
    in_process = True

    def __init__(self, config: EngineConfig) -> None:
        self.worker = Worker(config)
        self.info = self.worker.info
        self.max_concurrent_batches = batches_in_flight(config)
        self._step_thread = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmserve-step")
            if self.max_concurrent_batches > 1 else None
        )

    @property
    def runner(self) -> ModelRunner:
        """The model runner itself (tests and benchmarks inspect it; only a one-rank engine has one here)."""
        return self.worker.runner

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        output = self.worker.execute_model(scheduler_output)
        assert output is not None  # the only rank is the driver
        return output

    def submit(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        """Queues the step on the step thread; without one, runs it now and returns a finished future."""
        if self._step_thread is not None:
            return self._step_thread.submit(self._execute, scheduler_output)
        future: Future[ModelRunnerOutput] = Future()
        future.set_result(self._execute(scheduler_output))
        return future

    def communication_stats(self) -> list[dict[str, int]]:
        return [self.worker.communication_stats()]

    def expert_load(self) -> dict[str, list[int]]:
        return self.worker.expert_load()

    def shutdown(self) -> None:
        if self._step_thread is not None:
            self._step_thread.shutdown(wait=True, cancel_futures=True)
        self.worker.shutdown()
