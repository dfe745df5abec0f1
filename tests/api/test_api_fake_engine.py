"""The API server over real HTTP (uvicorn in a thread) against a scripted fake engine client.

The fake answers every prompt by repeating its words one token at a time, so expected texts, token counts and
logprobs are known exactly; prompts with marker words make it stream forever or die mid-request.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
from server_thread import ServerThread

from lmserve import __version__
from lmserve.api.server import build_app
from lmserve.frontend.async_llm import merge_into
from lmserve.frontend.errors import EngineDeadError
from lmserve.frontend.input_processor import PromptTooLongError
from lmserve.metrics.clock import now
from lmserve.metrics.stats import RequestTimeline
from lmserve.outputs import CompletionOutput, Logprobs, RequestOutput
from lmserve.sampling_params import SamplingParams

MODEL = "fake-model"
MAX_MODEL_LEN = 64
BOS = "<s>"
FOREVER = "forever"  # the fake streams this word until max_tokens, slowly
DIE = "die"  # the fake raises EngineDeadError after its first token
BOOM = "boom"  # the fake fails with an unexpected error before its first output


class FakeEngine:
    """An EngineClient whose answer is the prompt's words (child 1 of n>1 answers in upper case)."""

    model_name = MODEL
    max_model_len = MAX_MODEL_LEN

    def __init__(self) -> None:
        self.is_ready = True
        self.errored = False
        self.vocab: dict[str, int] = {BOS: 0}
        self.words: list[str] = [BOS]
        self.prompts: dict[str, list[int]] = {}  # request id -> prompt token ids
        self.finished: set[str] = set()
        self.closed_early: set[str] = set()  # generator closed before its last output
        self.aborted: set[str] = set()
        self.on_step = None
        self.default_sampling: dict[str, Any] = {}
        self.fim_tokens = None  # no fill-in-the-middle tokens (tests/api/test_fim.py gives some)
        self.chat_format = None  # the chat template's own text (tests/api/test_harmony.py: "harmony")
        self.pooling = None  # a generative model: no embeddings
        self.embedding_size = 0
        self.num_outputs: dict[str, int] = {}  # request id -> outputs yielded so far
        self.timelines: dict[str, list[RequestTimeline]] = {}

    # --------------------------------------------------------------------------- tokenizer side
    def _id(self, word: str) -> int:
        if word not in self.vocab:
            self.vocab[word] = len(self.words)
            self.words.append(word)
        return self.vocab[word]

    def tokenize(self, text: str, add_special_tokens: bool | None = None, split_special_tokens: bool = False) -> list[int]:
        if add_special_tokens is not None:  # the EngineClient's tokenize
            return self.prompt_token_ids(text, add_special_tokens)
        return [self._id(w) for w in text.split()]

    def prompt_token_ids(self, prompt: str | list[int], add_special_tokens: bool) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        return ([0] if add_special_tokens else []) + self.tokenize(prompt)

    def decode_token(self, token_id: int) -> str:
        return self.words[token_id]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kw: Any) -> str:
        turns = " ".join(f"{m['role']}: {m['content']}" for m in messages)
        return turns + (" assistant:" if add_generation_prompt else "")

    def render_chat(self, messages: list[dict], add_generation_prompt: bool, template_kwargs: dict,
                    add_special_tokens: bool = False) -> list[int]:
        self.template_kwargs = template_kwargs
        return self.prompt_token_ids(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens)

    # --------------------------------------------------------------------------- engine side
    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str, priority: int = 0,
        arrival_time: float | None = None, final_only: bool = False, cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        deltas = self._deltas(prompt, params, request_id, arrival_time)
        if not final_only:
            async for delta in deltas:
                yield delta
            return
        whole = None  # as AsyncLLM: the whole output once, at the end
        async for delta in deltas:
            if whole is None:
                whole = delta
            else:
                merge_into(whole, delta)
        if whole is not None:
            yield whole

    async def _deltas(
        self, prompt: str | list[int], params: SamplingParams, request_id: str, arrival_time: float | None,
    ) -> AsyncIterator[RequestOutput]:
        ids = self.prompt_token_ids(prompt, add_special_tokens=True)
        if not ids:
            raise ValueError("prompt is empty")
        max_tokens = params.max_tokens or MAX_MODEL_LEN - len(ids)
        if len(ids) + max_tokens > MAX_MODEL_LEN:
            raise PromptTooLongError(
                f"this model's maximum context length is {MAX_MODEL_LEN} tokens, but {len(ids)} prompt tokens "
                f"plus max_tokens={max_tokens} would need {len(ids) + max_tokens}"
            )
        self.prompts[request_id] = ids
        timeline = RequestTimeline(request_id, request_id, arrival_time or now(), now(), num_prompt_tokens=len(ids))
        self.timelines[request_id] = [timeline]
        words = [self.words[t] for t in ids if t != 0]
        if BOOM in words:
            raise RuntimeError("a bug in the engine client")
        forever = FOREVER in words
        answer = [FOREVER] * max_tokens if forever else words[:max_tokens]
        finish = "length" if forever or len(words) > max_tokens else "stop"
        try:
            for step, word in enumerate(answer):
                await asyncio.sleep(0.02 if forever else 0)
                if step == 1 and DIE in words:
                    raise EngineDeadError("engine core died")
                last = step == len(answer) - 1
                outputs = [
                    self._child(i, step, word, params, finish if last else None) for i in range(params.n)
                ]
                self.num_outputs[request_id] = step + 1
                yield RequestOutput(
                    request_id, prompt if isinstance(prompt, str) else None, ids, outputs, finished=last
                )
            self.finished.add(request_id)
            timeline.finished, timeline.finish_reason = now(), finish
            timeline.num_output_tokens = len(answer) * params.n
        finally:
            if request_id not in self.finished:
                self.closed_early.add(request_id)
                timeline.finished, timeline.finish_reason = now(), "abort"

    def _child(self, index: int, step: int, word: str, params: SamplingParams, finish: str | None) -> CompletionOutput:
        word = word.upper() if index % 2 else word
        token_id = self._id(word)
        logprobs = None
        if params.logprobs is not None:
            top = [(token_id, -0.5), (self._id("alt"), -1.5), (self._id("other"), float("-inf"))]
            logprobs = [Logprobs(token_id, -0.5, 1, top[: params.logprobs])]
        text = word if step == 0 else " " + word
        return CompletionOutput(index, text, [token_id], logprobs, finish, None)

    async def get_stats(self, request_ids: list[str] | None = None) -> dict:
        return {
            "num_requests_running": 2, "num_requests_waiting": 1, "kv_blocks_used": 10, "kv_blocks_free": 90,
            "kv_blocks_total": 100, "kv_cache_usage_perc": 0.1, "prefix_cache_queries": 50,
            "prefix_cache_hits": 20, "num_preemptions": 3,
        }

    async def abort(self, request_id: str) -> None:
        # Suspends first, as a real client does: an abort awaited in a cancelled scope must still get through.
        await asyncio.sleep(0.001)
        self.aborted.add(request_id)

    def get_timelines(self, request_id: str) -> list[RequestTimeline]:
        return list(self.timelines.get(request_id, ()))

    def pop_timelines(self, request_id: str) -> list[RequestTimeline]:
        return self.timelines.pop(request_id, [])

    # --------------------------------------------------------------------------- test helpers
    def ids_with_word(self, word: str) -> set[str]:
        return {rid for rid, ids in self.prompts.items() if self.vocab.get(word) in ids}

    def stopped_early(self) -> set[str]:
        return self.closed_early | self.aborted


