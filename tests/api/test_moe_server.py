"""A mixture-of-experts GGUF (Qwen3-MoE, Q4_K/Q6_K experts) served end to end: completions whole and streamed give
the same greedy tokens, and the experts' load shows in /debug/engine and /metrics."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from server_process import HTTP, Server, debug_engine, start_server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, moe_kquant: tuple[Path, Path]) -> Iterator[Server]:
    running = start_server(tmp_path_factory.mktemp("moe-server"), "--model", str(moe_kquant[1]),
                           "--served-model-name", "moe", "--kv-cache-memory", "16MiB")
    yield running
    running.stop()


@pytest.fixture(scope="module")
def oai(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_whole_and_streamed_give_the_same_tokens(oai: openai.OpenAI) -> None:
    whole = oai.completions.create(model="moe", prompt="Hello there", max_tokens=8, temperature=0)
    assert whole.usage.completion_tokens == 8 or whole.choices[0].finish_reason == "stop"
    chunks = list(oai.completions.create(model="moe", prompt="Hello there", max_tokens=8, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text


def test_the_experts_load_is_visible(server: Server, oai: openai.OpenAI) -> None:
    before = debug_engine(server)["moe_expert_tokens"]
    reply = oai.completions.create(model="moe", prompt="The experts", max_tokens=4, temperature=0)
    after = debug_engine(server)["moe_expert_tokens"]
    assert sorted(after, key=int) == ["0", "1"]
    routed = reply.usage.prompt_tokens + reply.usage.completion_tokens - 1  # the last token is sampled, not computed
    for layer, counts in after.items():
        assert len(counts) == 8
        assert sum(counts) - sum(before.get(layer, [0] * 8)) == 2 * routed  # top 2 of 8
    metrics = HTTP.get(f"{server.base_url}/metrics").text
    series = [line for line in metrics.splitlines() if line.startswith("lmserve:moe_expert_tokens_total{")]
    assert len(series) == 2 * 8
    assert sum(float(line.rsplit(" ", 1)[1]) for line in series) == sum(sum(c) for c in after.values())
