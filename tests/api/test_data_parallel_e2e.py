"""Data parallel over real HTTP: `lmserve serve -dp 2` on the tiny random model, two engine processes behind one
API server, driven by the official openai client."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from pathlib import Path

import httpx
import openai
import pytest
from network_addresses import free_port_block, non_loopback_address
from prometheus_client.parser import text_string_to_metric_families
from server_process import HTTP, LMSERVE, Server, alive, children, start_server, wait_for

from lmserve.config import KV_BLOCK_SIZE

BLOCK_SIZE = KV_BLOCK_SIZE
SHARED_PREFIX = [100 + i for i in range(4 * BLOCK_SIZE)]  # 64 tokens: four full blocks
LONG = {"max_tokens": 480, "ignore_eos": True, "temperature": 0}


def dp_server(tmp_path: Path, tiny_llama_dir: Path) -> Server:
    # One compute thread each: the test machine is small, and the replicas share it. No C++ kernels: data parallel
    # does not depend on them, and a start must not wait for their build.
    return start_server(tmp_path, "--model", str(tiny_llama_dir), "--dtype", "float32", "--max-model-len", "512",
                        "--kv-cache-memory", "16MiB", "-dp", "2", "--engine-threads", "1", "--attention-backend",
                        "sdpa", "--fused-ops", "none", "--quantization", "none", timeout=120)


def engine_pids(server: Server) -> list[int]:
    pids = []
    for pid in children(server.process.pid):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"lmserve.engine.core_proc" in cmdline:
            pids.append(pid)
    return pids


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Server:
    srv = dp_server(tmp_path_factory.mktemp("dp-server"), tiny_llama_dir)
    yield srv
    srv.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(tiny_llama_dir: Path) -> str:
    return str(tiny_llama_dir)


def replicas(server: Server) -> list[dict]:
    return HTTP.get(f"{server.base_url}/debug/engine", timeout=10).json()["engines"]


def test_two_replicas_serve_the_openai_client(server: Server, client: openai.OpenAI, model: str) -> None:
    assert len(engine_pids(server)) == 2
    done = client.completions.create(model=model, prompt="The capital of France is", max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == 6
    pieces = client.completions.create(model=model, prompt="The capital of France is", max_tokens=6, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in pieces) == done.choices[0].text

    question = [{"role": "user", "content": "Hello there"}]
    chat = client.chat.completions.create(model=model, messages=question, max_tokens=6, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 6
    streamed = client.chat.completions.create(model=model, messages=question, max_tokens=6, temperature=0,
                                              stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == chat.choices[0].message.content

    several = client.completions.create(model=model, prompt="Once upon a time", max_tokens=4, n=3, seed=1,
                                        extra_body={"ignore_eos": True})
    assert sorted(c.index for c in several.choices) == [0, 1, 2]
    assert several.usage.completion_tokens == 12


def test_concurrent_requests_spread_over_both_replicas(server: Server, client: openai.OpenAI, model: str) -> None:
    """Chats without a system message all start with the template's default one (more than a block, so the router
    sees a shared prefix): they must still spread, not all follow the prefix to one replica."""
    steps_before = [r["num_steps"] for r in replicas(server)]
    start = threading.Barrier(8)  # all sent together: more than LOAD_SLACK in flight at once on the prefix's owner

    def chat(i: int) -> None:
        start.wait(30)
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": f"Story {i}"}],
                                       max_tokens=48, extra_body={"ignore_eos": True})

    threads = [threading.Thread(target=chat, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    steps_after = [r["num_steps"] for r in replicas(server)]
    assert all(after > before for before, after in zip(steps_before, steps_after, strict=True))


def test_shared_prefix_goes_to_the_replica_that_has_it_and_a_dropped_stream_frees_its_blocks(
    server: Server, client: openai.OpenAI, model: str
) -> None:
    wait_for(lambda: all(r["num_requests_running"] == 0 for r in replicas(server)), timeout=30)
    before = replicas(server)
    # Idle server: the first prompt goes to replica 0 and leaves its four blocks in replica 0's prefix cache.
    client.completions.create(model=model, prompt=SHARED_PREFIX + [7, 8, 9], max_tokens=2)
    first = replicas(server)
    owner = next(i for i in (0, 1) if first[i]["prefix_cache_queries"] > before[i]["prefix_cache_queries"])

    # A long stream makes the owner the busier replica (idle ties go to replica 0, the owner here): least loaded
    # alone would now send the next prompt to the other one.
    with httpx.stream("POST", f"{server.base_url}/v1/completions", timeout=60,
                      json={"model": model, "prompt": "Count: 1, 2,", "stream": True, **LONG}) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        busy = replicas(server)
        assert busy[owner]["num_requests_running"] == 1 and busy[1 - owner]["num_requests_running"] == 0

        client.completions.create(model=model, prompt=SHARED_PREFIX + [10, 11], max_tokens=2)
        second = replicas(server)
        assert second[owner]["prefix_cache_hits"] - first[owner]["prefix_cache_hits"] == len(SHARED_PREFIX)
        assert second[1 - owner]["prefix_cache_queries"] == first[1 - owner]["prefix_cache_queries"]
        assert second[owner]["kv_blocks_used"] > 0  # the long stream's blocks
    # The client went away mid-stream: the request is aborted on its replica, and its blocks freed there.
    assert wait_for(lambda: replicas(server)[owner]["kv_blocks_used"] == 0, timeout=10), replicas(server)
    after = replicas(server)
    assert after[owner]["num_requests_aborted"] == before[owner]["num_requests_aborted"] + 1
    assert all(r["num_requests_running"] == 0 and r["num_requests_waiting"] == 0 for r in after)


def test_metrics_carry_an_engine_label_per_replica(server: Server) -> None:
    per_replica = replicas(server)
    text = HTTP.get(f"{server.base_url}/metrics", timeout=10).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name, field in (("lmserve:prefix_cache_hits", "prefix_cache_hits"), ("lmserve:kv_blocks_total",
                                                                          "kv_blocks_total")):
        values = {s.labels["engine"]: s.value for s in families[name].samples if not s.name.endswith("_created")}
        assert values == {str(i): float(r[field]) for i, r in enumerate(per_replica)}
    debug = HTTP.get(f"{server.base_url}/debug/engine", timeout=10).json()
    assert debug["kv_blocks_total"] == sum(r["kv_blocks_total"] for r in per_replica)  # the top level: the sums
    assert debug["prefix_cache_hits"] == sum(r["prefix_cache_hits"] for r in per_replica)


def test_every_replica_ends_with_no_blocks_used(server: Server) -> None:
    assert wait_for(lambda: all(r["kv_blocks_used"] == 0 for r in replicas(server)), timeout=10), replicas(server)


def test_one_replica_dying_fails_the_server(server: Server) -> None:
    """Last of the module's server's tests: it ends the server. (SIGTERM stopping every replica is checked on the
    two-machine server below, whose front-end has a replica of its own too.)"""
    try:
        pids = engine_pids(server)
        assert len(pids) == 2
        os.kill(pids[1], signal.SIGKILL)
        assert wait_for(lambda: HTTP.get(f"{server.base_url}/health", timeout=2).status_code == 503, timeout=5)
        response = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=5)
        assert response.status_code == 503
        assert server.process.wait(timeout=20) == 1
        assert "replica 1" in server.log()
        assert wait_for(lambda: not alive(pids[0]), timeout=10), "the other replica outlived the server"
    finally:
        server.stop(signal.SIGKILL)


@pytest.mark.slow  # several machines, simulated
def test_replicas_on_another_machine_serve_behind_one_front_end(tmp_path: Path, tiny_llama_dir: Path) -> None:
    """vLLM's multi-node data parallel: the front-end runs replica 0 (--data-parallel-size-local 1) and waits for
    replica 1, which `lmserve serve --data-parallel-start-rank 1 --headless` starts "on another machine" (a process
    meeting it on this machine's network address). Both serve; replica 1's engine dying fails the server, naming it;
    and a headless node whose front-end shut down cleanly exits 0."""
    host = non_loopback_address()
    port = free_port_block(host, 4)
    flags = ["--model", str(tiny_llama_dir), "--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory",
             "16MiB", "-dp", "2", "--engine-threads", "1", "--attention-backend", "sdpa", "--fused-ops", "none",
             "--quantization", "none", "--data-parallel-address", host, "--data-parallel-rpc-port", str(port)]

    def start_node() -> subprocess.Popen:
        log = (tmp_path / "node1.log").open("a")
        return subprocess.Popen([str(LMSERVE), "serve", *flags, "--data-parallel-start-rank", "1", "--headless"],
                                stdout=log, stderr=log)

    node = start_node()
    server = start_server(tmp_path, *flags, "--data-parallel-size-local", "1", timeout=120)
    try:
        assert len(engine_pids(server)) == 1  # replica 1 is the other node's
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
        test_concurrent_requests_spread_over_both_replicas(server, client, str(tiny_llama_dir))
        (remote_engine,) = children(node.pid)
        os.kill(remote_engine, signal.SIGKILL)
        assert server.process.wait(timeout=30) == 1
        assert "engine replica 1 on another machine disconnected" in server.log()
        assert node.wait(timeout=30) == 1
    finally:
        server.stop(signal.SIGKILL)
        node.kill()
        node.wait()
    node = start_node()
    server = start_server(tmp_path, *flags, "--data-parallel-size-local", "1", timeout=120)
    try:  # SIGTERM stops every replica, the front-end's own and the other machine's, and each exits cleanly
        (local_engine,) = engine_pids(server)
        (remote_engine,) = children(node.pid)
        assert server.stop(signal.SIGTERM) == 0
        assert node.wait(timeout=30) == 0, (tmp_path / "node1.log").read_text()[-2000:]
        assert wait_for(lambda: not alive(local_engine) and not alive(remote_engine), timeout=10), \
            "a replica outlived the server"
    finally:
        server.stop(signal.SIGKILL)
        node.kill()
        node.wait()