@pytest.fixture(scope="module")
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture(scope="module")
def server(engine: FakeEngine) -> Iterator[ServerThread]:
    with ServerThread(build_app(engine)) as running:
        yield running


@pytest.fixture(autouse=True)
def healthy(engine: FakeEngine) -> Iterator[None]:
    engine.is_ready, engine.errored = True, False
    yield
    engine.is_ready, engine.errored = True, False


# Clients are module-wide: building one (its SSL context) costs ~0.1 s, more than most tests here.
@pytest.fixture(scope="module")
def oai(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=10)


@pytest.fixture(scope="module")
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=10) as client:
        yield client


def wait_for(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def sse_events(response: httpx.Response) -> list[Any]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


# ------------------------------------------------------------------------------------------------ completions


def test_completion(oai: openai.OpenAI, engine: FakeEngine) -> None:
    out = oai.completions.create(model=MODEL, prompt="the quick brown fox", max_tokens=16)
    assert out.object == "text_completion" and out.model == MODEL and out.id.startswith("cmpl-")
    assert [(c.index, c.text, c.finish_reason) for c in out.choices] == [(0, "the quick brown fox", "stop")]
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (5, 4, 9)
    assert not engine.stopped_early() & engine.ids_with_word("quick")  # a finished request is not aborted


def test_completion_length_and_default_max_tokens(oai: openai.OpenAI) -> None:
    out = oai.completions.create(model=MODEL, prompt="one two three four", max_tokens=2)
    assert (out.choices[0].text, out.choices[0].finish_reason) == ("one two", "length")
    words = " ".join(f"w{i}" for i in range(20))
    out = oai.completions.create(model=MODEL, prompt=words)  # OpenAI's default max_tokens is 16
    assert out.usage.completion_tokens == 16


def test_completion_stream_matches_non_stream(oai: openai.OpenAI) -> None:
    prompt = "streams concatenate to the same text"
    whole = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=10).choices[0].text
    chunks = list(oai.completions.create(
        model=MODEL, prompt=prompt, max_tokens=10, stream=True, stream_options={"include_usage": True}
    ))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert all(c.usage is None for c in chunks[:-1])


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(oai: openai.OpenAI) -> None:
    chunks = list(oai.completions.create(
        model=MODEL, prompt="streams concatenate to the same text", max_tokens=10, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    ))
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == 6 and len(counts) > 1
    assert all(c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


@pytest.mark.parametrize("stream", [False, None])
def test_stream_options_without_a_stream_are_refused(oai: openai.OpenAI, stream: bool | None) -> None:
    extra = {} if stream is None else {"stream": stream}
    with pytest.raises(openai.BadRequestError, match="stream_options is only allowed when stream is true"):
        oai.completions.create(model=MODEL, prompt="x", stream_options={"include_usage": True}, **extra)
    with pytest.raises(openai.BadRequestError, match="stream_options"):
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                    stream_options={"include_usage": True}, **extra)


