"""`lmserve bench` / `python -m lmserve.bench`: load-test any OpenAI-compatible server like `vllm bench serve`.

Load models (DESIGN.md, Measurement: they are different experiments):
- closed loop: --max-concurrency C (no --request-rate): C workers, each sends its next prompt when the last ends;
- open loop: --request-rate R [--burstiness B] [--max-concurrency C]: sends on a seeded Poisson/gamma schedule;
- burst: neither: every prompt at once (vLLM's default).
Each run is bounded by --num-prompts and --time-limit (no new requests after it; in-flight ones finish or time out).

Output token counts come from the streamed usage when the server sends it, else from the tokenizer, else one per
chunk (the result's "token_count_source"). Without a tokenizer, completions prompts are random token ids in
[100, 10000) (exact lengths, assuming a vocabulary of at least 10000) and text prompts are words of shipped prose
at ~0.75 words per token (the result says "input_lens_approximate").

Exit status: 0 when the run completed (failed requests are reported, not fatal), 2 for bad arguments (including a
bad --dataset-path file or --tokenizer), 1 when the server cannot be reached at all.
"""

# This module imports only argparse at load time: `lmserve serve` builds this parser too and must not pay for numpy,
# httpx or torch.

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any

HELP = "load-test an OpenAI-compatible server (vLLM `bench serve` definitions)"
ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


class ServerUnreachable(Exception):
    """The server did not answer at all: exit 1."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    # The same flags and help for `lmserve bench` and `python -m lmserve.bench`.
    p.description = __doc__
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    target = p.add_argument_group("target")
    target.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, without /v1")
    target.add_argument("--endpoint", default="/v1/completions", help=" or ".join(ENDPOINTS))
    target.add_argument("--model", default=None, help="model name to request; default: the first of GET /v1/models")
    target.add_argument("--tokenizer", default=None,
                        help="tokenizer (HF directory, GGUF file or lmserve registered name) for exact prompt "
                             "lengths; default: the served model's when the server is lmserve, else none")
    target.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'; default: $OPENAI_API_KEY")
    target.add_argument("--timeout", type=float, default=600.0, help="seconds per request (counted as timed out)")

    data = p.add_argument_group("dataset")
    data.add_argument("--dataset-name", default="random", choices=["random", "prefix", "jsonl", "chat"])
    data.add_argument("--dataset-path", default=None, help='JSONL: {"prompt": str, "output_len"?: int} a line')
    data.add_argument("--num-prompts", type=int, default=None, help="default: 1000 (jsonl: the file's lines)")
    data.add_argument("--random-input-len", type=int, default=1024,
                      help="random: prompt tokens; prefix: suffix tokens after the shared prefix")
    data.add_argument("--random-output-len", type=int, default=128, help="max_tokens (all synthetic datasets)")
    data.add_argument("--random-range-ratio", type=float, default=0.0,
                      help="lengths uniform in [L*(1-r), L*(1+r)], 0 <= r < 1")
    data.add_argument("--prefix-num-groups", type=int, default=1, help="prefix: groups sharing a prefix")
    data.add_argument("--prefix-len", type=int, default=256, help="prefix: tokens shared within a group")
    data.add_argument("--prompt-format", default="tokens", choices=["tokens", "text"],
                      help="/v1/completions prompts as token ids (exact lengths) or as text")
    data.add_argument("--seed", type=int, default=0, help="seeds the prompts and the arrival schedule")

    load = p.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=math.inf,
                      help="open loop: requests/s (default inf: closed loop with --max-concurrency, else burst)")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of the arrival gaps: 1 = Poisson, <1 burstier, >1 more regular")
    load.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    load.add_argument("--time-limit", type=float, default=None, help="seconds; no new requests after it")
    load.add_argument("--num-warmups", type=int, default=0, help="requests sent first and left out of the results")

    req = p.add_argument_group("request")
    req.add_argument("--temperature", type=float, default=0.0)
    req.add_argument("--ignore-eos", action="store_true", help='send "ignore_eos": true (vLLM/lmserve extension)')

    out = p.add_argument_group("output")
    out.add_argument("--slo", default=None, metavar="ttft=MS,tpot=MS,e2el=MS", help="goodput SLOs (any subset)")
    out.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS", help="vLLM's form of --slo")
    out.add_argument("--output", default=None, help="write the result JSON (with every raw sample) here")
    out.add_argument("--plot", default=None, help="write latency CDFs and tokens/s over time to this PNG")
    out.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def validate(args: argparse.Namespace) -> dict[str, float]:
    """Check what argparse cannot; returns the SLOs. Raises ValueError (exit 2)."""
    from lmserve.bench.metrics import parse_slo

    checks = [
        (args.num_prompts is None or args.num_prompts >= 1, "--num-prompts must be >= 1"),
        (args.num_warmups >= 0, "--num-warmups must be >= 0"),
        (args.request_rate > 0, "--request-rate must be > 0"),
        (args.burstiness > 0, "--burstiness must be > 0"),
        (args.max_concurrency is None or args.max_concurrency >= 1, "--max-concurrency must be >= 1"),
        (args.time_limit is None or args.time_limit > 0, "--time-limit must be > 0"),
        (args.timeout > 0, "--timeout must be > 0"),
        (args.random_input_len >= 1 and args.random_output_len >= 1, "--random-input/output-len must be >= 1"),
        (0 <= args.random_range_ratio < 1, "--random-range-ratio must be in [0, 1)"),
        (args.prefix_num_groups >= 1 and args.prefix_len >= 0, "--prefix-num-groups >= 1, --prefix-len >= 0"),
        (args.endpoint.startswith("/"), "--endpoint must start with '/', e.g. /v1/completions"),
        (args.base_url.startswith(("http://", "https://")), "--base-url must start with http:// or https://"),
        (args.dataset_name != "jsonl" or args.dataset_path, "--dataset-name jsonl needs --dataset-path"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
    slo = parse_slo(args.slo) if args.slo else {}
    for item in args.goodput or []:
        slo.update(parse_slo(item, sep=":"))
    return slo


def arrival_pattern(args: argparse.Namespace) -> dict[str, Any]:
    if math.isfinite(args.request_rate):
        kind = "open"
    else:
        kind = "closed" if args.max_concurrency else "burst"
    return {"kind": kind, "request_rate": args.request_rate, "burstiness": args.burstiness,
            "max_concurrency": args.max_concurrency}


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by parsed arguments; the exit status."""
    import asyncio

    slo = validate(args)
    if args.dataset_name == "jsonl":
        from lmserve.bench.datasets import read_jsonl

        read_jsonl(args.dataset_path)  # a bad file is a bad argument: fail before touching the server
    try:
        return asyncio.run(_run(args, slo))
    except ServerUnreachable as exc:
        print(f"lmserve bench: error: {exc}", file=sys.stderr)
        return 1


