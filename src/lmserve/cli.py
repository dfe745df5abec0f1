"""The `lmserve` command: generate (offline), serve, bench, plan, schedule."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from lmserve.config import DEFAULT_MODEL


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="registered name, HF directory or GGUF file")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--long-prefill-token-threshold", type=int, default=0)
    p.add_argument("--kv-cache-memory", default=None, help="bytes, or with a unit: 2GiB, 512MiB")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    p.add_argument("--seed", type=int, default=0)


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {
        "model": args.model, "dtype": args.dtype, "device": args.device, "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
        "long_prefill_token_threshold": args.long_prefill_token_threshold, "kv_cache_memory": args.kv_cache_memory,
        "enable_prefix_caching": args.enable_prefix_caching, "scheduling_policy": args.scheduling_policy, "seed": args.seed,
    }


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
    from lmserve.config import make_engine_config

    def stop(signum: int, _frame: object) -> None:
        raise ShutdownRequested(signum)

    # uvicorn handles SIGINT/SIGTERM while it serves and re-raises them when it stops; turn that re-raise into an
    # exception that serve() expects, so the engine process is shut down before we exit 0.
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    return asyncio.run(serve(
        make_engine_config(**engine_kwargs(args)), host=args.host, port=args.port, api_key=args.api_key,
        served_model_name=args.served_model_name, log_level=args.log_level.lower(),
    ))


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
    srv.add_argument("--log-level", default="INFO")
    srv.set_defaults(func=cmd_serve)
    return parser


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