def test_vllms_prompt_fields_are_honoured(oai: openai.OpenAI) -> None:
    """add_special_tokens (the fake's BOS is token 0), top_logprobs 0 without logprobs, continue_final_message's
    checks; truncate_prompt_tokens is bounded here and applied by the front-end (tests/frontend, server e2e)."""
    def prompt_tokens(**extra: Any) -> int:
        return oai.completions.create(model=MODEL, prompt="a b c d", max_tokens=2, extra_body=extra).usage.prompt_tokens

    assert prompt_tokens() == 5 and prompt_tokens(add_special_tokens=False) == 4
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
        prompt_tokens(truncate_prompt_tokens=0)
    messages = [{"role": "user", "content": "hi"}]
    plain = oai.chat.completions.create(model=MODEL, messages=messages, top_logprobs=0)
    assert plain.choices[0].logprobs is None
    with_bos = oai.chat.completions.create(model=MODEL, messages=messages, extra_body={"add_special_tokens": True})
    assert with_bos.usage.prompt_tokens == plain.usage.prompt_tokens + 1
    with pytest.raises(openai.BadRequestError, match="add_generation_prompt"):
        oai.chat.completions.create(model=MODEL, messages=messages, extra_body={"continue_final_message": True})
    with pytest.raises(openai.BadRequestError, match="may not set continue_final_message"):
        oai.chat.completions.create(model=MODEL, messages=messages,
                                    extra_body={"chat_template_kwargs": {"continue_final_message": True}})


