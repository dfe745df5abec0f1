"""What the executors decide about their ranks (issue 37): the block pool is the smallest rank's (it was the driver's,
so a rank with less memory could be handed block ids past its cache); Ray ranks get the driver's environment and sit
node by node; the Ray driver rank takes a constrained step's masks after the step has started."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from lmserve.executor.base import reconciled_info
from lmserve.executor.step_messages import StepEncoder
from lmserve.step import GrammarMasks, ModelRunnerOutput, SchedulerOutput, WorkerInfo


def test_the_pool_is_the_smallest_ranks() -> None:
    infos = [WorkerInfo(900, 2048, 100, 64), WorkerInfo(700, 2048, 100, 64), WorkerInfo(950, 2048, 100, 64)]
    for driver in range(3):
        info = reconciled_info(infos, driver)
        assert info.num_blocks == 700
        assert (info.max_model_len, info.vocab_size, info.kv_bytes_per_block) == (2048, 100, 64)
    assert reconciled_info(infos[:1], 0) == infos[0]


def test_ray_ranks_get_the_drivers_environment_and_sit_node_by_node() -> None:
    from lmserve.executor.ray import forwarded_env, ranks_by_node

    environ = {"LMSERVE_LOG_LEVEL": "DEBUG", "NCCL_SOCKET_IFNAME": "eth1", "GLOO_SOCKET_IFNAME": "eth1",
               "HF_HOME": "/models", "PATH": "/bin", "HOME": "/root", "SECRET": "x"}
    assert forwarded_env(environ) == {"LMSERVE_LOG_LEVEL": "DEBUG", "NCCL_SOCKET_IFNAME": "eth1",
                                      "GLOO_SOCKET_IFNAME": "eth1", "HF_HOME": "/models"}
    # Bundles placed a, b, a, b: ranks 0-1 (one tensor-parallel group) must share a machine, the driver's first.
    assert ranks_by_node(["a", "b", "a", "b"], first_node="b") == [1, 3, 0, 2]
    assert ranks_by_node(["a", "b", "a", "b"], first_node="a") == [0, 2, 1, 3]


def test_what_ray_ranks_keep_for_themselves() -> None:
    """The devices Ray gives each actor are its own (the head's CUDA_VISIBLE_DEVICES would put every rank on the
    head's GPUs), and a cluster's per-machine settings can be kept off the forwarded list."""
    from lmserve.executor.ray import NOT_FORWARDED_ENV_SETTING, forwarded_env

    environ = {"CUDA_VISIBLE_DEVICES": "0,1", "ROCR_VISIBLE_DEVICES": "0", "CUDA_LAUNCH_BLOCKING": "1",
               "NCCL_IB_HCA": "mlx5_0", "NCCL_DEBUG": "INFO"}
    assert forwarded_env(environ) == {"CUDA_LAUNCH_BLOCKING": "1", "NCCL_IB_HCA": "mlx5_0", "NCCL_DEBUG": "INFO"}
    environ[NOT_FORWARDED_ENV_SETTING] = "NCCL_IB_HCA, GLOO_SOCKET_IFNAME"
    assert forwarded_env(environ) == {"CUDA_LAUNCH_BLOCKING": "1", "NCCL_DEBUG": "INFO",
                                      NOT_FORWARDED_ENV_SETTING: "NCCL_IB_HCA, GLOO_SOCKET_IFNAME"}


def test_ray_ranks_take_the_clusters_gpus_and_tensor_groups_across_machines_are_found(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from lmserve.executor.ray import groups_across_nodes, ranks_on_cuda

    assert ranks_on_cuda("auto", cluster_gpus=4, world_size=4)  # a CPU-only head over GPU workers
    assert not ranks_on_cuda("auto", cluster_gpus=0, world_size=2)
    assert not caplog.records
    assert not ranks_on_cuda("auto", cluster_gpus=2, world_size=4)
    assert "2 GPU(s) for 4 ranks" in caplog.text
    assert ranks_on_cuda("cuda", cluster_gpus=0, world_size=2)  # waits for the placement group, then says so
    assert not ranks_on_cuda("cpu", cluster_gpus=8, world_size=2)
    # -tp 2 -pp 2 on nodes a, a, b, b: each tensor group on one machine; a, b, a, b: both cross the network.
    assert groups_across_nodes(["a", "a", "b", "b"], 2) == []
    assert groups_across_nodes(["a", "b", "b", "b"], 2) == [0]
    assert groups_across_nodes(["a", "b", "a", "b"], 2) == [0, 1]
    assert groups_across_nodes(["a", "b", "c", "d"], 1) == []


class MaskReadingWorker:
    """Stands for a Worker: its step reads the masks where the runner would, at the draw, and reports what it read."""

    def __init__(self) -> None:
        self.forward_started = threading.Event()

    def execute_model(self, step: SchedulerOutput) -> ModelRunnerOutput:
        self.forward_started.set()
        masks = step.grammar.fill(["a"]) if isinstance(step.grammar, GrammarMasks) else None
        return ModelRunnerOutput(sampled_token_ids={"a": -1 if masks is None else int(masks[0])})

    def shutdown(self) -> None:
        pass


def test_the_ray_driver_rank_starts_a_constrained_step_before_its_masks_come() -> None:
    from lmserve.executor.ray import RankActor

    driver, other = RankActor(), RankActor()
    for actor, samples in ((driver, True), (other, False)):
        actor.worker = MaskReadingWorker()
        if samples:  # what start() sets up on the driver rank, without building a model
            actor._step_thread = ThreadPoolExecutor(max_workers=1)
    encoders = {id(driver): StepEncoder(), id(other): StepEncoder()}

    def message(actor: RankActor, masks: GrammarMasks | None) -> object:
        return encoders[id(actor)].encode(SchedulerOutput(scheduled=[], grammar=masks))

    waiting = GrammarMasks(matchers={"a": 0}, masked_first=[])
    assert driver.execute_model(message(driver, waiting)) is None  # returned while the step waits for its masks
    assert driver.worker.forward_started.wait(10)
    assert driver.sample_tokens(np.array([7])).sampled_token_ids == {"a": 7}  # the masks reached the draw
    with pytest.raises(RuntimeError, match="no step"):
        driver.sample_tokens(np.array([7]))
    # Masks inside the step, or none at all: the step runs in the call as before.
    inside = GrammarMasks({"a": 0}, [], mask=np.array([5]))
    assert driver.execute_model(message(driver, inside)).sampled_token_ids == {"a": 5}
    assert driver.execute_model(message(driver, None)).sampled_token_ids == {"a": -1}
    driver.shutdown()
    # A rank that does not sample never waits (it reads no mask; a step that would read one fails, not hangs).
    with pytest.raises(RuntimeError, match="never came"):
        other.execute_model(message(other, GrammarMasks(matchers={"a": 0}, masked_first=[])))
