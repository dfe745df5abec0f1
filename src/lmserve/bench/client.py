"""One streaming request to an OpenAI-compatible server, timed chunk by chunk into a raw Sample.

What is sent and timed follows `vllm bench serve`'s request functions (vllm/benchmarks/lib/endpoint_request_func.py)
so the two clients measure the same thing (docs/benchmarks.md, "lmserve bench and vllm bench serve"):
- completions: model, prompt, repetition_penalty 1.0, max_tokens, logprobs, stream, stream_options.include_usage;
  chat: model, messages, max_completion_tokens, stream, stream_options.include_usage; then ignore_eos when asked,
  then the sampling flags and --extra-body. Nothing else: no temperature unless given.
- every SSE message with a non-empty "choices" is a token event, whether or not its text is empty: TTFT is the
  first, ITL the gaps between them, and the latency (E2EL) ends at the last one (not at the usage chunk or [DONE]).
- output tokens: the usage's completion_tokens; without them the tokenizer on the text; without one, the events.

The client shares two cores with the server it measures, so the per-chunk work is kept to a line check, one JSON
decode (msgspec) and a clock read; token counting, when the server sends no usage, happens once per request.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec

from lmserve.bench.dataset_types import BenchRequest, Tokenizer, flatten_messages

_decode = msgspec.json.Decoder().decode


@dataclass
class Sample:
    """What one request did. Times are seconds; `start`/`scheduled` are relative to the benchmark start."""

    index: int
    start: float
    scheduled: float | None  # the open loop's planned send time (None in a closed loop)
    prompt_len: int
    max_tokens: int
    output_len: int = 0
    ttft: float | None = None  # to the first chunk with choices
    itl: list[float] = field(default_factory=list)  # gaps between successive chunks with choices
    e2e: float | None = None  # to the last chunk with choices (for failures: how long they took)
    success: bool = False
    error: str = ""
    timed_out: bool = False
    http_status: int | None = None
    output_len_source: str = ""  # usage | tokenizer | chunks
    usage_prompt_tokens: int | None = None  # the server's own count, when it sends usage
    generated_text: str = ""

    @property
    def input_len(self) -> int:
        """The prompt's tokens as vLLM counts them: the server's usage when it sent one, else the dataset's."""
        return self.usage_prompt_tokens if self.usage_prompt_tokens is not None else self.prompt_len

    def chunk_times(self) -> list[float]:
        """When each chunk with choices arrived, relative to the benchmark start."""
        if self.ttft is None:
            return []
        times = [self.start + self.ttft]
        for gap in self.itl:
            times.append(times[-1] + gap)
        return times


