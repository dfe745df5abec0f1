"""Prefill/decode disaggregation end to end: `lmserve serve` as kv_producer and as kv_consumer over one directory,
`lmserve router` in front, the official client talking to the router. Greedy answers equal one instance's, streamed
and not; the decode instance loads the prompt's blocks instead of computing them; neither holds a block afterwards.
The same over PyNcclConnector (torch.distributed between the instances), with two pipeline stages on each side: a link per
rank."""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from network_addresses import free_port_block
from server_process import HTTP, LMSERVE, Server, free_port, start_servers, wait_for

MODEL = "smollm2-135m-instruct"
PROMPT = ("Paris is the capital of France. It lies on the Seine, in the north of the country, and has been a centre "
          "of finance, diplomacy, commerce and science for centuries. Its most famous landmark is")


def transfer(role: str, path: Path) -> str:
    return json.dumps({"kv_connector": "SharedStorageConnector", "kv_role": role,
                       "kv_connector_extra_config": {"shared_storage_path": str(path)}})


def start_router(tmp: Path, prefill: Server, decode: Server) -> Server:
    port = free_port()
    log_path = tmp / f"router-{port}.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen([str(LMSERVE), "router", "--prefill", prefill.base_url, "--decode", decode.base_url,
                                    "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    router = Server(process, f"http://127.0.0.1:{port}", log_path)

    def healthy() -> bool:
        try:
            return HTTP.get(f"{router.base_url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    if not wait_for(healthy, timeout=60, interval=0.2):
        router.stop(signal.SIGKILL)
        raise RuntimeError(f"router not healthy:\n{router.log()}")
    return router


def engine(server: Server) -> dict:
    return HTTP.get(f"{server.base_url}/debug/engine", timeout=10).json()


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server, Server]]:
    tmp = tmp_path_factory.mktemp("disaggregated")
    common = ("--max-model-len", "1024", "--kv-cache-memory", "64MiB")
    prefill, decode = start_servers(tmp, (*common, "--kv-transfer-config", transfer("kv_producer", tmp / "kv")),
                                    (*common, "--kv-transfer-config", transfer("kv_consumer", tmp / "kv")))
    router = start_router(tmp, prefill, decode)
    yield prefill, decode, router
    for server in (router, decode, prefill):
        server.stop()


@pytest.fixture(scope="module")
def linked_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server, Server]]:
    tmp = tmp_path_factory.mktemp("linked")
    port = free_port_block("127.0.0.1", 2)  # a link per rank: kv_port and kv_port + 1
    common = ("-pp", "2", "--max-model-len", "1024", "--kv-cache-memory", "64MiB")
    prefill, decode = start_servers(tmp, (*common, "--kv-transfer-config", link("kv_producer", port)),
                                    (*common, "--kv-transfer-config", link("kv_consumer", port)))
    router = start_router(tmp, prefill, decode)
    yield prefill, decode, router
    for server in (router, decode, prefill):
        server.stop()


def link(role: str, port: int) -> str:
    return json.dumps({"kv_connector": "PyNcclConnector", "kv_role": role, "kv_port": port})


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=60)


def test_the_router_answers_as_one_instance_with_the_prompt_loaded(pair) -> None:
    prefill, decode, router = pair
    ask = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    loaded_before = engine(decode)["kv_transfer_loaded_tokens"]
    answer = client(router).completions.create(**ask)
    loaded = engine(decode)["kv_transfer_loaded_tokens"] - loaded_before
    full_blocks = (answer.usage.prompt_tokens - 1) // 16
    assert full_blocks >= 2 and loaded == 16 * full_blocks  # decode computed only the prompt's last part
    assert engine(prefill)["kv_transfer_saved_blocks"] >= full_blocks
    # The prefill instance is a whole server too: asked directly, it gives the same answer.
    direct = client(prefill).completions.create(**ask)
    assert answer.choices[0].text == direct.choices[0].text and answer.usage.completion_tokens == 24

    streamed = "".join(c.choices[0].text for c in client(router).completions.create(**ask, stream=True) if c.choices)
    assert streamed == direct.choices[0].text


def test_chat_through_the_router_and_nothing_held_afterwards(pair) -> None:
    prefill, decode, router = pair
    messages = [{"role": "user", "content": PROMPT + " what? Answer in one sentence."}]
    via_router = client(router).chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    direct = client(prefill).chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert via_router.choices[0].message.content == direct.choices[0].message.content
    for server in (prefill, decode):
        stats = wait_for(lambda s=server: (e := engine(s))["num_requests_running"] == 0 and e, timeout=10)
        assert stats["kv_blocks_used"] == 0 and stats["num_requests_waiting"] == 0


