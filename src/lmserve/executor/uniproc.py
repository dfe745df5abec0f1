"""One rank, in the engine process: a step is a function call."""

from __future__ import annotations

from concurrent.futures import Future

from lmserve.config import EngineConfig
from lmserve.engine.outputs import ModelRunnerOutput, SchedulerOutput
from lmserve.executor.base import Executor
from lmserve.worker.model_runner import ModelRunner
from lmserve.worker.worker import Worker


class UniProcExecutor(Executor):
    in_process = True

    def __init__(self, config: EngineConfig) -> None:
        self.worker = Worker(config)
        self.info = self.worker.info

    @property
    def runner(self) -> ModelRunner:
        """The model runner itself (tests and benchmarks inspect it; only a one-rank engine has one here)."""
        return self.worker.runner

    def submit(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        """Runs the step now; the future is already done."""
        output = self.worker.execute_model(scheduler_output)
        assert output is not None  # the only rank is the driver
        future: Future[ModelRunnerOutput] = Future()
        future.set_result(output)
        return future

    def communication_stats(self) -> list[dict[str, int]]:
        return [self.worker.communication_stats()]

    def shutdown(self) -> None:
        self.worker.shutdown()