# ------------------------------------------------------------------------------------------------- the run


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


STARTUP_WAIT_S = 120.0  # how long a server answering 503 (engine still starting) is waited for


async def _probe(base_url: str, headers: dict[str, str]) -> tuple[list[str], dict | None]:
    """The served model ids (GET /v1/models) and the /version JSON; ServerUnreachable when nothing answers."""
    import asyncio
    import time

    import httpx

    async with httpx.AsyncClient(timeout=30.0, headers=headers) as http:
        deadline = time.monotonic() + STARTUP_WAIT_S
        while True:
            try:
                response = await http.get(f"{base_url}/v1/models")
            except httpx.TransportError as exc:
                raise ServerUnreachable(f"cannot reach {base_url}: {type(exc).__name__}: {exc}") from None
            # A server can be up (health 200) while its engine still loads: lmserve and vLLM answer 503 then.
            if response.status_code != 503 or time.monotonic() > deadline:
                break
            await asyncio.sleep(1.0)
        models: list[str] = []
        if response.status_code != 200:
            _log(f"lmserve bench: GET {base_url}/v1/models answered HTTP {response.status_code}")
        else:
            try:
                models = [m["id"] for m in response.json().get("data", []) if "id" in m]
            except (ValueError, TypeError, KeyError, AttributeError):
                models = []
        version = None
        try:
            answer = await http.get(f"{base_url}/version")
            if answer.status_code == 200 and isinstance(answer.json(), dict):
                version = answer.json()
        except (httpx.HTTPError, ValueError):
            pass
    return models, version


def load_tokenizer(name: str) -> Any:
    # Lazily: transformers takes seconds to import, which a plain run does not need.
    from lmserve import models

    return models.load_tokenizer(models.resolve_model(name))


def _pick_tokenizer(args: argparse.Namespace, model: str, version: dict | None) -> tuple[Any, str | None]:
    if args.tokenizer:
        try:
            return load_tokenizer(args.tokenizer), args.tokenizer
        except (OSError, ValueError) as exc:
            raise ValueError(f"--tokenizer {args.tokenizer}: {exc}") from None
    # Only lmserve says who it is; a bare {"version": ...} (older lmserve, vLLM) is an unknown server.
    if version and version.get("server") == "lmserve":
        try:
            return load_tokenizer(model), model
        except Exception as exc:  # noqa: BLE001 - a served name that is not loadable here: go without
            _log(f"lmserve bench: no tokenizer for '{model}' ({exc}); counting output tokens from usage")
    return None, None


def _dataset_spec(args: argparse.Namespace, chat: bool) -> Any:
    from lmserve.bench.datasets import DatasetSpec

    return DatasetSpec(
        name=args.dataset_name, num_prompts=args.num_prompts, num_warmups=args.num_warmups, chat=chat,
        token_ids=args.prompt_format == "tokens", input_len=args.random_input_len, output_len=args.random_output_len,
        range_ratio=args.random_range_ratio, prefix_len=args.prefix_len, prefix_groups=args.prefix_num_groups,
        path=args.dataset_path, seed=args.seed,
    )


