"""The `lmserve` command: generate (offline), serve, bench, plan, schedule."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from lmserve.config import (
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    DEFAULT_MODEL,
    SchedulerConfig,
    add_engine_args,
    engine_kwargs,
)


def cmd_generate(args: argparse.Namespace) -> int:
    from lmserve import LLM, SamplingParams

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


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio
    import signal

    from lmserve.api.serve import ShutdownRequested, serve
    from lmserve.config import make_engine_config, parse_cpus

    def stop(signum: int, _frame: object) -> None:
        raise ShutdownRequested(signum)

    # uvicorn handles SIGINT/SIGTERM while it serves and re-raises them when it stops; turn that re-raise into an
    # exception that serve() expects, so the engine process is shut down before we exit 0.
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    return asyncio.run(serve(
        make_engine_config(**engine_kwargs(args)), host=args.host, port=args.port, api_key=args.api_key,
        served_model_name=args.served_model_name, log_level=args.log_level.lower(), request_log=args.request_log,
        api_cpus=parse_cpus(args.api_cpus), max_queued_requests=args.max_queued_requests,
        max_request_body_bytes=args.max_request_body_bytes,
    ))


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lmserve", description=__doc__)
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
    gen.add_argument("--log-level", default="WARNING")
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="serve an OpenAI-compatible API")
    add_engine_args(srv)
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    srv.add_argument("--served-model-name", default=None)
    srv.add_argument("--api-cpus", default=None, help="CPUs the API process runs on, e.g. '0' (default: all)")
    srv.add_argument("--request-log", default=None, metavar="FILE",
                     help="append one JSON line per finished request with its whole timeline")
    srv.add_argument("--log-level", default="INFO")
    srv.add_argument("--max-queued-requests", type=_positive_int, default=None, metavar="N",
                     help="answer 429 (with Retry-After) while N requests already wait for the engine "
                          "(default: no limit)")
    srv.add_argument("--max-request-body-bytes", type=_positive_int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                     metavar="BYTES", help="answer 413 to larger request bodies (default: %(default)s)")
    srv.set_defaults(func=cmd_serve)

    add_plan_parser(sub)
    add_schedule_parser(sub)

    # The bench parser imports only argparse; the load generator imports its dependencies when it runs.
    from lmserve.bench import cli as bench_cli

    bench = sub.add_parser("bench", help=bench_cli.HELP)
    bench_cli.add_arguments(bench)
    bench.set_defaults(func=bench_cli.run, log_level="WARNING")
    return parser


# ---- planning: the imports stay inside the commands so that generate/serve never pay for them ----------------


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="memory budget: will a model and a target concurrency fit (no weights loaded)")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--model", default=None,
                        help="shipped config name (llama-3-8b, llama-3-70b, qwen2.5-7b, mistral-7b, smollm2-135m), "
                             "HF directory, config.json, GGUF file or registered name; default: the default model")
    source.add_argument("--config", default=None, help="an HF config.json file")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--kv-dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default: the weights' dtype")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's own context length")
    p.add_argument("--context", type=int, default=None, help="tokens per request; default: max-model-len")
    p.add_argument("--concurrency", type=int, default=1, help="target concurrent requests per replica")
    p.add_argument("--device-memory", type=float, default=None, help="GiB per device; default: this machine's RAM")
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--replicas", type=int, default=None, help="default: gpus / (tp × pp)")
    p.add_argument("--max-num-batched-tokens", type=int, default=SchedulerConfig.max_num_batched_tokens)
    p.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--overhead-gib", type=float, default=None,
                   help="stated framework overhead per device (default 1.0: CUDA context, allocator, buffers)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan, log_level="WARNING")


def cmd_plan(args: argparse.Namespace) -> int:
    import json

    from lmserve.plan.memory import (
        DEFAULT_OVERHEAD_GIB,
        GiB,
        Layout,
        PlanSettings,
        compare_layouts,
        load_spec,
        make_plan,
        render_plan,
    )

    spec = load_spec(args.model if args.model or args.config else DEFAULT_MODEL, args.config)
    group = args.tp * args.pp
    if min(args.gpus, args.tp, args.pp) < 1:
        raise ValueError("--gpus, --tp and --pp must be >= 1")
    replicas = args.replicas if args.replicas is not None else args.gpus // group
    if replicas < 1 or replicas * group > args.gpus:
        raise ValueError(f"TP {args.tp} × PP {args.pp} × {replicas} replica(s) needs more than --gpus {args.gpus}")
    overhead = DEFAULT_OVERHEAD_GIB if args.overhead_gib is None else args.overhead_gib
    settings = PlanSettings(
        dtype=args.dtype, kv_dtype=args.kv_dtype, max_model_len=args.max_model_len, context=args.context,
        concurrency=args.concurrency,
        device_memory=None if args.device_memory is None else int(args.device_memory * GiB),
        layout=Layout(args.tp, args.pp, replicas), max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs, block_size=args.block_size, overhead=int(overhead * GiB),
    )
    plan = make_plan(spec, settings)
    options = compare_layouts(spec, settings, args.gpus) if args.gpus > 1 else []
    if args.json:
        print(json.dumps({**plan.to_dict(), "compared": [o.to_dict() for o in options]}, indent=2))
    else:
        print(render_plan(plan, options))
    return 0 if plan.fits else 1


def add_schedule_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("schedule", help="replay a workload through the real scheduler and print each iteration")
    p.add_argument("--request", action="append", default=[], metavar="NAME:PROMPT:OUTPUT[@ITER]",
                   help="a request: name, prompt length, output length, arrival iteration (default 1); repeatable")
    p.add_argument("--requests-file", default=None,
                   help='JSON: [{"name": "a", "prompt_len": 10, "output_len": 3, "arrival": 1}, ...]')
    p.add_argument("--budget", type=int, default=SchedulerConfig.max_num_batched_tokens, help="max_num_batched_tokens")
    p.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs)
    p.add_argument("--long-prefill-token-threshold", type=int, default=0)
    p.add_argument("--blocks", type=int, default=None, help="KV blocks; default: room for every request at once")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--format", default="table", choices=["table", "json", "markdown"])
    p.add_argument("--cost-model", default=None, help="JSON {ms_per_position, ms_per_step} from --calibrate")
    p.add_argument("--calibrate", action="store_true",
                   help="measure the cost model on this machine with --model (loads it) and print it as JSON")
    p.add_argument("--model", default=DEFAULT_MODEL, help="the model --calibrate measures")
    p.add_argument("--output", default=None, help="with --calibrate: also write the cost model to this file")
    p.set_defaults(func=cmd_schedule, log_level="WARNING")


def cmd_schedule(args: argparse.Namespace) -> int:
    import json
    from dataclasses import asdict
    from pathlib import Path

    from lmserve.plan.schedule import (
        CostModel,
        ScheduleSettings,
        calibrate,
        load_requests,
        parse_request,
        render,
        replay,
    )

    if args.calibrate:
        text = json.dumps(asdict(calibrate(args.model)), indent=2)
        if args.output:
            Path(args.output).write_text(text + "\n")
        print(text)
        return 0
    specs = [parse_request(r) for r in args.request]
    if args.requests_file:
        specs += load_requests(args.requests_file)
    settings = ScheduleSettings(
        budget=args.budget, max_num_seqs=args.max_num_seqs,
        long_prefill_token_threshold=args.long_prefill_token_threshold, num_blocks=args.blocks,
        block_size=args.block_size, enable_prefix_caching=args.enable_prefix_caching,
    )
    cost_model = CostModel.load(args.cost_model) if args.cost_model else None
    print(render(replay(specs, settings, cost_model), args.format))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"lmserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
