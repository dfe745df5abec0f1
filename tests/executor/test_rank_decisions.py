"""What the executors decide about their ranks (issue 37): the block pool is the smallest rank's (it was the driver's,
so a rank with less memory could be handed block ids past its cache); Ray ranks get the driver's environment and sit
node by node."""

from __future__ import annotations

from lmserve.executor.base import reconciled_info
from lmserve.worker.worker import WorkerInfo


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
