"""`lmserve serve --speculative-config` end to end with the openai client: a streamed chat that copies its prompt
gives the text the same request gets without speculation (greedy), several tokens arrive per step, the counters are
in /metrics, and a bad config is refused at start-up with a clear message."""

from __future__ import annotations

import json
import signal
import subprocess

import httpx
import openai
import pytest
from server_process import LMSERVE, Server, start_server
from test_measurement_e2e import scrape

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
TEXT = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"
MESSAGES = [{"role": "user", "content": f"Copy this code exactly:\n\n{TEXT}"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Server:
    srv = start_server(tmp_path_factory.mktemp("server"), "--speculative-config", json.dumps(SPEC))
    yield srv
    srv.stop(signal.SIGKILL)


def test_streamed_chat_with_drafts_gives_the_plain_text(server: Server) -> None:
    from lmserve import LLM, SamplingParams

    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    before = scrape(server)
    chunks = list(client.chat.completions.create(model=client.models.list().data[0].id, messages=MESSAGES,
                                                 max_tokens=60, temperature=0, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    plain = LLM(max_model_len=2048, num_blocks=64)
    expected = plain.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=60))[0].outputs[0].text
    assert text == expected
    after = scrape(server)
    accepted = after["lmserve:spec_decode_num_accepted_tokens_total"] - before.get(
        "lmserve:spec_decode_num_accepted_tokens_total", 0)
    assert 0 < accepted <= after["lmserve:spec_decode_num_draft_tokens_total"]
    assert after["lmserve:spec_decode_num_accepted_tokens_per_pos_total{position=0}"] > 0
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_a_bad_speculative_config_is_refused_at_start_up() -> None:
    for value, message in (('{"method": "ngram"}', "num_speculative_tokens must be"),
                           ('{"method": "medusa", "num_speculative_tokens": 3}', "medusa is not supported"),
                           ('{"model": "/no/such/draft", "num_speculative_tokens": 3}', "/no/such/draft"),
                           ("{not json", "not valid JSON")):
        done = subprocess.run([str(LMSERVE), "serve", "--speculative-config", value], capture_output=True, check=False,
                              text=True, timeout=120)
        assert done.returncode != 0
        assert message in done.stderr, done.stderr[-2000:]
        assert "Traceback" not in done.stderr


def test_a_draft_model_serves_the_plain_text(tmp_path) -> None:
    """`--speculative-config '{"model": ...}'` in the server: the default model drafting for itself."""
    from lmserve import LLM, SamplingParams
    from lmserve.models import DEFAULT_MODEL, resolve_model

    draft = {"model": str(resolve_model(DEFAULT_MODEL).path), "num_speculative_tokens": 3}
    server = start_server(tmp_path, "--speculative-config", json.dumps(draft))
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        done = client.chat.completions.create(model=client.models.list().data[0].id, messages=MESSAGES,
                                              max_tokens=40, temperature=0)
        plain = LLM(max_model_len=2048, num_blocks=64)
        expected = plain.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=40))[0].outputs[0].text
        assert done.choices[0].message.content == expected
        assert scrape(server)["lmserve:spec_decode_num_accepted_tokens_total"] > 0
    finally:
        server.stop(signal.SIGKILL)
