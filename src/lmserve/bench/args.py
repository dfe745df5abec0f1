"""`lmserve bench`'s flags: `vllm bench serve`'s names, meanings and defaults, plus lmserve's own (marked so).

Only argparse, json and math are imported here: `lmserve serve` builds this parser too and must not pay for numpy,
httpx or torch.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

# vLLM's request functions that speak the OpenAI text API; its others (audio, embeddings, rerank, ...) are refused.
BACKENDS = ("vllm", "openai", "openai-chat")
CHAT_BACKENDS = ("openai-chat",)
DATASETS = ("random", "sharegpt", "custom", "prefix", "jsonl", "chat")
FILE_DATASETS = ("sharegpt", "custom", "jsonl")
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el", "client_queue_time", "e2el_including_client_queue")
SAMPLING_FLAGS = ("top_p", "top_k", "min_p", "temperature", "frequency_penalty", "presence_penalty",
                  "repetition_penalty")


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc.msg})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, e.g. '{\"top_k\": 20}'")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    target = p.add_argument_group("target")
    target.add_argument("--backend", default=None,
                        help=f"{', '.join(BACKENDS)} (vLLM's names; vllm and openai are /v1/completions, openai-chat "
                             "is /v1/chat/completions); default: openai-chat when --endpoint ends in "
                             "chat/completions, else openai")
    target.add_argument("--base-url", default=None, help="server root, without /v1; overrides --host/--port")
    target.add_argument("--host", default="127.0.0.1")
    target.add_argument("--port", type=int, default=8000)
    target.add_argument("--endpoint", default=None,
                        help="default: /v1/completions (/v1/chat/completions with --backend openai-chat)")
    target.add_argument("--model", default=None, help="model name to request; default: the first of GET /v1/models")
    target.add_argument("--served-model-name", default=None, help="the request's model field, if not --model")
    target.add_argument("--tokenizer", default=None,
                        help="tokenizer (HF directory, GGUF file or lmserve registered name) for exact prompt "
                             "lengths; default: the served model's when the server is lmserve, else none")
    target.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'; default: $OPENAI_API_KEY")
    target.add_argument("--timeout", type=float, default=600.0, help="lmserve: seconds per request (timed out)")

    data = p.add_argument_group("dataset")
    data.add_argument("--dataset-name", default="random", choices=DATASETS)
    data.add_argument("--dataset-path", default=None,
                      help="sharegpt: a ShareGPT JSON file; custom: a .jsonl of {\"prompt\": ...}; jsonl (lmserve): "
                           '{"prompt": str, "output_len"?: int} a line')
    data.add_argument("--num-prompts", type=int, default=None, help="default: 1000 (jsonl: the file's lines)")
    data.add_argument("--seed", type=int, default=0, help="seeds the prompts and the arrival schedule")
    data.add_argument("--input-len", type=int, default=None, help="sets --random-input-len")
    data.add_argument("--output-len", type=int, default=None,
                      help="sets --random-output-len, --sharegpt-output-len and --custom-output-len")
    data.add_argument("--random-input-len", type=int, default=1024,
                      help="random: prompt tokens after the prefix; prefix: suffix tokens after the shared prefix")
    data.add_argument("--random-output-len", type=int, default=128, help="max_tokens (synthetic datasets)")
    data.add_argument("--random-range-ratio", type=float, default=0.0,
                      help="lengths uniform in [L*(1-r), L*(1+r)], 0 <= r < 1")
    data.add_argument("--random-prefix-len", type=int, default=0,
                      help="random: tokens of one fixed prefix before every prompt's random tokens")
    data.add_argument("--sharegpt-output-len", type=int, default=None,
                      help="sharegpt: max_tokens for every request (default: the reply's token count)")
    data.add_argument("--custom-output-len", type=int, default=256, help="custom: max_tokens for every request")
    data.add_argument("--skip-chat-template", action="store_true",
                      help="custom: send the prompt as it is, not through the model's chat template")
    data.add_argument("--disable-shuffle", action="store_true", help="sharegpt/custom: keep the file's order")
    data.add_argument("--no-oversample", action="store_true",
                      help="sharegpt/custom: fewer prompts than --num-prompts stay fewer")
    data.add_argument("--prefix-num-groups", type=int, default=1, help="prefix (lmserve): groups sharing a prefix")
    data.add_argument("--prefix-len", type=int, default=256, help="prefix (lmserve): tokens shared within a group")
    data.add_argument("--prompt-format", default="tokens", choices=["tokens", "text"],
                      help="lmserve: synthetic /v1/completions prompts as token ids (exact lengths) or text")

    load = p.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=math.inf,
                      help="open loop: requests/s (default inf: closed loop with --max-concurrency, else burst)")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of the arrival gaps: 1 = Poisson, <1 burstier, >1 more regular")
    load.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    load.add_argument("--time-limit", type=float, default=None, help="lmserve: seconds; no new requests after it")
    load.add_argument("--num-warmups", type=int, default=0, help="requests sent first and left out of the results")

    req = p.add_argument_group("request (sampling flags are sent only when given: the server's defaults apply)")
    for name in SAMPLING_FLAGS:
        req.add_argument(f"--{name.replace('_', '-')}", type=int if name == "top_k" else float, default=None)
    req.add_argument("--ignore-eos", action="store_true",
                     help='send "ignore_eos": true (always on for --dataset-name random, as vLLM)')
    req.add_argument("--logprobs", type=int, default=None, help="completions: the request's logprobs")
    req.add_argument("--extra-body", type=_json_object, default=None,
                     help="a JSON object merged into every request body (wins over the sampling flags)")

    out = p.add_argument_group("output")
    out.add_argument("--percentile-metrics", default=None,
                     help=f"comma-separated, of {', '.join(PERCENTILE_METRICS)}; default: ttft,tpot,itl")
    out.add_argument("--metric-percentiles", default="99", help='comma-separated percentiles, e.g. "25,50,99"')
    out.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS", help="goodput SLOs: ttft, tpot, e2el")
    out.add_argument("--slo", default=None, metavar="ttft=MS,tpot=MS,e2el=MS", help="lmserve's form of --goodput")
    out.add_argument("--save-result", action="store_true", help="write the result JSON (vLLM's name and shape)")
    out.add_argument("--save-detailed", action="store_true",
                     help="with --save-result: include per-request lists (input_lens, ttfts, itls, texts, errors)")
    out.add_argument("--append-result", action="store_true", help="append the result to the file instead")
    out.add_argument("--result-dir", default=None, help="directory of the result file (default: current)")
    out.add_argument("--result-filename", default=None,
                     help="default: {label}-{request_rate}qps[-concurrency{C}]-{model}-{YYYYmmdd-HHMMSS}.json")
    out.add_argument("--label", default=None, help="the result's label and filename prefix (default: the backend)")
    out.add_argument("--metadata", nargs="*", default=None, metavar="KEY=VALUE", help="extra keys in the result")
    out.add_argument("--output", default=None,
                     help="lmserve: write the result JSON here, always with every per-request sample")
    out.add_argument("--plot", default=None, help="lmserve: write latency CDFs and tokens/s over time to this PNG")
    out.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def validate(args: argparse.Namespace) -> dict[str, float]:
    """Check what argparse cannot and fill in the derived settings; returns the SLOs. Raises ValueError (exit 2)."""
    from lmserve.bench.metrics import parse_slo

    resolve(args)
    checks = [
        (args.num_prompts is None or args.num_prompts >= 1, "--num-prompts must be >= 1"),
        (args.num_warmups >= 0, "--num-warmups must be >= 0"),
        (args.request_rate > 0, "--request-rate must be > 0"),
        (args.burstiness > 0, "--burstiness must be > 0"),
        (args.max_concurrency is None or args.max_concurrency >= 1, "--max-concurrency must be >= 1"),
        (args.time_limit is None or args.time_limit > 0, "--time-limit must be > 0"),
        (args.timeout > 0, "--timeout must be > 0"),
        (args.random_input_len >= 1 and args.random_output_len >= 1, "--random-input/output-len must be >= 1"),
        (args.random_prefix_len >= 0, "--random-prefix-len must be >= 0"),
        (0 <= args.random_range_ratio < 1, "--random-range-ratio must be in [0, 1)"),
        (args.custom_output_len >= 1, "--custom-output-len must be >= 1"),
        (args.sharegpt_output_len is None or args.sharegpt_output_len >= 1, "--sharegpt-output-len must be >= 1"),
        (args.prefix_num_groups >= 1 and args.prefix_len >= 0, "--prefix-num-groups >= 1, --prefix-len >= 0"),
        (args.endpoint.startswith("/"), "--endpoint must start with '/', e.g. /v1/completions"),
        (args.base_url.startswith(("http://", "https://")), "--base-url must start with http:// or https://"),
        (args.dataset_name not in FILE_DATASETS or args.dataset_path,
         f"--dataset-name {args.dataset_name} needs --dataset-path"),
        (args.dataset_name in FILE_DATASETS or not args.dataset_path,
         f"--dataset-name {args.dataset_name} takes no --dataset-path (sharegpt, custom or jsonl read files)"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
    slo = parse_slo(args.slo) if args.slo else {}
    for item in args.goodput or []:
        slo.update(parse_slo(item, sep=":"))
    return slo


def resolve(args: argparse.Namespace) -> None:
    """vLLM's derived settings: backend, URL, general lengths, forced ignore_eos, request body, percentiles."""
    if args.backend is not None and args.backend not in BACKENDS:
        raise ValueError(f"--backend {args.backend} is not supported by lmserve bench (choose from "
                         f"{', '.join(BACKENDS)}: the OpenAI text endpoints)")
    if args.backend is None:
        chat_endpoint = (args.endpoint or "").rstrip("/").endswith("chat/completions")
        args.backend = "openai-chat" if chat_endpoint else "openai"
    chat = args.backend in CHAT_BACKENDS
    if args.endpoint is None:
        args.endpoint = "/v1/chat/completions" if chat else "/v1/completions"
    # vLLM's request functions check the URL's suffix; say so before the run rather than fail every request.
    suffix = "chat/completions" if chat else "completions"
    if not args.endpoint.rstrip("/").endswith(suffix) or (not chat and args.endpoint.endswith("chat/completions")):
        raise ValueError(f"--backend {args.backend} needs an --endpoint ending in /{suffix}, not {args.endpoint}")
    if args.base_url is None:
        host = f"[{args.host}]" if ":" in args.host and not args.host.startswith("[") else args.host
        args.base_url = f"http://{host}:{args.port}"
    args.base_url = args.base_url.rstrip("/")
    if args.input_len is not None:
        args.random_input_len = args.input_len
    if args.output_len is not None:
        args.random_output_len = args.sharegpt_output_len = args.custom_output_len = args.output_len
    if args.dataset_name == "random":
        args.ignore_eos = True  # vLLM: random prompts run to their requested length
    args.request_body = request_body(args)
    args.selected_metrics, args.selected_percentiles = percentile_selection(args)


