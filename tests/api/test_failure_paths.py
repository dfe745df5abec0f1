"""Failure paths of the real server (tiny random model, so that each test starts its own server in seconds):
a group SIGTERM, an API process killed while the engine is busy, and overload."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from server_process import HTTP, LMSERVE, Server, alive, start_server, wait_for

LONG = {"prompt": "Count: 1, 2,", "max_tokens": 480, "ignore_eos": True, "temperature": 0}


def tiny_server(tmp_path: Path, tiny_llama_dir: Path, *args: str) -> Server:
    return start_server(tmp_path, "--model", str(tiny_llama_dir), "--dtype", "float32", "--max-model-len", "512",
                        "--kv-cache-memory", "32MiB", *args, timeout=120)


def engine_stats(server: Server) -> dict:
    return HTTP.get(f"{server.base_url}/debug/engine", timeout=5).json()


def stream_in_background(server: Server, body: dict, first_chunk: threading.Event,
                         hang_up: threading.Event | None = None) -> threading.Thread:
    """Reads a streamed completion in a thread; `hang_up` set: the client closes the stream as a user who goes away."""
    def read() -> None:
        try:
            with httpx.stream("POST", f"{server.base_url}/v1/completions", json={**body, "stream": True},
                              timeout=60) as response:
                for _ in response.iter_lines():
                    first_chunk.set()
                    if hang_up is not None and hang_up.is_set():
                        break
        except httpx.HTTPError:
            pass  # the server went away under it, as the test intends
        first_chunk.set()

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "busy"])
def test_group_sigterm_stops_both_processes(tmp_path: Path, tiny_llama_dir: Path, busy: bool) -> None:
    """What systemd, `timeout` and supervisors do: SIGTERM to the whole process group. Before the fix an idle
    server's API process hung after "Finished server process", blocked on a send to the engine that had just
    closed its socket."""
    server = tiny_server(tmp_path, tiny_llama_dir)
    try:
        engine_pid = server.engine_pid
        if busy:
            started = threading.Event()
            stream_in_background(server, LONG, started)
            assert started.wait(30)
        os.killpg(server.process.pid, signal.SIGTERM)
        assert server.process.wait(timeout=15) == 0, server.log()[-2000:]
        assert wait_for(lambda: not alive(engine_pid), timeout=5), "the engine outlived the group SIGTERM"
        assert "Finished server process" in server.log()
        if not busy:  # a stop asked for is no failure: an idle server logs no error (systemd showed one per stop)
            errors = [line for line in server.log().splitlines() if " ERROR " in line]
            assert not errors, errors
    finally:
        server.stop(signal.SIGKILL)


def test_engine_exits_soon_after_the_api_process_is_killed_mid_step(tmp_path: Path, tiny_llama_dir: Path) -> None:
    """Eight requests of 8,000 tokens, one at a time: thousands of steps left when the parent dies. Before the fix
    the engine stepped on for nobody, until its unread outputs filled the socket and a send blocked forever. (With
    480 tokens and "exactly 7 waiting" the first request could end before the check saw 7: a flake on a fast run;
    with 2,000 tokens, a request took under a second and a suite run once never saw 6 waiting.)"""
    server = tiny_server(tmp_path, tiny_llama_dir, "--max-num-seqs", "1", "--max-model-len", "8192")
    try:
        engine_pid = server.engine_pid
        socket_directory = server.socket_directory
        started = threading.Event()
        streams = [stream_in_background(server, {**LONG, "max_tokens": 8000}, started) for _ in range(8)]
        assert started.wait(30)
        assert wait_for(lambda: engine_stats(server)["num_requests_waiting"] >= 6, timeout=30)
        server.process.kill()  # SIGKILL: no cleanup at all in the API process
        server.process.wait(timeout=5)
        gone = wait_for(lambda: not alive(engine_pid), timeout=5)
        assert gone, "the engine kept running (and holding its memory) after its parent died"
        assert not socket_directory.exists(), "the ipc sockets' directory outlived both processes"
        for thread in streams:
            thread.join(10)
    finally:
        server.stop(signal.SIGKILL)
        if alive(engine_pid):
            os.kill(engine_pid, signal.SIGKILL)


def test_max_queued_requests_answers_429_with_retry_after(tmp_path: Path, tiny_llama_dir: Path) -> None:
    # The running request must outlast the checks below: 480 tokens of the tiny model can end within a second,
    # before the second request is even queued, on a loaded machine (the test then saw no waiting request); on a
    # fast one 2,000 tokens could end before a poll saw the second waiting.
    server = tiny_server(tmp_path, tiny_llama_dir, "--max-num-seqs", "1", "--max-queued-requests", "1",
                         "--max-model-len", "8192")
    longer = {**LONG, "max_tokens": 8000}
    try:
        running, queued, hang_up = threading.Event(), threading.Event(), threading.Event()
        stream_in_background(server, longer, running, hang_up)  # takes the only running slot
        assert running.wait(30)
        stream_in_background(server, LONG, queued)  # waits for it: the one queued request allowed

        assert wait_for(lambda: engine_stats(server)["num_requests_waiting"] == 1, timeout=10)
        refused = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=10)
        assert refused.status_code == 429, refused.text
        assert refused.headers["retry-after"] == "1"
        error = refused.json()["error"]
        assert error["code"] == 429 and "--max-queued-requests 1" in error["message"]
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=10)
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=str(tiny_llama_dir), prompt="hi", max_tokens=1)
        # Once the queue drains (the running client goes away, the queued request runs), requests are served again.
        hang_up.set()
        assert queued.wait(60)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            answer = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                                timeout=60)
            if answer.status_code != 429:
                break
            time.sleep(0.2)
        assert answer.status_code == 200, answer.text
    finally:
        server.stop(signal.SIGKILL)


def test_a_busy_port_fails_before_the_engine_starts(tmp_path: Path, tiny_llama_dir: Path) -> None:
    """The port is bound before the engine starts: its ranks open ephemeral ports of their own (gloo, zmq) and once
    took the one the server was about to listen on (CI: "address already in use" after the model had loaded)."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        completed = subprocess.run(
            [str(LMSERVE), "serve", "--model", str(tiny_llama_dir), "--dtype", "float32", "--port", str(port)],
            check=False, capture_output=True, text=True, timeout=60)
    assert completed.returncode == 1
    assert f"cannot serve on 127.0.0.1:{port}" in completed.stderr
    assert "in use" in completed.stderr
    assert "loaded" not in completed.stderr  # no model was loaded for a server that could not listen



def test_an_engine_that_fails_to_start_stops_the_server_with_its_reason(tmp_path: Path, tiny_llama_dir: Path) -> None:
    """A model whose header reads but whose weights cannot load (a truncated safetensors file): the API process starts,
    the engine dies loading, and the server exits non-zero with the engine's reason instead of waiting forever or
    answering 200 on /health; no process is left behind."""
    broken = tmp_path / "broken-model"
    shutil.copytree(tiny_llama_dir, broken)
    (weights,) = broken.glob("*.safetensors")
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen(
        [str(LMSERVE), "serve", "--model", str(broken), "--dtype", "float32", "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 1, output[-3000:]
    last = output.strip().splitlines()[-1]  # what a user reads last: why it stopped
    assert "exiting because the engine died" in last and "SafetensorError" in last, output[-3000:]
    leftover = subprocess.run(["pgrep", "-f", str(broken)], capture_output=True, text=True, check=False).stdout
    assert not leftover.strip(), leftover
