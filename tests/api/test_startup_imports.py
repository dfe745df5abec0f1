"""`lmserve serve` starts the engine process before the API process imports anything heavy: what runs before the
engine starts (the command line, lmserve.api.serve, the front-end) imports no torch, transformers nor web stack, so
that those imports (in each process) overlap the engine's start-up instead of delaying it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lmserve

BEFORE_THE_ENGINE_STARTS = """
import sys
import lmserve.cli
from lmserve.api.serve import serve
from lmserve.api.tool_parsers import ToolConfig
from lmserve.engine.client import EngineCoreClient
ToolConfig()
print(" ".join(sorted({name.split(".")[0] for name in sys.modules})))
"""


def test_the_api_process_imports_nothing_heavy_before_the_engine_starts() -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(lmserve.__file__).parents[1])}
    result = subprocess.run([sys.executable, "-c", BEFORE_THE_ENGINE_STARTS], capture_output=True, text=True,
                            timeout=120, env=env, check=True)
    modules = set(result.stdout.split())
    assert "lmserve" in modules and "zmq" in modules  # the check sees the imports
    assert not modules & {"torch", "transformers", "fastapi", "uvicorn", "starlette", "pydantic"}


RANK_STARTERS = """
import sys
from lmserve.headless import run_headless
from lmserve.executor.multiproc import RankAddresses, start_rank
from lmserve.executor.ray import RayExecutor
from lmserve.executor.rank_starter import start_rank_process
print(" ".join(sorted({name.split(".")[0] for name in sys.modules})))
"""


def test_what_starts_ranks_leaves_torch_to_them() -> None:
    """A --headless node and the engine's rank executors start ranks that import torch themselves: importing it
    before (~1.2 s of CPU) would only delay them."""
    env = {**os.environ, "PYTHONPATH": str(Path(lmserve.__file__).parents[1])}
    result = subprocess.run([sys.executable, "-c", RANK_STARTERS], capture_output=True, text=True, timeout=120,
                            env=env, check=True)
    modules = set(result.stdout.split())
    assert "lmserve" in modules and "zmq" in modules  # the check sees the imports
    assert "torch" not in modules
