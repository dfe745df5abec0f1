"""Scale-out on CUDA (issue 37's GPU points), run by benchmarks/gpu_checks.sh: data-parallel replicas each on the
GPUs the placement gives them (on a one-GPU machine both share it), and, on a machine with two GPUs or more, tensor-
and pipeline-parallel ranks over NCCL giving one rank's greedy tokens, with a pipeline started without
--kv-cache-memory (its memory profiling runs each stage alone)."""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

import httpx
import openai
from server_process import Server, start_server, wait_for

MAX_MODEL_LEN = 256
# The `lmserve` console script needs an installed package; a GPU machine may have the sources on PYTHONPATH only.
LMSERVE = [sys.executable, "-c", "import sys; from lmserve.cli import main; sys.exit(main())"]
PROMPT = "The quick brown fox jumps over the lazy dog because"


def start_cuda_server(tmp: Path, model: Path, *args: str) -> Server:
    return start_server(tmp, "--device", "cuda", "--model", str(model), "--max-model-len", str(MAX_MODEL_LEN),
                        "--gpu-memory-utilization", "0.05", *args, timeout=300, command=LMSERVE)


def greedy(server: Server, model: Path, n: int = 1) -> list[str]:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    return [client.completions.create(model=str(model), prompt=PROMPT, max_tokens=16, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text for _ in range(n)]


@pytest.fixture(scope="module")
def one_rank_answer(tmp_path_factory, tiny_llama_dir: Path) -> str:
    server = start_cuda_server(tmp_path_factory.mktemp("one-rank"), tiny_llama_dir)
    try:
        return greedy(server, tiny_llama_dir)[0]
    finally:
        server.stop(signal.SIGKILL)


def test_data_parallel_replicas_serve_on_their_gpus(tmp_path: Path, tiny_llama_dir: Path, one_rank_answer: str) -> None:
    server = start_cuda_server(tmp_path, tiny_llama_dir, "-dp", "2")
    try:
        replicas = httpx.get(f"{server.base_url}/debug/engine", timeout=10).json()["engines"]
        assert len(replicas) == 2
        assert greedy(server, tiny_llama_dir) == [one_rank_answer]  # alone in its batch: one rank's tokens
        steps_before = [r["num_steps"] for r in replicas]
        answers: list[str] = []
        threads = [threading.Thread(target=lambda: answers.extend(greedy(server, tiny_llama_dir, 2)))
                   for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert len(answers) == 8 and all(answers)
        replicas = httpx.get(f"{server.base_url}/debug/engine", timeout=10).json()["engines"]
        assert all(r["num_steps"] > before for r, before in zip(replicas, steps_before, strict=True))
        assert wait_for(lambda: all(r["kv_blocks_used"] == 0 for r in httpx.get(
            f"{server.base_url}/debug/engine", timeout=10).json()["engines"]), timeout=10)
        assert server.log().count("cuda") >= 2
    finally:
        print(f"\n--- -dp 2 server log ---\n{server.log()[-3000:]}")
        server.stop(signal.SIGKILL)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL between ranks needs two GPUs")
@pytest.mark.parametrize("layout", [("-tp", "2"), ("-pp", "2")], ids=["tp2", "pp2"])
def test_ranks_over_nccl_give_one_ranks_tokens(tmp_path: Path, tiny_llama_dir: Path, one_rank_answer: str,
                                               layout: tuple[str, str]) -> None:
    server = start_cuda_server(tmp_path, tiny_llama_dir, *layout)  # no --kv-cache-memory: profiled per stage
    try:
        assert greedy(server, tiny_llama_dir, 2) == [one_rank_answer] * 2
    finally:
        print(f"\n--- {' '.join(layout)} server log ---\n{server.log()[-3000:]}")
        server.stop(signal.SIGKILL)
