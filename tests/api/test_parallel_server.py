"""`lmserve serve -tp 2` over real HTTP: the engine's ranks are processes of their own; a rank's death fails the
server cleanly (503, exit) and leaves no process behind."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import httpx
import openai
from server_process import alive, children, start_server, wait_for


def rank_pids(server_pid: int) -> list[int]:
    ranks = []
    for engine in children(server_pid):
        for pid in children(engine):
            if b"lmserve.executor.rank_process" in Path(f"/proc/{pid}/cmdline").read_bytes():
                ranks.append(pid)
    return ranks


def test_tensor_parallel_server_serves_and_a_dead_rank_fails_it_cleanly(tmp_path: Path, tiny_llama_dir: Path) -> None:
    server = start_server(tmp_path, str(tiny_llama_dir), "-tp", "2", "--dtype", "float32", "--quantization", "none",
                          "--kv-cache-memory", "16MiB", "--max-model-len", "256", timeout=180)
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
        done = client.completions.create(model=str(tiny_llama_dir), prompt="The capital of France is", max_tokens=6,
                                         temperature=0, extra_body={"ignore_eos": True})
        assert done.usage.completion_tokens == 6
        streamed = client.completions.create(model=str(tiny_llama_dir), prompt="The capital of France is",
                                             max_tokens=6, temperature=0, stream=True, extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in streamed) == done.choices[0].text

        engines = children(server.process.pid)
        ranks = rank_pids(server.process.pid)
        assert len(ranks) == 2, ranks
        killed = time.monotonic()
        os.kill(ranks[1], signal.SIGKILL)
        assert wait_for(lambda: httpx.get(f"{server.base_url}/health", timeout=2).status_code == 503, timeout=10)
        assert server.process.wait(timeout=10) == 1
        assert time.monotonic() - killed < 10
        # The engine says which rank went and how (not just any line naming a rank: start-up logs name them all).
        assert re.search(rf"rank \d \(pid {ranks[1]}\) exited with code -9", server.log()), server.log()[-3000:]
        assert wait_for(lambda: not any(alive(pid) for pid in ranks + engines), timeout=5), "a process outlived it"
    finally:
        server.stop(signal.SIGKILL)