def test_completion_n_and_prompt_list(oai: openai.OpenAI, engine: FakeEngine) -> None:
    out = oai.completions.create(model=MODEL, prompt=["a b", "c d e"], n=2, max_tokens=5)
    assert [(c.index, c.text) for c in out.choices] == [(0, "a b"), (1, "A B"), (2, "c d e"), (3, "C D E")]
    assert len(engine.ids_with_word("e")) == 1 and not engine.ids_with_word("e") & engine.stopped_early()
    assert out.usage.prompt_tokens == 3 + 4 and out.usage.completion_tokens == 2 * 2 + 3 * 2

    texts: dict[int, str] = {}
    for chunk in oai.completions.create(model=MODEL, prompt=["a b", "c d e"], n=2, max_tokens=5, stream=True):
        assert len(chunk.choices) == 1
        texts[chunk.choices[0].index] = texts.get(chunk.choices[0].index, "") + chunk.choices[0].text
    assert texts == {0: "a b", 1: "A B", 2: "c d e", 3: "C D E"}


def test_completion_token_id_prompts(oai: openai.OpenAI, engine: FakeEngine) -> None:
    ids = engine.tokenize("token ids in")
    out = oai.completions.create(model=MODEL, prompt=ids, max_tokens=5)
    assert out.choices[0].text == "token ids in" and out.usage.prompt_tokens == 3
    out = oai.completions.create(model=MODEL, prompt=[ids, ids[:1]], max_tokens=5, echo=True)
    assert [c.text for c in out.choices] == ["tokenidsintoken ids in", "tokentoken"]


def test_completion_echo(oai: openai.OpenAI) -> None:
    out = oai.completions.create(model=MODEL, prompt="echo me", max_tokens=5, echo=True)
    assert out.choices[0].text == "echo meecho me"
    chunks = list(oai.completions.create(model=MODEL, prompt="echo me", max_tokens=5, echo=True, stream=True))
    assert chunks[0].choices[0].text.startswith("echo me")
    assert "".join(c.choices[0].text for c in chunks) == "echo meecho me"


def test_completion_logprobs(oai: openai.OpenAI) -> None:
    out = oai.completions.create(model=MODEL, prompt="log probs", max_tokens=5, logprobs=2, echo=True)
    lp = out.choices[0].logprobs
    assert lp.tokens == ["log", "probs"]
    assert lp.token_logprobs == [-0.5, -0.5]
    assert lp.top_logprobs == [{"log": -0.5, "alt": -1.5}, {"probs": -0.5, "alt": -1.5}]
    assert lp.text_offset == [len("log probs"), len("log probs") + 3]

    chunks = list(oai.completions.create(model=MODEL, prompt="log probs", max_tokens=5, logprobs=3, stream=True))
    streamed = [c.choices[0].logprobs for c in chunks]
    assert [t for s in streamed for t in s.tokens] == ["log", "probs"]
    assert [o for s in streamed for o in s.text_offset] == [0, 3]
    assert streamed[0].top_logprobs[0]["other"] == -9999.0  # -inf is not JSON; clamped as vLLM does


# ------------------------------------------------------------------------------------------------ chat


def test_chat(oai: openai.OpenAI) -> None:
    out = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi there"}])
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    choice = out.choices[0]
    assert (choice.message.role, choice.message.content) == ("assistant", "user: hi there assistant:")
    assert choice.finish_reason == "stop" and choice.logprobs is None
    # Template text tokenized without special tokens: no BOS.
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (4, 4)


def test_chat_content_parts_and_max_completion_tokens(oai: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    out = oai.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=2)
    assert (out.choices[0].message.content, out.choices[0].finish_reason) == ("user: a", "length")


def test_chat_role_chunk_comes_with_the_first_output(oai: openai.OpenAI, engine: FakeEngine) -> None:
    # As vLLM's server: a client timing its first chunk (TTFT) must not get one before the engine's first token.
    before = engine.ids_with_word(FOREVER)
    stream = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": FOREVER}], max_completion_tokens=50, stream=True
    )
    first = next(iter(stream))
    assert first.choices[0].delta.role == "assistant"
    (request_id,) = engine.ids_with_word(FOREVER) - before
    assert engine.num_outputs.get(request_id, 0) >= 1  # the fake waits 20 ms before each output
    stream.close()


