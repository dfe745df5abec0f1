"""One rank of an engine: joins the engine's ranks, builds its share of the model and KV cache, runs steps.

The executor (lmserve.executor) owns the ranks: in the engine process for one rank, in one process each (mp) or as
Ray actors otherwise. Every rank runs every step; the driver rank's output is the step's.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import TYPE_CHECKING

import torch

from lmserve.config import EngineConfig, PlacementConfig, cpu_share
from lmserve.distributed.layout import RankLayout
from lmserve.distributed.parallel_state import destroy_parallel_groups, init_parallel_groups
from lmserve.models import resolve_model
from lmserve.pooling_config import is_pooling_model
from lmserve.step import ModelRunnerOutput, SchedulerOutput, WorkerInfo
from lmserve.worker.model_runner import ModelRunner, resolve_device

if TYPE_CHECKING:
    from lmserve.worker.pooling_runner import PoolingModelRunner

logger = logging.getLogger(__name__)


def rank_placement(config: EngineConfig, rank: int) -> PlacementConfig:
    """Ranks on one machine share its CPUs: by default each gets its own share of them (pinned there, a thread per
    CPU of it), not all of them. Over several machines (--nnodes) a rank shares its own machine's."""
    placement = config.placement
    ranks_here = config.parallel.ranks_per_node
    if ranks_here == 1 or placement.engine_threads:
        return placement
    cpus = cpu_share(placement.engine_cpus or sorted(os.sched_getaffinity(0)), ranks_here, rank % ranks_here)
    return dataclasses.replace(placement, engine_cpus=cpus, engine_threads=len(cpus))


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, init_method: str | None = None) -> None:
        parallel_config = config.parallel
        self.layout = RankLayout(rank, parallel_config.tensor_parallel_size, parallel_config.pipeline_parallel_size)
        # Devices are this machine's: over several nodes (--nnodes), its ranks share them.
        self.local_rank = rank % parallel_config.ranks_per_node
        device = resolve_device(config.model.device)
        if device.type == "cuda" and (self.layout.world_size > 1 or parallel_config.data_parallel_size > 1):
            device_count = torch.cuda.device_count()
            torch.cuda.set_device(parallel_config.cuda_device(self.local_rank, device_count))
            shared = parallel_config.gpus_shared(device_count)
            if shared and self.local_rank == 0 and parallel_config.data_parallel_rank == parallel_config.local_replicas.start:
                logger.warning(shared)
        self.parallel = init_parallel_groups(self.layout, init_method, device)
        # An encoder makes this a pooling runner (vLLM's --runner pooling, chosen from the model as vLLM does).
        self.runner: ModelRunner | PoolingModelRunner
        if is_pooling_model(resolve_model(config.model.model), config.model.task):
            from lmserve.worker.pooling_runner import PoolingModelRunner  # only an encoder's engine needs it

            self.runner = PoolingModelRunner(config.model, config.cache, rank_placement(config, rank), self.parallel,
                                             scheduler_config=config.scheduler)
        else:
            self.runner = ModelRunner(config.model, config.cache, rank_placement(config, rank), self.parallel,
                                      scheduler_config=config.scheduler,
                                      expert_parallel=parallel_config.enable_expert_parallel)

    @property
    def info(self) -> WorkerInfo:
        runner = self.runner
        return WorkerInfo(runner.num_blocks, runner.max_model_len, runner.vocab_size, runner.kv_bytes_per_block,
                          prompt_rows_computed_apart=runner.prompt_copies, kv_groups=runner.kv_groups,
                          layer_program=runner.layer_program,
                          runner=getattr(runner, "runner", "generate"),
                          num_state_slots=getattr(runner, "num_state_slots", 0),
                          state_bytes_per_slot=getattr(runner, "state_bytes_per_slot", 0))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        return self.runner.execute(scheduler_output)

    def communication_stats(self) -> dict[str, int]:
        return self.parallel.stats.as_dict()

    def expert_load(self) -> dict[str, list[int]]:
        return self.runner.expert_load()

    def shutdown(self) -> None:
        if self.runner.kv_connector is not None:
            self.runner.kv_connector.close()
        destroy_parallel_groups()
