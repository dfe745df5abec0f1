"""The `lmserve` command: generate (offline), serve, bench, plan, schedule."""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time
import urllib.parse

from lmserve.config import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_LIMIT_CONCURRENCY,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    EngineConfig,
    add_engine_args,
    add_model_argument,
    engine_kwargs,
)

# The API key from the environment, where other local users cannot read it (argv is in `ps` for all).
API_KEY_VARIABLE = "LMSERVE_API_KEY"


def cmd_generate(args: argparse.Namespace) -> int:
    from lmserve import LLM, SamplingParams
    from lmserve.config_values import cpus_not_here, parse_cpus

    if problem := cpus_not_here(parse_cpus(args.engine_cpus)):
        raise ValueError(f"--engine-cpus: {problem}")
    llm = LLM(**engine_kwargs(args))
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.sampling_seed, ignore_eos=args.ignore_eos,
    )
    prompt = args.prompt
    if not args.raw:
        prompt = llm.input_processor.apply_chat_template([{"role": "user", "content": prompt}])
        prompt = llm.input_processor.tokenize(prompt, add_special_tokens=False).token_ids
    started, first, tokens = time.perf_counter(), None, 0
    for delta in llm.stream(prompt, params):
        for out in delta.outputs:
            if first is None and out.token_ids:
                first = time.perf_counter()
            tokens += len(out.token_ids)
            sys.stdout.write(out.text)
            sys.stdout.flush()
    end = time.perf_counter()
    sys.stdout.write("\n")
    decode_rate = (tokens - 1) / (end - first) if first and tokens > 1 and end > first else 0.0
    print(
        f"[{tokens} tokens in {end - started:.2f}s; first token after {((first or end) - started) * 1e3:.0f} ms; "
        f"decode {decode_rate:.1f} tokens/s]",
        file=sys.stderr,
    )
    return 0


def cmd_router(args: argparse.Namespace) -> int:
    from lmserve.api.router import run_router

    return run_router(args.prefill, args.decode, args.host, args.port, args.max_request_body_bytes, args.log_level,
                      args.api_key, args.instance_api_key, args.max_instance_connections)


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio
    import signal

    # Only what starts the engine process is imported before it starts (the web stack comes later, in serve()).
    from lmserve.api.serve import ShutdownRequested, engine_death_grace_s, serve
    from lmserve.api.tool_parsers import ToolConfig
    from lmserve.config import make_engine_config
    from lmserve.config_values import cpus_not_here, parse_cpus

    def stop(signum: int, _frame: object) -> None:
        raise ShutdownRequested(signum)

    config = make_engine_config(**engine_kwargs(args))
    engine_death_grace = engine_death_grace_s()  # a bad value fails here, before any engine starts
    api_cpus = parse_cpus(args.api_cpus)
    for flag, cpus in (("--engine-cpus", config.placement.engine_cpus), ("--api-cpus", api_cpus)):
        if problem := cpus_not_here(cpus):
            raise ValueError(f"{flag}: {problem}")
    if config.parallel.node_rank and not args.headless:
        raise ValueError(f"--node-rank {config.parallel.node_rank}: nodes other than 0 run only their ranks; add "
                         "--headless (node 0 serves the API)")
    if config.parallel.data_parallel_start_rank and not args.headless:
        raise ValueError(f"--data-parallel-start-rank {config.parallel.data_parallel_start_rank}: machines other "
                         "than the front-end's run only their replicas; add --headless")
    more_models = pooling_models(args)
    if more_models and args.headless:
        raise ValueError("--embedding-model and --rerank-model are served by the front-end's machine: not with "
                         "--headless")
    if args.headless:
        from lmserve.headless import run_headless

        return run_headless(config, args.log_level.upper())
    # uvicorn handles SIGINT/SIGTERM while it serves and re-raises them when it stops; turn that re-raise into an
    # exception that serve() expects, so the engine process is shut down before we exit 0.
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    code = asyncio.run(serve(
        config, host=args.host, port=args.port, api_key=args.api_key or os.environ.get(API_KEY_VARIABLE) or None,
        served_model_name=args.served_model_name, log_level=args.log_level.lower(), request_log=args.request_log,
        api_cpus=api_cpus, max_queued_requests=args.max_queued_requests,
        max_request_body_bytes=args.max_request_body_bytes,
        tools=ToolConfig(args.enable_auto_tool_choice, args.tool_call_parser, args.reasoning_parser),
        allowed_origins=args.allowed_origins, engine_death_grace=engine_death_grace, **http_limits(args),
        more_models=more_models,
    ))
    from lmserve.process_exit import exit_closed

    exit_closed(code)  # serve() stopped the engine and closed the sockets: the interpreter's teardown adds nothing