def test_chat_stream(oai: openai.OpenAI) -> None:
    chunks = list(oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "stream it"}], n=2, stream=True,
        stream_options={"include_usage": True},
    ))
    assert {c.choices[0].index for c in chunks[:2]} == {0, 1}
    assert all(c.choices[0].delta.role == "assistant" for c in chunks[:2])
    assert all(c.choices[0].delta.role is None for c in chunks[2:] if c.choices)
    texts = {0: "", 1: ""}
    finish = {}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
            finish[choice.index] = choice.finish_reason or finish.get(choice.index)
    assert texts == {0: "user: stream it assistant:", 1: "USER: STREAM IT ASSISTANT:"}
    assert finish == {0: "stop", 1: "stop"}
    assert chunks[-1].usage.prompt_tokens == 4 and chunks[-1].usage.completion_tokens == 8


def test_chat_logprobs(oai: openai.OpenAI) -> None:
    out = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=2
    )
    content = out.choices[0].logprobs.content
    assert [e.token for e in content] == ["user:", "x", "assistant:"]
    assert content[0].logprob == -0.5 and content[0].bytes == list(b"user:")
    assert [(t.token, t.logprob) for t in content[0].top_logprobs] == [("user:", -0.5), ("alt", -1.5)]
    streamed = list(oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], logprobs=True, stream=True
    ))
    entries = [e for c in streamed if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in entries] == ["user:", "x", "assistant:"] and entries[0].top_logprobs == []


# ------------------------------------------------------------------------------------------------ errors

COMPLETION = {"model": MODEL, "prompt": "p"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "p"}]}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {**COMPLETION, "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {**COMPLETION, "max_tokens": -1}, "max_tokens"),
        ("/v1/completions", {**COMPLETION, "temperature": -1}, "temperature"),
        ("/v1/completions", {**COMPLETION, "top_p": 0}, "top_p"),
        ("/v1/completions", {**COMPLETION, "top_p": 1.5}, "top_p"),
        ("/v1/completions", {**COMPLETION, "n": 0}, "n"),
        ("/v1/completions", {**COMPLETION, "temperature": "hot"}, "temperature"),
        ("/v1/completions", {**COMPLETION, "logprobs": 6}, "logprobs"),
        ("/v1/completions", {**COMPLETION, "logit_bias": {"x": 1}}, "logit_bias"),
        ("/v1/completions", {**COMPLETION, "prompt": ""}, "prompt"),
        ("/v1/completions", {**COMPLETION, "prompt": []}, "prompt"),
        ("/v1/completions", {**COMPLETION, "prompt": ["a", ""]}, "prompt"),
        ("/v1/completions", {**COMPLETION, "prompt": [1, "a"]}, "prompt"),
        ("/v1/completions", {"model": MODEL}, "prompt"),
        ("/v1/completions", {**COMPLETION, "stream": True, "max_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {**CHAT, "messages": []}, "messages"),
        ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {**CHAT, "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "messages"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"content": "no role"}]}, "messages"),
    ],
)
def test_bad_request(http: httpx.Client, path: str, body: dict, param: str) -> None:
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("BadRequestError", param, 400)
    assert error["message"]


def test_unknown_fields_are_refused_and_bookkeeping_fields_accepted(http: httpx.Client) -> None:
    # As vLLM: a field lmserve does not implement is a 400 naming it, never silently dropped.
    response = http.post("/v1/completions", json={**COMPLETION, "best_of": 2, "made_up": {"a": 1}})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "best_of" and "best_of, made_up" in error["message"]
    # suffix is fill-in-the-middle (tests/api/test_fim.py): a model without FIM tokens says so.
    error = http.post("/v1/completions", json={**COMPLETION, "suffix": "x"}).json()["error"]
    assert error["param"] == "suffix" and "no fill-in-the-middle tokens" in error["message"]
    # Unless it asks for nothing: null (clients that send every field), best_of equal to n, text-only modalities.
    for nothing in ({"suffix": None, "made_up": None}, {"best_of": 1}, {"best_of": 2, "n": 2}):
        assert http.post("/v1/completions", json={**COMPLETION, **nothing}).status_code == 200, nothing
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "p"}]}
    for nothing in ({"audio": None, "prediction": None, "modalities": ["text"]}, {"reasoning_effort": None}):
        assert http.post("/v1/chat/completions", json={**chat, **nothing}).status_code == 200, nothing
    for something, param in (({"modalities": ["text", "audio"]}, "modalities"), ({"best_of": 3, "n": 2}, "best_of")):
        error = http.post("/v1/chat/completions", json={**chat, **something}).json()["error"]
        assert error["param"] == param and "unsupported" in error["message"], error
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "p"}], "response_formt": {"type": "text"}}
    assert http.post("/v1/chat/completions", json=chat).json()["error"]["param"] == "response_formt"
    harmless = {"user": "u", "store": False, "metadata": {"k": "v"}, "service_tier": "auto"}
    assert http.post("/v1/completions", json={**COMPLETION, **harmless}).status_code == 200


