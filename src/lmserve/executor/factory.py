"""The executor that --distributed-executor-backend names, imported only when chosen (Ray's is heavy)."""

from __future__ import annotations

from lmserve.config import EngineConfig
from lmserve.executor.base import Executor


def make_executor(config: EngineConfig) -> Executor:
    backend = config.parallel.executor_backend
    if backend == "uni":
        from lmserve.executor.uniproc import UniProcExecutor

        return UniProcExecutor(config)
    if backend == "mp":
        from lmserve.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config)
    from lmserve.executor.ray import RayExecutor

    return RayExecutor(config)