async def _run(args: argparse.Namespace, slo: dict[str, float]) -> int:
    import time

    from tqdm import tqdm

    from lmserve.bench.client import BenchClient
    from lmserve.bench.datasets import build_dataset
    from lmserve.bench.load import arrival_times, run_closed, run_open

    base_url = args.base_url.rstrip("/")
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY") or None
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    models, server_version = await _probe(base_url, headers)
    model = args.model or (models[0] if models else None)
    if model is None:
        raise ServerUnreachable(f"{base_url}/v1/models lists no model; pass --model")
    tokenizer, tokenizer_name = _pick_tokenizer(args, model, server_version)
    chat = args.endpoint.rstrip("/").endswith("chat/completions")
    dataset = build_dataset(_dataset_spec(args, chat), tokenizer)
    pattern = arrival_pattern(args)
    # Enough connections for every request that may be in flight (an uncapped open loop: all of them).
    in_flight = args.max_concurrency or max(len(dataset.requests), len(dataset.warmups), 1)
    client = BenchClient(
        base_url, args.endpoint, model, api_key=api_key, timeout=args.timeout, temperature=args.temperature,
        ignore_eos=args.ignore_eos, tokenizer=tokenizer, max_connections=in_flight,
    )
    try:
        if dataset.warmups:
            _log(f"lmserve bench: {len(dataset.warmups)} warm-up request(s)")
            warm = await run_closed(dataset.warmups, args.max_concurrency or len(dataset.warmups), client.send,
                                    lambda: time.perf_counter() - client.origin)
            failed = sum(1 for s in warm if not s.success)
            if failed:
                _log(f"lmserve bench: {failed} warm-up request(s) failed: {next(s.error for s in warm if s.error)}")
        _log(f"lmserve bench: {len(dataset.requests)} request(s) to {base_url}{args.endpoint} ({model}), "
             f"{pattern['kind']} loop")
        bar = tqdm(total=len(dataset.requests), disable=args.disable_tqdm, file=sys.stderr, unit="req")
        client.origin = time.perf_counter()

        def clock() -> float:
            return time.perf_counter() - client.origin

        if pattern["kind"] == "closed":
            samples = await run_closed(dataset.requests, args.max_concurrency, client.send, clock,
                                       time_limit=args.time_limit, on_done=lambda _: bar.update(1))
        else:
            arrivals = arrival_times(len(dataset.requests), args.request_rate, args.burstiness, args.seed)
            samples = await run_open(dataset.requests, arrivals, client.send, clock,
                                     max_concurrency=args.max_concurrency, time_limit=args.time_limit,
                                     on_done=lambda _: bar.update(1))
        duration = clock()
        bar.close()
    finally:
        await client.aclose()
    _finish(args, slo, samples, duration, dataset, pattern, model, tokenizer_name, server_version, base_url)
    return 0


def _finish(args: argparse.Namespace, slo: dict[str, float], samples: list, duration: float, dataset: Any,
            pattern: dict[str, Any], model: str, tokenizer_name: str | None, server_version: dict | None,
            base_url: str) -> None:
    from lmserve.bench.metrics import compute_metrics, length_stats
    from lmserve.bench.result import machine_info, now_iso, print_table, sample_dicts, versions, write_json

    samples = sorted(samples, key=lambda s: s.index)
    ok = [s for s in samples if s.success]
    sources = {s.output_len_source for s in ok}
    result = {
        "date": now_iso(), "base_url": base_url, "endpoint": args.endpoint, "model": model,
        "tokenizer": tokenizer_name, "config": config_dict(args), "arrival_pattern": pattern,
        "dataset": args.dataset_name,
        "lengths": {
            "input": length_stats([s.prompt_len for s in samples]),
            "requested_output": length_stats([s.max_tokens for s in samples]),
            "output": length_stats([s.output_len for s in ok]),
        },
        "prefix_cache": "warm" if dataset.prefix_cache_warm else "cold",
        "num_warmups": len(dataset.warmups),
        "token_count_source": sources.pop() if len(sources) == 1 else ("mixed" if sources else None),
        "input_lens_approximate": dataset.input_lens_approximate,
        "machine": machine_info(), "versions": versions(server_version),
        **compute_metrics(samples, duration, slo),
    }
    result["samples"] = sample_dicts(samples)
    print_table(result)
    if args.output:
        write_json(result, args.output)
        _log(f"lmserve bench: wrote {args.output}")
    if args.plot:
        from lmserve.bench.plot import plot_run

        plot_run(samples, duration, args.plot, title=f"{model} @ {base_url}{args.endpoint}, {pattern['kind']} loop")
        _log(f"lmserve bench: wrote {args.plot}")


def config_dict(args: argparse.Namespace) -> dict[str, Any]:
    """Every argument, minus the dispatch function, with the API key hidden."""
    config = {k: v for k, v in vars(args).items() if not callable(v)}
    if config.get("api_key"):
        config["api_key"] = "<set>"
    return config


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lmserve.bench")
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"lmserve bench: error: {exc}", file=sys.stderr)
        return 2