def test_reasoning_effort_reaches_the_chat_template(oai: openai.OpenAI, http: httpx.Client, engine: FakeEngine) -> None:
    """As vLLM: a variable for the template (gpt-oss's reads it), so agent frameworks that send it are served."""
    messages = [{"role": "user", "content": "p"}]
    oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, reasoning_effort="low")
    assert engine.template_kwargs["reasoning_effort"] == "low"
    oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, reasoning_effort="high",
                                extra_body={"chat_template_kwargs": {"reasoning_effort": "medium"}})
    assert engine.template_kwargs["reasoning_effort"] == "medium"  # the client's own template variable wins
    oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert "reasoning_effort" not in engine.template_kwargs
    oai.responses.create(model=MODEL, input="p", max_output_tokens=1, reasoning={"effort": "minimal"})
    assert engine.template_kwargs["reasoning_effort"] == "minimal"
    for path, body in (("/v1/chat/completions", {"messages": messages, "reasoning_effort": "ultra"}),
                       ("/v1/responses", {"input": "p", "reasoning": {"effort": "ultra"}})):
        error = http.post(path, json={"model": MODEL, **body}).json()["error"]
        assert error["param"] == "reasoning_effort" and "'low'" in error["message"], error


def test_a_text_part_without_text_is_named(http: httpx.Client) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text"}]}]}
    error = http.post("/v1/chat/completions", json=body).json()["error"]
    assert error["param"] == "messages" and "needs its text" in error["message"], error


def test_malformed_json(http: httpx.Client) -> None:
    response = http.post("/v1/completions", content=b'{"prompt": "x",', headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "BadRequestError"
    assert "JSON" in response.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_too_long(oai: openai.OpenAI, stream: bool) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=MODEL, prompt="w " * 60, max_tokens=10, stream=stream)
    message = info.value.body["message"]
    assert "64" in message and "61" in message  # the context length and the prompt length


def test_unknown_model(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        oai.completions.create(model="gpt-4", prompt="x")
    assert info.value.body["type"] == "NotFoundError"
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])


def test_tokenize_renders_the_tools_and_options_a_chat_request_would(
    http: httpx.Client, engine: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[dict, bool]] = []
    real = engine.render_chat

    def recording(messages, add_generation_prompt, template_kwargs, add_special_tokens=False):
        seen.append((template_kwargs, add_special_tokens))
        return real(messages, add_generation_prompt, template_kwargs, add_special_tokens)

    monkeypatch.setattr(engine, "render_chat", recording)
    tool = {"type": "function", "function": {"name": "get_weather"}}
    body = {"messages": [{"role": "user", "content": "a b"}], "tools": [tool], "add_generation_prompt": False,
            "continue_final_message": True, "add_special_tokens": True, "return_token_strs": True}
    answer = http.post("/tokenize", json=body).json()
    (kwargs, special), = seen
    assert [t["function"]["name"] for t in kwargs["tools"]] == ["get_weather"]
    assert kwargs["continue_final_message"] is True and special is True
    assert answer["token_strs"] == [engine.decode_token(t) for t in answer["tokens"]]
    refused = http.post("/tokenize", json={**body, "add_generation_prompt": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "continue_final_message"


def test_chat_echo_gives_the_assistants_prefill_back_first(oai: openai.OpenAI) -> None:
    """vLLM's echo on chat: with a last assistant message (continued, not closed), the answer begins with it."""
    messages = [{"role": "user", "content": "a b"}, {"role": "assistant", "content": "c d"}]
    extra = {"echo": True, "add_generation_prompt": False, "continue_final_message": True}
    plain = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=20,
                                        extra_body={k: v for k, v in extra.items() if k != "echo"})
    whole = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, extra_body=extra)
    assert whole.choices[0].message.content == "c d" + plain.choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=20, extra_body=extra, stream=True) if c.choices)
    assert streamed == whole.choices[0].message.content
    # The last message is the user's: nothing to echo.
    user_last = oai.chat.completions.create(model=MODEL, messages=messages[:1], max_tokens=20, extra_body={"echo": True})
    assert user_last.choices[0].message.content == oai.chat.completions.create(
        model=MODEL, messages=messages[:1], max_tokens=20).choices[0].message.content


