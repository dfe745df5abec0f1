"""`lmserve serve --async-scheduling` over real HTTP with the openai client: greedy completions, streamed and not,
with stop strings (which the front-end finds and the engine stops, while the next step is already computing),
give what the synchronous server gives, one at a time and concurrently."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from server_process import Server, debug_engine, start_servers, wait_for

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Iterator[tuple[Server, Server]]:
    common = (str(tiny_llama_dir), "--dtype", "float32", "--quantization", "none", "--kv-cache-memory", "16MiB",
              "--max-model-len", "256", "--max-num-batched-tokens", "16")
    synchronous, asynchronous = start_servers(tmp_path_factory.mktemp("async-server"), common,
                                              (*common, "--async-scheduling"))
    try:
        yield synchronous, asynchronous
    finally:
        asynchronous.stop(signal.SIGKILL)
        synchronous.stop(signal.SIGKILL)


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def complete(server: Server, model: str, prompt: str, stream: bool, **kwargs) -> tuple[str, str | None]:
    params = {"model": model, "prompt": prompt, "max_tokens": 24, "temperature": 0, "extra_body": {"ignore_eos": True},
              **kwargs}
    if not stream:
        choice = client(server).completions.create(**params).choices[0]
        return choice.text, choice.finish_reason
    text, finish = "", None
    for chunk in client(server).completions.create(**params, stream=True):
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


def test_completions_with_stop_strings_equal_the_synchronous_servers(servers, tiny_llama_dir: Path) -> None:
    synchronous, asynchronous = servers
    model = str(tiny_llama_dir)
    cases = []
    for prompt in PROMPTS:
        full, finish = complete(synchronous, model, prompt, stream=False)
        assert finish == "length" and len(full) > 20
        assert complete(asynchronous, model, prompt, stream=False) == (full, "length")
        assert complete(asynchronous, model, prompt, stream=True) == (full, "length")
        # Stops that start early, in the middle and near the end (the request stops with a step in flight).
        stops = {full[k : k + 3].strip() for k in (2, len(full) // 2, len(full) - 5)} - {""}
        cases += [(prompt, stop, full[: full.index(stop)]) for stop in sorted(stops)]
    for prompt, stop, expected in cases:
        for stream in (False, True):
            want = complete(synchronous, model, prompt, stream, stop=[stop])
            assert want == (expected, "stop")
            assert complete(asynchronous, model, prompt, stream, stop=[stop]) == want, (prompt, stop, stream)

    results: dict[tuple[int, bool], tuple[str, str | None]] = {}

    def run(i: int, stream: bool) -> None:
        prompt, stop, _ = cases[i % len(cases)]
        results[i, stream] = complete(asynchronous, model, prompt, stream, stop=[stop])

    threads = [threading.Thread(target=run, args=(i, s)) for i in range(len(cases)) for s in (False, True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == {(i, s): (cases[i][2], "stop") for i in range(len(cases)) for s in (False, True)}
    stats = wait_for(lambda: (s := debug_engine(asynchronous))["num_requests_running"] == 0 and s, timeout=10)
    assert stats["kv_blocks_used"] == 0 and stats["num_requests_waiting"] == 0
