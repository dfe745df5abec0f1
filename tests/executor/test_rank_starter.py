"""Rank processes forked from the engine's fork server (lmserve.executor.rank_starter): they still die with the
engine however it dies, and a change to what the server's imports read starts fresh interpreters instead."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmserve.executor import rank_starter

ENGINE = """
import json, sys, time
from lmserve import LLM, SamplingParams
with LLM(sys.argv[1], dtype="float32", quantization="none", num_blocks=16, max_model_len=256,
         tensor_parallel_size=2) as llm:
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    procs = llm.engine.executor.procs
    print(json.dumps({"ranks": [p.pid for p in procs], "kinds": [type(p).__name__ for p in procs]}), flush=True)
    time.sleep(300)
"""


def gone(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    try:
        return "zombie" in status.read_text()
    except OSError:
        return True


def test_forked_ranks_die_with_an_engine_killed_outright(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """SIGKILL leaves the engine no chance to stop its ranks: the fork server sees the engine go (the ranks let go of
    its "alive" pipe) and exits, and the kernel's parent-death signal takes the ranks. (The engine's temporary files,
    which a server's client removes, go to tmp_path here.)"""
    engine = subprocess.Popen([sys.executable, "-c", ENGINE, str(tiny_llama_dir)], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True,
                              env={**os.environ, "LMSERVE_LOG_LEVEL": "WARNING", "TMPDIR": str(tmp_path)})
    try:
        started = json.loads(engine.stdout.readline())
        ranks = started["ranks"]
        assert started["kinds"] == ["ForkedRank", "ForkedRank"], started
        assert [Path(f"/proc/{pid}/comm").read_text().strip() for pid in ranks] == ["lmserve-rank0", "lmserve-rank1"]
        servers = {int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) for pid in ranks}
        assert len(servers) == 1 and engine.pid not in servers, servers  # forked by one server, not the engine
        os.kill(engine.pid, signal.SIGKILL)
        engine.wait(timeout=10)
        deadline = time.monotonic() + 10
        while not all(gone(pid) for pid in [*ranks, *servers]):
            assert time.monotonic() < deadline, "a forked rank or its server outlived the engine"
            time.sleep(0.05)
    finally:
        if engine.poll() is None:
            engine.kill()


def test_ranks_start_fresh_once_a_variable_read_at_import_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(rank_starter.FORK_VARIABLE, raising=False)
    monkeypatch.setattr(rank_starter, "_server_environment", rank_starter._read_at_import(os.environ))
    assert rank_starter._forking_context(hf_model=False) is not None
    monkeypatch.setenv("LMSERVE_A_SETTING_OF_A_TEST", "1")
    assert rank_starter._forking_context(hf_model=False) is None  # OpenMP's and lmserve's read as modules load
    monkeypatch.delenv("LMSERVE_A_SETTING_OF_A_TEST")
    monkeypatch.setenv("A_VARIABLE_NOTHING_READS_AT_IMPORT", "1")  # a forked rank takes it as it starts
    assert rank_starter._forking_context(hf_model=False) is not None
    # ray.init() sets PYTHONBREAKPOINT in its driver; Python reads it at each breakpoint(), not at start-up
    monkeypatch.setenv("PYTHONBREAKPOINT", "ray.util.rpdb.set_trace")
    assert rank_starter._forking_context(hf_model=False) is not None
    monkeypatch.setenv("PYTHONHASHSEED", "7")  # read as the interpreter starts
    assert rank_starter._forking_context(hf_model=False) is None
    monkeypatch.delenv("PYTHONHASHSEED")
    monkeypatch.setenv(rank_starter.FORK_VARIABLE, "0")
    assert rank_starter._forking_context(hf_model=False) is None


def test_one_rank_is_forked_once_an_earlier_engine_started_the_fork_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """One rank alone starts fresh (a fork server would only start before it); once the server runs, forking it
    costs nothing more, and a fresh interpreter ~3 s of CPU."""
    asked: list[bool] = []
    monkeypatch.setattr(rank_starter, "_forking_context", lambda hf_model: asked.append(hf_model))  # None: fresh
    monkeypatch.setattr(rank_starter.subprocess, "Popen", lambda command, env: command[-1])
    monkeypatch.setattr(rank_starter, "_server_environment", None)
    assert rank_starter.start_rank_process(["fresh"], "INFO", hf_model=False, fork=False) == "fresh"
    assert asked == []  # not even asked
    assert rank_starter.start_rank_process(["fresh"], "INFO", hf_model=True, fork=True) == "fresh"
    assert asked == [True]
    monkeypatch.setattr(rank_starter, "_server_environment", rank_starter._read_at_import(os.environ))
    rank_starter.start_rank_process(["fresh"], "INFO", hf_model=False, fork=False)
    assert asked == [True, False]