def test_several_served_model_names(engine: FakeEngine) -> None:
    """--served-model-name A B, as vLLM: requests may name any, responses name the first, /v1/models lists all."""
    with ServerThread(build_app(engine, served_model_name=["first", "alias"])) as running:
        oai = openai.OpenAI(base_url=f"{running.url}/v1", api_key="x", max_retries=0)
        assert [m.id for m in oai.models.list().data] == ["first", "alias"]
        assert oai.models.retrieve("alias").id == "alias"  # OpenAI's retrieve-model, GET /v1/models/{model}
        with pytest.raises(openai.NotFoundError, match="'first', 'alias'"):
            oai.models.retrieve("org/other-model")
        for name in ("first", "alias"):
            answer = oai.completions.create(model=name, prompt="x y")
            assert answer.model == "first" and answer.choices[0].text == "x y"
        with pytest.raises(openai.NotFoundError, match="'first', 'alias'"):
            oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])


def test_api_key(engine: FakeEngine) -> None:
    app = build_app(engine, api_key="sekret", served_model_name="served")
    with ServerThread(app) as running, httpx.Client(base_url=running.url) as http:
        for key in ("wrong", None):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            response = http.post("/v1/completions", json={"prompt": "x"}, headers=headers)
            assert response.status_code == 401
            assert response.json()["error"]["type"] == "AuthenticationError"
        oai = openai.OpenAI(base_url=f"{running.url}/v1", api_key="sekret", max_retries=0)
        assert oai.completions.create(model="served", prompt="x y").choices[0].text == "x y"
        assert [m.id for m in oai.models.list().data] == ["served"]
        with pytest.raises(openai.NotFoundError):
            oai.completions.create(model=MODEL, prompt="x")  # only the served name is accepted
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{running.url}/v1", api_key="nope", max_retries=0).models.list()
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{running.url}/v1", api_key="nope", max_retries=0).models.retrieve("served")
        assert http.get("/health").status_code == 200
        assert http.get("/metrics").status_code == 200
        assert http.get("/debug/engine").status_code == 401


@pytest.mark.parametrize("state", ["not_ready", "errored"])
def test_engine_unavailable(http: httpx.Client, oai: openai.OpenAI, engine: FakeEngine, state: str) -> None:
    if state == "not_ready":
        engine.is_ready = False
    else:
        engine.errored = True
    for response in (http.post("/v1/completions", json=COMPLETION), http.get("/health"), http.get("/ping")):
        assert response.status_code == 503
        assert response.json()["error"]["type"] == "ServiceUnavailableError"
    with pytest.raises(openai.InternalServerError):
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])


def test_engine_dies_mid_request(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json={**COMPLETION, "prompt": f"{DIE} now"})
    assert response.status_code == 503
    with http.stream("POST", "/v1/completions", json={**COMPLETION, "prompt": f"{DIE} now", "stream": True}) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert events[0]["choices"][0]["text"] == DIE
    assert events[1]["error"]["type"] == "ServiceUnavailableError"
    assert events[2] == "[DONE]"


