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
