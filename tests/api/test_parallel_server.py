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
from rank_processes import rank_pids
from server_process import alive, children, start_server, wait_for

# The 503s after the engine's death last 1 s instead of 3 (LMSERVE_ENGINE_DEATH_GRACE_S): these tests poll for the
# first one at once, then only wait for the exit.
SHORT_GRACE = {"LMSERVE_ENGINE_DEATH_GRACE_S": "1"}


def test_tensor_parallel_server_serves_and_a_dead_rank_fails_it_cleanly(tmp_path: Path, tiny_llama_dir: Path) -> None:
    server = start_server(tmp_path, str(tiny_llama_dir), "-tp", "2", "--dtype", "float32", "--quantization", "none",
                          "--kv-cache-memory", "16MiB", "--max-model-len", "256", timeout=180, env=SHORT_GRACE)
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
        # The ranks' sockets are made among the engine's, which go with the server however the engine ends.
        socket_directory = server.socket_directory
        assert any(path.name.startswith("lmserve-ranks-") for path in socket_directory.iterdir())
        killed = time.monotonic()
        os.kill(ranks[1], signal.SIGKILL)
        assert wait_for(lambda: httpx.get(f"{server.base_url}/health", timeout=2).status_code == 503, timeout=10)
        assert server.process.wait(timeout=10) == 1
        assert time.monotonic() - killed < 10
        # The engine says which rank went and how (not just any line naming a rank: start-up logs name them all).
        assert re.search(rf"rank \d \(pid {ranks[1]}\) exited with code -9", server.log()), server.log()[-3000:]
        assert wait_for(lambda: not any(alive(pid) for pid in ranks + engines), timeout=5), "a process outlived it"
        assert not socket_directory.exists()
    finally:
        server.stop(signal.SIGKILL)


def test_a_rank_killed_mid_step_ends_the_stream_and_the_server(tmp_path: Path, tiny_llama_dir: Path) -> None:
    """Issue 37: a rank that dies while the others wait for it in a collective (every decode step all-reduces): the
    stream ends with an error rather than hanging, the server fails as an engine death does, and the rank left
    waiting in the collective goes with it."""
    server = start_server(tmp_path, str(tiny_llama_dir), "-tp", "2", "--dtype", "float32", "--quantization", "none",
                          "--kv-cache-memory", "16MiB", "--max-model-len", "2048", timeout=180, env=SHORT_GRACE)
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
        engines, ranks = children(server.process.pid), rank_pids(server.process.pid)
        assert len(ranks) == 2, ranks
        stream = client.completions.create(model=str(tiny_llama_dir), prompt="Once upon a time", max_tokens=2000,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True})
        received, finish, error = 0, None, None
        killed = None
        try:
            for chunk in stream:
                received += 1
                finish = chunk.choices[0].finish_reason if chunk.choices else finish
                if received == 20:  # decoding: both ranks step and all-reduce in lockstep
                    killed = time.monotonic()
                    os.kill(ranks[1], signal.SIGKILL)
        except (openai.APIError, httpx.HTTPError) as exc:
            error = exc
        assert killed is not None and finish != "length", (received, finish)  # it did not run to its end
        assert time.monotonic() - killed < 15, "the stream hung after the rank died"
        assert error is not None or received < 2000
        assert server.process.wait(timeout=15) == 1
        # The reason names the rank that died, not only what the survivor saw in its all-reduce.
        reason = next(line for line in server.log().splitlines() if "exiting because the engine died" in line)
        assert re.search(rf"rank 1 \(pid {ranks[1]}\) exited with code -9", reason), reason
        assert wait_for(lambda: not any(alive(pid) for pid in ranks + engines), timeout=5), "a process outlived it"
    finally:
        server.stop(signal.SIGKILL)