def request_body(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling flags that were given, then --extra-body over them (vLLM's merge order)."""
    sampling = {name: value for name in SAMPLING_FLAGS if (value := getattr(args, name)) is not None}
    return {**sampling, **(args.extra_body or {})}


def percentile_selection(args: argparse.Namespace) -> tuple[list[str], list[float]]:
    metrics = [m.strip() for m in (args.percentile_metrics or "ttft,tpot,itl").split(",") if m.strip()]
    unknown = [m for m in metrics if m not in PERCENTILE_METRICS]
    if unknown:
        raise ValueError(f"--percentile-metrics: unknown {', '.join(unknown)} (of {', '.join(PERCENTILE_METRICS)})")
    try:
        percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"--metric-percentiles {args.metric_percentiles}: comma-separated numbers") from None
    if not percentiles or not all(0 <= p <= 100 for p in percentiles):
        raise ValueError("--metric-percentiles must be numbers in [0, 100]")
    return metrics, percentiles


def arrival_pattern(args: argparse.Namespace) -> dict[str, Any]:
    if math.isfinite(args.request_rate):
        kind = "open"
    else:
        kind = "closed" if args.max_concurrency else "burst"
    return {"kind": kind, "request_rate": args.request_rate, "burstiness": args.burstiness,
            "max_concurrency": args.max_concurrency}


def config_dict(args: argparse.Namespace) -> dict[str, Any]:
    """Every argument, minus the dispatch function, with the API key hidden."""
    config = {k: v for k, v in vars(args).items() if not callable(v)}
    if config.get("api_key"):
        config["api_key"] = "<set>"
    return config