def test_unexpected_error_is_500_and_logged(http: httpx.Client, caplog: pytest.LogCaptureFixture) -> None:
    for stream in (False, True):
        response = http.post("/v1/completions", json={**COMPLETION, "prompt": BOOM, "stream": stream})
        assert response.status_code == 500
        assert response.json()["error"]["type"] == "InternalServerError"
    assert any(r.name == "lmserve.api.errors" and r.exc_info for r in caplog.records)
    assert http.post("/v1/completions", json=COMPLETION).status_code == 200


def test_unknown_route_and_method(http: httpx.Client) -> None:
    assert http.get("/v1/nothing").json()["error"]["type"] == "NotFoundError"
    assert http.get("/v1/completions").status_code == 405


# ------------------------------------------------------------------------------------------------ other routes


def test_models_version_metrics_debug(oai: openai.OpenAI, http: httpx.Client, engine: FakeEngine) -> None:
    models = oai.models.list().data
    assert [m.id for m in models] == [MODEL] and models[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    assert http.get("/version").json() == {"server": "lmserve", "version": __version__}
    assert http.get("/health").status_code == 200
    assert http.get("/ping").status_code == 200 and http.post("/ping").status_code == 200  # vLLM's, SageMaker's
    card = oai.models.retrieve(MODEL)
    assert card.id == MODEL and card.model_extra["max_model_len"] == MAX_MODEL_LEN
    text = http.get("/metrics").text
    for name in (
        "lmserve:num_requests_running", "lmserve:num_requests_waiting", "lmserve:kv_cache_usage_perc",
        "lmserve:kv_blocks_used", "lmserve:kv_blocks_free", "lmserve:prefix_cache_queries_total",
        "lmserve:prefix_cache_hits_total", "lmserve:num_preemptions_total", "lmserve:num_requests_aborted_total",
    ):
        assert name in text
    assert f'lmserve:num_preemptions_total{{engine="0",model_name="{MODEL}"}} 3.0' in text
    assert http.get("/debug/engine").json() == asyncio.run(engine.get_stats())


# ------------------------------------------------------------------------------------------------ disconnects


@pytest.mark.parametrize("num_prompts", [1, 3])
def test_stream_client_disconnect_aborts(server: ServerThread, engine: FakeEngine, num_prompts: int) -> None:
    marker = f"dropped{num_prompts}"
    body = {**COMPLETION, "prompt": [f"{FOREVER} {marker}"] * num_prompts, "max_tokens": 40, "stream": True}
    with httpx.Client(base_url=server.url, timeout=5) as client, client.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    # The connection is closed here, long before the 40 slow tokens are done: every request is closed and aborted.
    ids = engine.ids_with_word(marker)
    assert len(ids) == num_prompts
    assert wait_for(lambda: ids <= engine.closed_early and ids <= engine.aborted, timeout=1)
    assert not ids & engine.finished


def test_non_stream_client_timeout_aborts(server: ServerThread, engine: FakeEngine) -> None:
    body = {**COMPLETION, "prompt": f"{FOREVER} timedout", "max_tokens": 40}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=0.5)
    left = time.monotonic()
    assert wait_for(lambda: engine.ids_with_word("timedout") & engine.aborted, timeout=1.5)
    assert time.monotonic() - left < 1.0
    assert engine.ids_with_word("timedout") <= engine.closed_early


def test_bad_requests_do_not_disturb_others(server: ServerThread, oai: openai.OpenAI) -> None:
    body = {**COMPLETION, "prompt": f"{FOREVER} steady", "max_tokens": 15, "stream": True}
    with httpx.Client(base_url=server.url, timeout=5) as client, client.stream("POST", "/v1/completions", json=body) as r:
        events = r.iter_lines()
        for bad in ({**COMPLETION, "top_p": 0}, {**COMPLETION, "prompt": "w " * 80}, {"prompt": 3}):
            assert client.post("/v1/completions", json=bad).status_code == 400
        text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events if e.startswith("data: {"))
    assert text == " ".join([FOREVER] * 15)


def test_embeddings_on_a_generative_model_are_a_400_naming_the_model(oai: openai.OpenAI, engine: FakeEngine) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        oai.embeddings.create(model=MODEL, input=["hello world"])
    assert refused.value.body["param"] == "model" and "generates text" in refused.value.body["message"]