# The chat model's engine settings that an embedding model or reranker served beside it takes too; the rest (its
# tokenizer, length, quantization, layout, speculative decoding, memory and CPUs) are the chat model's own.
SHARED_ENGINE_SETTINGS = ("dtype", "device", "seed", "block_size", "enforce_eager", "attention_backend",
                          "max_num_batched_tokens", "max_num_seqs", "scheduling_policy")


def pooling_models(args: argparse.Namespace) -> list[tuple[EngineConfig, str | None]]:
    """The engine configs and served names of --embedding-model and --rerank-model (each its own engine process,
    with the KV memory and CPUs of the --pooling-* flags)."""
    from lmserve.config import make_engine_config
    from lmserve.config_values import cpus_not_here, parse_cpus

    found = [(flag, model, name) for flag, model, name in (
        ("--embedding-model", args.embedding_model, args.embedding_model_name),
        ("--rerank-model", args.rerank_model, args.rerank_model_name)) if model]
    if not found:
        return []
    shared = {flat: value for flat, value in engine_kwargs(args).items() if flat in SHARED_ENGINE_SETTINGS}
    if problem := cpus_not_here(parse_cpus(args.pooling_engine_cpus)):
        raise ValueError(f"--pooling-engine-cpus: {problem}")
    chat_names = args.served_model_name or [engine_kwargs(args).get("model")]
    for flag, model, name in found:
        _check_pooling_task(flag, model)
        if (name or model) in chat_names or sum((n or m) == (name or model) for _, m, n in found) > 1:
            raise ValueError(f"{flag} {model}: another model is served as {name or model!r}; give it "
                             f"{flag}-name")
    # A reranker's engine scores (--task score): a Qwen3 decoder given here is a yes/no reranker (Qwen3-Reranker).
    return [(make_engine_config(model, **shared, kv_cache_memory=args.pooling_kv_cache_memory,
                                engine_threads=args.pooling_engine_threads, engine_cpus=args.pooling_engine_cpus,
                                task="score" if flag == "--rerank-model" else "auto"),
             name) for flag, model, name in found]


def _check_pooling_task(flag: str, model: str) -> None:
    """An embedding model for --embedding-model, a cross-encoder for --rerank-model: told before any engine starts."""
    from lmserve.models import resolve_model
    from lmserve.pooling_config import is_pooling_model, load_pooling_config

    source = resolve_model(model)
    wanted = "embed" if flag == "--embedding-model" else "score"
    asked = "score" if wanted == "score" else "auto"
    task = load_pooling_config(source, asked).task if is_pooling_model(source, asked) else "generate"
    if task != wanted:
        what = {"generate": "a generative model (serve it as the chat model)", "embed": "an embedding model",
                "score": "a reranker (a cross-encoder)"}[task]
        raise ValueError(f"{flag} {model}: this is {what}")


def http_limits(args: argparse.Namespace) -> dict[str, float | int]:
    """serve()'s keywords for the slow-client deadlines and the connection cap."""
    return {"header_timeout": args.header_timeout, "body_timeout": args.body_timeout,
            "limit_concurrency": args.limit_concurrency}


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in [0, 65535], got {value}")
    return value


def _instance_url(text: str) -> str:
    parsed = urllib.parse.urlsplit(text)
    if parsed.scheme not in ("http", "https") or not parsed.netloc or len(text) > 2048:
        raise argparse.ArgumentTypeError(f"must be an instance's base URL such as http://127.0.0.1:8100, got {text!r}")
    return text


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def _log_level(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--log-level", default=default, type=str.lower, choices=LOG_LEVELS,
                        help=f"(default: {default})")