def test_the_responses_api_through_the_router(pair) -> None:
    prefill, decode, router = pair
    ask = {"model": MODEL, "input": "In a few words: " + PROMPT, "max_output_tokens": 12, "temperature": 0}
    loaded_before = engine(decode)["kv_transfer_loaded_tokens"]
    answer = client(router).responses.create(**ask)
    assert engine(decode)["kv_transfer_loaded_tokens"] > loaded_before
    assert answer.output_text == client(prefill).responses.create(**ask).output_text
    with client(router).responses.stream(**ask) as stream:
        assert stream.get_final_response().output_text == answer.output_text


def test_a_client_leaving_the_router_frees_both_instances(pair) -> None:
    """Streamed or not, a client that goes away mid-answer ends the request on the decode instance."""
    prefill, decode, router = pair
    ask = {"model": MODEL, "prompt": PROMPT, "max_tokens": 800, "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", f"{router.base_url}/v1/completions", json={**ask, "stream": True}, timeout=60) as stream:
        lines = stream.iter_lines()
        assert [next(lines) for _ in range(6)]  # decoding on the decode instance
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{router.base_url}/v1/completions", json=ask, timeout=3)
    for server in (prefill, decode):
        stats = wait_for(lambda s=server: (e := engine(s))["num_requests_running"] == 0 and e, timeout=20)
        assert stats and stats["kv_blocks_used"] == 0 and stats["num_requests_waiting"] == 0
    assert engine(decode)["num_requests_aborted"] >= 2


def test_the_routers_errors(pair) -> None:
    _prefill, _decode, router = pair
    bad = httpx.post(f"{router.base_url}/v1/completions", content=b"{not json", timeout=10)
    assert bad.status_code == 400 and "JSON" in bad.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError):  # the instance's own 400 reaches the client as it was sent
        client(router).completions.create(model=MODEL, prompt="x", max_tokens=1, temperature=-3)
    assert HTTP.get(f"{router.base_url}/v1/models", timeout=10).json()["data"][0]["id"] == MODEL


def test_a_router_whose_decode_instance_is_gone_says_so(pair, tmp_path: Path) -> None:
    prefill, _, _ = pair
    gone = Server(subprocess.Popen(["true"]), f"http://127.0.0.1:{free_port()}", tmp_path / "none.log")
    port = free_port()
    with open(tmp_path / "router.log", "w") as log:
        process = subprocess.Popen([str(LMSERVE), "router", "--prefill", prefill.base_url, "--decode", gone.base_url,
                                    "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    router = Server(process, f"http://127.0.0.1:{port}", tmp_path / "router.log")
    try:
        health = wait_for(lambda: _status(f"{router.base_url}/health"), timeout=60, interval=0.2)
        assert health == 503
        answer = httpx.post(f"{router.base_url}/v1/completions", timeout=30,
                            json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert answer.status_code == 502 and "ConnectError" in answer.json()["error"]["message"]
    finally:
        router.stop()


def _status(url: str) -> int | None:
    try:
        return HTTP.get(url, timeout=10).status_code
    except httpx.HTTPError:
        return None


@pytest.mark.slow  # several machines, simulated
def test_over_torch_distributed_each_rank_sends_its_part_and_the_answer_is_one_instances(linked_pair) -> None:
    prefill, decode, router = linked_pair
    assert wait_for(lambda: decode.log().count("linked to the kv_producer") == 2, timeout=60), decode.log()
    ask = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    answer = client(router).completions.create(**ask)
    full_blocks = (answer.usage.prompt_tokens - 1) // 16
    assert full_blocks >= 2 and engine(decode)["kv_transfer_loaded_tokens"] == 16 * full_blocks
    direct = client(prefill).completions.create(**ask)
    assert answer.choices[0].text == direct.choices[0].text and answer.usage.completion_tokens == 24
    chat = [{"role": "user", "content": PROMPT + " what? Answer in one sentence."}]
    streamed = "".join(c.choices[0].delta.content or "" for c in client(router).chat.completions.create(
        model=MODEL, messages=chat, max_tokens=16, temperature=0, stream=True) if c.choices)
    direct_chat = client(prefill).chat.completions.create(model=MODEL, messages=chat, max_tokens=16, temperature=0)
    assert streamed == direct_chat.choices[0].message.content
    assert engine(decode)["kv_transfer_loaded_tokens"] > 16 * full_blocks  # the chat's prompt came over the link too
    for server in (prefill, decode):
        stats = wait_for(lambda s=server: (e := engine(s))["num_requests_running"] == 0 and e, timeout=10)
        assert stats["kv_blocks_used"] == 0 and stats["num_requests_waiting"] == 0
