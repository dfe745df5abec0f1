"""The executor: the engine core's one handle on its ranks. The engine hands it each step's plan; it runs the plan on
every rank and gives back the driver rank's output. Which executor runs the ranks is --distributed-executor-backend.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import Any

from lmserve.config import EngineConfig
from lmserve.step import ModelRunnerOutput, SchedulerOutput, WorkerInfo


def reconciled_info(infos: list[WorkerInfo], driver_rank: int) -> WorkerInfo:
    """The driver rank's info with the fewest KV blocks any rank sized (vLLM takes the minimum too): each rank sizes
    its cache from its own free memory, and a block id the engine hands out must exist on every rank. A rank with
    more keeps its extra blocks unused."""
    return dataclasses.replace(infos[driver_rank], num_blocks=min(info.num_blocks for info in infos))


class RankFailedError(RuntimeError):
    """A rank died or raised: the engine cannot go on (its KV cache is split across ranks)."""


class Executor(ABC):
    info: WorkerInfo
    # Ranks in the engine process share its objects; remote ranks get each step's plan serialized.
    in_process: bool = False

    # Batches the engine may keep in flight (each executor runs the steps it is given in order): one per pipeline
    # stage, so that no stage waits for another; two with async scheduling (one rank), so that the engine plans
    # and updates the next step while this one computes.
    max_concurrent_batches: int = 1

    # Whether the engine may send a step's grammar masks after the step (send_grammar_masks), so that it fills them
    # while the ranks run the forward pass; otherwise they travel inside the step.
    takes_grammar_masks_later: bool = False

    @abstractmethod
    def submit(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        """Starts the step on every rank; the future holds the driver rank's output."""

    def send_grammar_masks(self, mask: Any) -> None:
        """The masks of the step submitted last (its lmserve.step.GrammarMasks came without them), for the driver
        rank, the one that samples."""
        raise NotImplementedError(f"{type(self).__name__} takes grammar masks only inside the step")

    def check_health(self) -> None:
        """Raises RankFailedError when a rank is gone."""

    @abstractmethod
    def communication_stats(self) -> list[dict[str, int]]:
        """Bytes each rank has put on the wire so far (all-reduce, all-gather, pipeline sends), by rank."""

    def expert_load(self) -> dict[str, list[int]]:
        """Tokens routed to each expert so far, by mixture-of-experts layer (ModelRunner.expert_load), of the layers
        the engine process's rank runs; empty where the ranks run elsewhere (not reported yet) or the model has no
        experts."""
        return {}

    @abstractmethod
    def shutdown(self) -> None:
        """Stops every rank; leaves no process behind."""


def batches_in_flight(config: EngineConfig) -> int:
    """An executor's max_concurrent_batches for this configuration."""
    return 2 if config.scheduler.async_scheduling else config.parallel.pipeline_parallel_size
