"""Starting rank processes: forked from one process per engine that imported torch and the worker stack once
(multiprocessing's forkserver), instead of a fresh interpreter per rank that imports them again.

A fresh rank pays ~2 s of CPU before it can join (the interpreter, torch, transformers' config classes for a
Hugging Face directory, lmserve's worker); four ranks on two cores, ~4 s of a start-up. Forked from the preloaded
server, a rank starts in milliseconds and shares those pages with its siblings. vLLM forks its workers from the
engine process; the engine here may have run torch ops already (an in-process LLM), and forking a process whose
OpenMP pool is running is unsafe, hence a server that only ever imports.

The forked rank runs lmserve.executor.rank_process.main, as the plain `python -m lmserve.executor.rank_process` does,
in this process's environment of the moment it starts (READ_AT_IMPORT: which changes start fresh interpreters).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import subprocess
import sys
import threading
from collections.abc import Mapping
from multiprocessing import popen_forkserver, spawn
from typing import Protocol

logger = logging.getLogger(__name__)

# What every rank imports before it can join; a Hugging Face directory's ranks also import transformers' config.
PRELOAD = ["lmserve.executor.rank_process", "lmserve.worker.worker"]
HF_PRELOAD = ["lmserve.executor.hf_config_preload"]
FORK_VARIABLE = "LMSERVE_FORK_RANKS"  # 0: every rank a fresh interpreter (`python -m lmserve.executor.rank_process`)


class RankProcess(Protocol):
    """What the executors use of a rank's process: subprocess.Popen's interface."""

    pid: int

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def kill(self) -> None: ...
    def terminate(self) -> None: ...


class ForkedRank:
    """A rank forked by the server, with Popen's interface (exit codes as Popen gives them: -N for signal N)."""

    def __init__(self, process: multiprocessing.process.BaseProcess) -> None:
        self._process = process
        self.pid = process.pid

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"rank process {self.pid}", timeout or 0.0)
        return self._process.exitcode

    def kill(self) -> None:
        if self._process.exitcode is None:
            self._process.kill()

    def terminate(self) -> None:
        if self._process.exitcode is None:
            self._process.terminate()


class _RankPopen(popen_forkserver.Popen):
    """The fork server's launch without the main module: multiprocessing would run the starting program's main
    script again in each child (as spawn does), which a script that builds an LLM at its top level does not expect."""

    def _launch(self, process_obj: multiprocessing.process.BaseProcess) -> None:
        with _lock:
            whole = spawn.get_preparation_data

            def without_main(name: str) -> dict:
                data = whole(name)
                data.pop("init_main_from_path", None)
                data.pop("init_main_from_name", None)
                return data

            spawn.get_preparation_data = without_main
            try:
                super()._launch(process_obj)
            finally:
                spawn.get_preparation_data = whole


class _RankProcessObject(multiprocessing.context.ForkServerProcess):
    @staticmethod
    def _Popen(process_obj: multiprocessing.process.BaseProcess) -> _RankPopen:
        return _RankPopen(process_obj)


_lock = threading.RLock()
_server_environment: dict[str, str] | None = None
# Variables read before a forked rank can take this process's environment: by the interpreter and the loader, and
# by what the server imported (OpenMP and MKL read theirs as torch loads; transformers and lmserve's kernels read
# theirs at import). While one of these differs from the server's, ranks start as fresh interpreters; every other
# variable a forked rank takes from this process as it starts.
READ_AT_IMPORT = ("PYTHON", "LD_", "OMP_", "KMP_", "GOMP_", "MKL_", "TORCH", "PYTORCH_", "CUDA", "HF_",
                  "TRANSFORMERS_", "LMSERVE_")
# ...but for these, read each time they are used, which a forked rank's own environment serves. PYTHONBREAKPOINT
# matters most: ray.init() sets it in its driver, and an engine that had used Ray would start every later rank fresh.
READ_WHEN_USED = ("PYTHONBREAKPOINT",)


def _read_at_import(environment: Mapping[str, str]) -> dict[str, str]:
    return {name: value for name, value in environment.items()
            if name.startswith(READ_AT_IMPORT) and name not in READ_WHEN_USED}


def _forking_context(hf_model: bool) -> multiprocessing.context.BaseContext | None:
    """The fork server's context while the variables its imports read are as it started with; None otherwise."""
    global _server_environment
    if os.environ.get(FORK_VARIABLE, "1") == "0" or "forkserver" not in multiprocessing.get_all_start_methods():
        return None
    context = multiprocessing.get_context("forkserver")
    with _lock:
        if _server_environment is None:
            context.set_forkserver_preload(PRELOAD + (HF_PRELOAD if hf_model else []))
            _server_environment = _read_at_import(os.environ)
        elif _server_environment != (now := _read_at_import(os.environ)):
            changed = sorted(name for name in _server_environment.keys() | now.keys()
                             if _server_environment.get(name) != now.get(name))
            logger.info("ranks start as fresh interpreters: %s changed since the fork server started",
                        ", ".join(changed))
            return None
    return context


def start_rank_process(arguments: list[str], log_level: str, hf_model: bool, fork: bool,
                       environment: Mapping[str, str] | None = None) -> RankProcess:
    """One rank running lmserve.executor.rank_process.main(*arguments), logging at `log_level`; forked where `fork`
    (this process starts several ranks: for one, the server's start-up would only come before the rank's own) or
    where an earlier engine of this process started the server already (an in-process LLM's second engine).
    `environment`: variables for this rank only (its engine's key), on top of this process's."""
    context = _forking_context(hf_model) if fork or _server_environment is not None else None
    if context is None:
        env = {"LMSERVE_LOG_LEVEL": log_level, **os.environ, **(environment or {})}
        return subprocess.Popen([sys.executable, "-m", "lmserve.executor.rank_process", *arguments], env=env)
    from lmserve.executor import rank_process

    process = _RankProcessObject(target=rank_process.forked_main,
                                 args=(os.getpid(), {**os.environ, **(environment or {})}, log_level, *arguments),
                                 name="lmserve-rank", daemon=False)
    process.start()
    return ForkedRank(process)
