"""Gemma 3 and Phi-3 served end to end.

A Gemma 3 GGUF without a chat template (as the third-party files come): chat gets Gemma's own turns with one <bos>,
generation ends on <end_of_turn> (which llama.cpp ends on and the header does not name), and a doubled <bos>, which
would change the output, never reaches the model. A Phi-3 GGUF (fused matrices in Q8_0 blocks, LongRoPE) answers
chat, streamed and not, with the same tokens."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from server_process import Server, start_server

BOS, END_OF_TURN, START_OF_TURN = 2, 5, 4  # the tiny vocabulary's ids (conftest.gemma_vocabulary)
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_gemma3_chat_gguf: Path) -> Iterator[Server]:
    running = start_server(tmp_path_factory.mktemp("gemma-server"), "--model", str(tiny_gemma3_chat_gguf),
                           "--served-model-name", "gemma", "--kv-cache-memory", "16MiB")
    yield running
    running.stop()


@pytest.fixture(scope="module")
def oai(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def tokenize(server: Server, **body) -> dict:
    response = httpx.post(f"{server.base_url}/tokenize", json={"model": "gemma", **body}, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def test_chat_is_rendered_in_gemma_s_turns_with_one_bos(server: Server, oai: openai.OpenAI) -> None:
    system = [{"role": "system", "content": "Be brief."}, *HI]
    rendered = tokenize(server, messages=system, return_token_strs=True)
    assert "".join(rendered["token_strs"]) == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    )
    assert rendered["tokens"][:2] == [BOS, START_OF_TURN] and rendered["tokens"].count(BOS) == 1
    reply = oai.chat.completions.create(model="gemma", messages=system, max_tokens=3, temperature=0)
    assert reply.usage.prompt_tokens == rendered["count"]
    # A completion prompt gets the file's add_bos_token: one <bos>, as llama.cpp tokenizes it.
    assert tokenize(server, prompt="Hi")["tokens"] == [BOS, *tokenize(server, prompt="Hi", add_special_tokens=False)["tokens"]]


def test_generation_ends_on_end_of_turn(oai: openai.OpenAI) -> None:
    forced = {str(END_OF_TURN): 100}
    reply = oai.chat.completions.create(model="gemma", messages=HI, max_tokens=5, logit_bias=forced)
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens == 1 and reply.choices[0].message.content == ""
    chunks = list(oai.chat.completions.create(model="gemma", messages=HI, max_tokens=5, logit_bias=forced, stream=True))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    # The same token is only text to a request that ignores EOS: the stop came from the model's end-of-generation set.
    ignored = oai.completions.create(model="gemma", prompt="Hi", max_tokens=3, logit_bias=forced,
                                     extra_body={"ignore_eos": True})
    assert ignored.choices[0].finish_reason == "length" and ignored.usage.completion_tokens == 3


def test_chat_computes_what_the_single_bos_prompt_computes_and_a_doubled_bos_would_not(
    server: Server, oai: openai.OpenAI
) -> None:
    ids = tokenize(server, messages=HI)["tokens"]
    chat = oai.chat.completions.create(model="gemma", messages=HI, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=3)
    single = oai.completions.create(model="gemma", prompt=ids, max_tokens=4, temperature=0, logprobs=3)
    doubled = oai.completions.create(model="gemma", prompt=[BOS, *ids], max_tokens=4, temperature=0, logprobs=3)
    chat_first = chat.choices[0].logprobs.content[0].logprob
    assert chat_first == pytest.approx(single.choices[0].logprobs.token_logprobs[0], abs=1e-5)
    assert abs(doubled.choices[0].logprobs.token_logprobs[0] - chat_first) > 1e-3


@pytest.fixture(scope="module")
def phi3(tmp_path_factory: pytest.TempPathFactory, tiny_phi3_q8_gguf: Path, tiny_phi3_dir: Path) -> Iterator[Server]:
    running = start_server(tmp_path_factory.mktemp("phi3-server"), "--model", str(tiny_phi3_q8_gguf),
                           "--tokenizer", str(tiny_phi3_dir), "--served-model-name", "phi3",
                           "--kv-cache-memory", "16MiB")
    yield running
    running.stop()


def test_phi3_answers_chat_streamed_and_not_with_the_same_tokens(phi3: Server) -> None:
    client = openai.OpenAI(base_url=f"{phi3.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    ask = {"model": "phi3", "messages": HI, "max_tokens": 12, "temperature": 0,
           "extra_body": {"ignore_eos": True}}
    whole = client.chat.completions.create(**ask)
    assert whole.usage.completion_tokens == 12 and whole.choices[0].finish_reason == "length"
    streamed = client.chat.completions.create(**ask, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == whole.choices[0].message.content and text