def build_parser() -> argparse.ArgumentParser:
    from lmserve import __version__

    parser = argparse.ArgumentParser(prog="lmserve", description=__doc__)
    parser.add_argument("--version", action="version", version=f"lmserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text offline and stream it to the terminal")
    gen.add_argument("prompt")
    add_engine_args(gen)
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    _log_level(gen, "warning")
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="serve an OpenAI-compatible API")
    add_model_argument(srv)
    add_engine_args(srv)
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=_port, default=8000)
    srv.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' on /v1, /tokenize, /detokenize, /debug, the dashboard's "
                          f"data and the API docs; default: ${API_KEY_VARIABLE} (which `ps` does not show), as vLLM "
                          "reads VLLM_API_KEY")
    srv.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                     help="the model's names in the API: requests may use any, responses and /metrics the first "
                          "(default: the model argument)")
    srv.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                     help="answer browser pages from these origins (CORS), e.g. http://localhost:3000, or '*' for "
                          "any (default: none, so that no web page can call this server from a browser)")
    srv.add_argument("--api-cpus", default=None, help="CPUs the API process runs on, e.g. '0' (default: all)")
    srv.add_argument("--request-log", default=None, metavar="FILE",
                     help="append one JSON line per finished request with its whole timeline")
    _log_level(srv, "info")
    srv.add_argument("--max-queued-requests", type=_positive_int, default=None, metavar="N",
                     help="answer 429 (with Retry-After) while N requests already wait for the engine "
                          "(default: no limit)")
    srv.add_argument("--max-request-body-bytes", type=_positive_int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                     metavar="BYTES", help="answer 413 to larger request bodies (default: %(default)s)")
    srv.add_argument("--header-timeout", type=_positive_seconds, default=DEFAULT_HEADER_TIMEOUT_S, metavar="SECONDS",
                     help="close a connection whose request headers are not complete this long after it opened or "
                          "its last response ended: slow or silent clients (default: %(default)s)")
    srv.add_argument("--body-timeout", type=_positive_seconds, default=DEFAULT_BODY_TIMEOUT_S, metavar="SECONDS",
                     help="answer 408 and close the connection when a request body is not complete this long after "
                          "its headers (default: %(default)s)")
    srv.add_argument("--limit-concurrency", type=_positive_int, default=DEFAULT_LIMIT_CONCURRENCY, metavar="N",
                     help="as uvicorn's: answer 503 to requests beyond N open connections or requests in flight; "
                          "each holds a file descriptor (default: %(default)s)")
    srv.add_argument("--enable-auto-tool-choice", action="store_true",
                     help='let the model decide to call tools (tool_choice "auto"), parsed by --tool-call-parser')
    srv.add_argument("--tool-call-parser", default=None,
                     choices=("hermes", "llama3_json", "mistral", "pythonic", "harmony", "openai"),
                     help="the model's tool-call format: hermes (Qwen2.5, Hermes), llama3_json (Llama 3.1+), mistral "
                          "(Mistral's [TOOL_CALLS]), pythonic (Llama 3.2 and 4's Python call lists), harmony or "
                          "openai (gpt-oss's; chosen by itself for a gpt-oss model)")
    srv.add_argument("--reasoning-parser", default=None, choices=("deepseek_r1", "qwen3", "harmony", "openai_gptoss"),
                     help="split the model's <think>...</think> into the message's reasoning_content: deepseek_r1 "
                          "(DeepSeek-R1 and its distills), qwen3 (Qwen3); harmony or openai_gptoss: gpt-oss's analysis "
                          "channel (chosen by itself for a gpt-oss model)")
    models = srv.add_argument_group(
        "more models", "serve an embedding model and a reranker beside the chat model, each in an engine process of "
        "its own; a request's `model` picks one (docs/embeddings.md)")
    models.add_argument("--embedding-model", default=None, metavar="MODEL",
                        help="an embedding model for /v1/embeddings (a sentence-transformers directory or GGUF)")
    models.add_argument("--embedding-model-name", default=None, metavar="NAME",
                        help="its name in the API (default: the --embedding-model argument)")
    models.add_argument("--rerank-model", default=None, metavar="MODEL",
                        help="a reranker (a cross-encoder, or a Qwen3 yes/no reranker such as Qwen3-Reranker) for "
                             "/v1/rerank and /v1/score")
    models.add_argument("--rerank-model-name", default=None, metavar="NAME",
                        help="its name in the API (default: the --rerank-model argument)")
    models.add_argument("--pooling-kv-cache-memory", default="512MiB", metavar="SIZE",
                        help="KV memory of each of these models' engines, e.g. 512MiB (default: %(default)s; the "
                             "chat model's is --kv-cache-memory)")
    models.add_argument("--pooling-engine-threads", type=_positive_int, default=None, metavar="N",
                        help="compute threads of each of these models' engines (default: one per CPU it may use)")
    models.add_argument("--pooling-engine-cpus", default=None, metavar="CPUS",
                        help="CPUs these models' engines run on, e.g. '6-7' (default: all; give the chat model "
                             "--engine-cpus apart from them so that the engines do not compete)")
    srv.add_argument("--headless", action="store_true",
                     help="on machines other than the front-end's: run only this machine's ranks (--nnodes, "
                          "--node-rank; node 0's engine configures them) or data-parallel replicas "
                          "(--data-parallel-start-rank, --data-parallel-size-local), no API; give every machine the "
                          "same model path and layout flags")
    srv.set_defaults(func=cmd_serve)

    router = sub.add_parser("router", help="one OpenAI endpoint in front of prefill and decode instances "
                                           "(prefill/decode disaggregation, --kv-transfer-config)")
    router.add_argument("--prefill", required=True, metavar="URL", nargs="+", action="extend", type=_instance_url,
                        help="the prefill instances (kv_producer), e.g. http://127.0.0.1:8100; each request goes to "
                             "the one with the fewest requests in flight")
    router.add_argument("--decode", required=True, metavar="URL", nargs="+", action="extend", type=_instance_url,
                        help="the decode instances (kv_consumer), e.g. http://127.0.0.1:8200")
    router.add_argument("--host", default="127.0.0.1")
    router.add_argument("--port", type=_port, default=8000)
    router.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on the router's /v1 routes (or set LMSERVE_API_KEY, "
                             "which ps does not show)")
    router.add_argument("--instance-api-key", default=None,
                        help="the key the instances require, sent to them in the client's stead (or set "
                             "LMSERVE_INSTANCE_API_KEY); without it the client's Authorization header is forwarded")
    router.add_argument("--max-instance-connections", type=_positive_int, default=256, metavar="N",
                        help="connections to the prefill instances, and as many to the decode ones (a stream holds "
                             "one for its length); a call that finds none free within 10 s is answered 503 "
                             "(default: %(default)s)")
    router.add_argument("--max-request-body-bytes", type=_positive_int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                        metavar="BYTES", help="answer 413 to larger request bodies (default: %(default)s)")
    _log_level(router, "info")
    router.set_defaults(func=cmd_router)

    # These parsers import only argparse; the load generator and the planners import the rest when they run.
    from lmserve.bench import cli as bench_cli

    bench = sub.add_parser("bench", help=bench_cli.HELP)
    bench_cli.add_arguments(bench)
    bench.set_defaults(func=bench_cli.run, log_level="WARNING")
    from lmserve.plan import cli as plan_cli

    plan_cli.add_plan_parser(sub)
    plan_cli.add_schedule_parser(sub)
    return parser




def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        code = args.func(args)
        sys.stdout.flush()  # a reader that went away shows here, not in the interpreter's own flush at exit
        return code
    except (ValueError, FileNotFoundError) as exc:
        print(f"lmserve: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (`lmserve plan ... | head`): stop quietly, as other command-line tools do. Python's
        # own flush of stdout at exit would raise again, so stdout points at /dev/null from here on.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a tool killed by it


if __name__ == "__main__":
    sys.exit(main())