class BenchClient:
    def __init__(
        self, base_url: str, endpoint: str, model: str, *, api_key: str | None = None, timeout: float = 600.0,
        backend: str | None = None, temperature: float | None = None, ignore_eos: bool = False,
        logprobs: int | None = None, tokenizer: Tokenizer | None = None, max_connections: int | None = None,
        extra_body: dict[str, Any] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,  # tests: httpx.MockTransport
    ) -> None:
        self.url = base_url.rstrip("/") + endpoint
        # The backend decides the request's shape (vLLM's --backend); without one, the endpoint does.
        self.chat = backend == "openai-chat" if backend else endpoint.rstrip("/").endswith("chat/completions")
        self.model = model
        self.timeout = timeout
        self.ignore_eos = ignore_eos
        self.logprobs = logprobs
        self.tokenizer = tokenizer
        # An explicit temperature is one more sampling parameter; --extra-body still wins over it.
        self.extra_body = {**({"temperature": temperature} if temperature is not None else {}), **(extra_body or {})}
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.origin = time.perf_counter()  # the benchmark start; reset after the warm-ups
        # One connection per possible in-flight request: httpx's default pool (100) would queue an open loop's
        # requests inside the client, where the wait would count as server latency.
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits, transport=transport)

    async def aclose(self) -> None:
        await self.http.aclose()

    def payload(self, request: BenchRequest) -> dict[str, Any]:
        body: dict[str, Any]
        if self.chat:
            # vLLM sends a lone prompt as one user message of text parts, and pre-built messages as they are.
            messages = request.messages or [
                {"role": "user", "content": [{"type": "text", "text": _as_text(request.prompt)}]}]
            body = {"model": self.model, "messages": messages, "max_completion_tokens": request.output_len}
        else:
            prompt = request.prompt if request.prompt is not None else flatten_messages(request.messages or [])
            body = {"model": self.model, "prompt": prompt, "repetition_penalty": 1.0,
                    "max_tokens": request.output_len, "logprobs": self.logprobs}
        body.update(stream=True, stream_options={"include_usage": True})
        if self.ignore_eos:
            body["ignore_eos"] = True
        body.update(self.extra_body)
        return body

    async def send(self, index: int, request: BenchRequest, scheduled: float | None = None) -> Sample:
        body = self.payload(request)
        started = time.perf_counter()
        sample = Sample(index, started - self.origin, scheduled, request.prompt_len, request.output_len)
        try:
            # httpx's timeout bounds each read; this bounds the whole request.
            async with asyncio.timeout(self.timeout):
                await self._stream(body, started, sample)
        except (TimeoutError, httpx.TimeoutException):
            sample.timed_out, sample.success = True, False
            sample.error = f"timed out after {self.timeout:g} s"
        except httpx.HTTPError as exc:
            sample.success = False
            sample.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        except Exception as exc:  # noqa: BLE001 - one broken response must not end the run; it is reported
            sample.success = False
            sample.error = f"{type(exc).__name__}: {exc}"
        if sample.e2e is None:
            sample.e2e = time.perf_counter() - started
        return sample

    async def _stream(self, body: dict[str, Any], started: float, sample: Sample) -> None:
        key = "delta" if self.chat else None
        pieces: list[str] = []
        usage: dict[str, Any] | None = None
        last: float | None = None
        async with self.http.stream("POST", self.url, json=body, headers=self.headers) as response:
            sample.http_status = response.status_code
            if response.status_code != 200:
                text = (await response.aread()).decode("utf-8", "replace")
                sample.error = f"HTTP {response.status_code}: {text[:500]}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments, event: lines
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = _decode(data)
                if "error" in chunk:
                    sample.error = f"error in stream: {_error_message(chunk['error'])}"
                    return
                choices = chunk.get("choices")
                if choices:
                    # vLLM times every chunk with choices, text or not (a held-back delta, a role-only first
                    # chat chunk, a final chunk with only finish_reason): the same events here.
                    now = time.perf_counter()
                    if last is None:
                        sample.ttft = now - started
                    else:
                        sample.itl.append(now - last)
                    last = now
                    first = choices[0]
                    text = (first.get(key) or {}).get("content") if key else first.get("text")
                    if text:
                        pieces.append(text)
                if chunk.get("usage"):
                    usage = chunk["usage"]
        sample.generated_text = "".join(pieces)
        if last is None:
            sample.error = "no chunk with choices in the stream (vLLM counts such a request as failed)"
            return
        sample.success = True
        sample.e2e = last - started
        self._count_output(sample, usage, len(sample.itl) + 1)

    def _count_output(self, sample: Sample, usage: dict[str, Any] | None, events: int) -> None:
        """usage is exact, so it wins even with a tokenizer; then the tokenizer (as vLLM: a usage of 0 tokens
        counts as none); then, where vLLM would say 1, one token per chunk with choices."""
        if usage is not None and usage.get("prompt_tokens") is not None:
            sample.usage_prompt_tokens = int(usage["prompt_tokens"])
        if usage is not None and usage.get("completion_tokens"):
            sample.output_len, sample.output_len_source = int(usage["completion_tokens"]), "usage"
        elif self.tokenizer is not None:
            text = sample.generated_text
            sample.output_len = len(self.tokenizer.encode(text, add_special_tokens=False)) if text else 0
            sample.output_len_source = "tokenizer"
        else:
            sample.output_len, sample.output_len_source = events, "chunks"


def _error_message(error: Any) -> str:
    return str(error.get("message", error)) if isinstance(error, dict) else str(error)


def _as_text(prompt: str | list[int] | None) -> str:
    if isinstance(prompt, str):
        return prompt
    raise ValueError("chat requests need text or messages, not token ids")
