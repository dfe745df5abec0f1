"""`lmserve bench` / `python -m lmserve.bench`: load-test any OpenAI-compatible server like `vllm bench serve`.

Flags, request bodies, metric definitions and the result file are vLLM's (args.py, client.py, metrics.py,
result.py; docs/benchmarks.md says where the two clients still differ). Sampling flags are sent only when given,
so the server's defaults apply, as with vLLM: pass --temperature 0 for greedy decoding.

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
import os
import sys
from typing import Any

from lmserve.bench import args as bench_args
from lmserve.bench.args import arrival_pattern, config_dict, validate

HELP = "load-test an OpenAI-compatible server (vLLM `bench serve` definitions)"
ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
__all__ = ["HELP", "add_arguments", "arrival_pattern", "build_parser", "config_dict", "main", "run", "validate"]


class ServerUnreachable(Exception):
    """The server did not answer at all: exit 1."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    # The same flags and help for `lmserve bench` and `python -m lmserve.bench`.
    p.description = __doc__
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    bench_args.add_arguments(p)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by parsed arguments; the exit status."""
    import asyncio

    slo = validate(args)
    # A bad file is a bad argument: fail before touching the server.
    if args.dataset_name == "jsonl":
        from lmserve.bench.datasets import read_jsonl

        read_jsonl(args.dataset_path)
    elif args.dataset_name in ("sharegpt", "custom"):
        from lmserve.bench import file_datasets

        getattr(file_datasets, f"read_{args.dataset_name}")(args.dataset_path)
    from lmserve.bench.result import parse_metadata

    args.metadata_dict = parse_metadata(args.metadata)
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
    from lmserve.model_tokenizer import load_tokenizer as load_model_tokenizer
    from lmserve.models import resolve_model

    return load_model_tokenizer(resolve_model(name))


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
    from lmserve.bench.dataset_types import DatasetSpec

    return DatasetSpec(
        name=args.dataset_name, num_prompts=args.num_prompts, num_warmups=args.num_warmups, chat=chat,
        token_ids=args.prompt_format == "tokens", input_len=args.random_input_len, output_len=args.random_output_len,
        range_ratio=args.random_range_ratio, random_prefix_len=args.random_prefix_len, prefix_len=args.prefix_len,
        prefix_groups=args.prefix_num_groups, path=args.dataset_path, seed=args.seed,
        sharegpt_output_len=args.sharegpt_output_len, custom_output_len=args.custom_output_len,
        skip_chat_template=args.skip_chat_template, disable_shuffle=args.disable_shuffle,
        no_oversample=args.no_oversample,
    )


async def _run(args: argparse.Namespace, slo: dict[str, float]) -> int:
    import time

    from tqdm import tqdm

    from lmserve.bench.client import BenchClient
    from lmserve.bench.datasets import build_dataset
    from lmserve.bench.load import arrival_times, run_closed, run_open

    base_url = args.base_url
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY") or None
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    models, server_version = await _probe(base_url, headers)
    model = args.model or (models[0] if models else None)
    if model is None:
        raise ServerUnreachable(f"{base_url}/v1/models lists no model; pass --model")
    tokenizer, tokenizer_name = _pick_tokenizer(args, model, server_version)
    chat = args.backend in bench_args.CHAT_BACKENDS
    dataset = build_dataset(_dataset_spec(args, chat), tokenizer)
    pattern = arrival_pattern(args)
    # Enough connections for every request that may be in flight (an uncapped open loop: all of them).
    in_flight = args.max_concurrency or max(len(dataset.requests), len(dataset.warmups), 1)
    client = BenchClient(
        base_url, args.endpoint, args.served_model_name or model, api_key=api_key, timeout=args.timeout,
        backend=args.backend, ignore_eos=args.ignore_eos, logprobs=args.logprobs, tokenizer=tokenizer,
        max_connections=in_flight, extra_body=args.request_body,
    )
    try:
        if dataset.warmups:
            _log(f"lmserve bench: {len(dataset.warmups)} warm-up request(s)")
            warm = await run_closed(dataset.warmups, args.max_concurrency or len(dataset.warmups), client.send,
                                    lambda: time.perf_counter() - client.origin)
            failed = sum(1 for s in warm if not s.success)
            if failed:
                _log(f"lmserve bench: {failed} warm-up request(s) failed: {next(s.error for s in warm if s.error)}")
        _log(f"lmserve bench: {len(dataset.requests)} request(s) to {base_url}{args.endpoint} ({model}, "
             f"backend {args.backend}), {pattern['kind']} loop")
        if "temperature" not in args.request_body:
            _log("lmserve bench: no temperature sent (as vllm bench serve): the server's default applies; "
                 "--temperature 0 for greedy")
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
    from lmserve.bench.result import (
        machine_info,
        now_iso,
        per_request_lists,
        result_filename,
        sample_dicts,
        versions,
        vllm_date,
        vllm_header,
        without_details,
        write_json,
    )
    from lmserve.bench.table import print_table

    samples = sorted(samples, key=lambda s: s.index)
    ok = [s for s in samples if s.success]
    sources = {s.output_len_source for s in ok}
    date = vllm_date()
    metrics = compute_metrics(samples, duration, slo, selected_metrics=args.selected_metrics,
                              selected_percentiles=args.selected_percentiles, max_concurrency=args.max_concurrency,
                              request_rate=args.request_rate)
    details = per_request_lists(samples)
    result = vllm_header(date=date, backend=args.backend, label=args.label, model_id=model,
                         tokenizer_id=tokenizer_name, num_prompts=args.num_prompts or len(samples),
                         request_rate=args.request_rate,
                         burstiness=args.burstiness, max_concurrency=args.max_concurrency,
                         metadata=args.metadata_dict)
    vllm_order = ("duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
                  "request_throughput", "request_goodput", "output_throughput", "total_token_throughput")
    result.update({key: metrics[key] for key in vllm_order})
    result.update(details)
    result["queue_times"] = [s.start - (s.scheduled or 0.0) for s in samples]
    result.update(max_output_tokens_per_s=metrics["max_output_tokens_per_s"],
                  max_concurrent_requests=metrics["max_concurrent_requests"], rtfx=0.0)
    # lmserve's extras: everything vLLM does not write, under keys vLLM does not use.
    result.update({
        "date_iso": now_iso(), "base_url": base_url, "endpoint": args.endpoint, "model": model,
        "tokenizer": tokenizer_name, "config": config_dict(args), "arrival_pattern": pattern,
        "dataset": args.dataset_name,
        "lengths": {
            "input": length_stats([s.input_len for s in samples]),
            "requested_output": length_stats([s.max_tokens for s in samples]),
            "output": length_stats([s.output_len for s in ok]),
        },
        "prefix_cache": "warm" if dataset.prefix_cache_warm else "cold",
        "num_warmups": len(dataset.warmups),
        "token_count_source": sources.pop() if len(sources) == 1 else ("mixed" if sources else None),
        "input_lens_approximate": dataset.input_lens_approximate,
        "machine": machine_info(), "versions": versions(server_version),
    })
    result.update({k: v for k, v in metrics.items() if k not in result})
    result["samples"] = sample_dicts(samples)
    print_table(result, args.selected_metrics, args.selected_percentiles)
    if args.output:
        write_json(result, args.output)
        _log(f"lmserve bench: wrote {args.output}")
    if args.save_result or args.append_result:
        path = result_filename(label=args.label, backend=args.backend, request_rate=args.request_rate,
                               max_concurrency=args.max_concurrency, model_id=model, date=date,
                               result_dir=args.result_dir, result_filename=args.result_filename)
        write_json(result if args.save_detailed else without_details(result), path, append=args.append_result)
        _log(f"lmserve bench: wrote {path}")
    if args.plot:
        from lmserve.bench.plot import plot_run

        plot_run(samples, duration, args.plot, title=f"{model} @ {base_url}{args.endpoint}, {pattern['kind']} loop")
        _log(f"lmserve bench: wrote {args.plot}")


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
