"""`lmserve plan` (will a model fit, how to lay it out) and `lmserve schedule` (replay the scheduler on paper).

Imports only argparse at load time: building the top-level parser must not pay for the planners.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict

from lmserve.config import DEFAULT_MODEL, SchedulerConfig


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="memory budget: will a model and a target concurrency fit (no weights loaded)")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as `lmserve serve MODEL` takes it (the same as --model)")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--model", default=None,
                        help="shipped config name (llama-3-8b, llama-3-70b, qwen2.5-7b, mistral-7b, smollm2-135m), "
                             "HF directory, config.json, GGUF file or registered name; default: the default model")
    source.add_argument("--config", default=None, help="an HF config.json file")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--kv-dtype", default=None, choices=["float32", "bfloat16", "float16", "int8"],
                   help="default: the weights' dtype; int8: 8-bit values and a float16 scale per 32 (34 bytes per 32)")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's own context length")
    p.add_argument("--context", type=int, default=None, help="tokens per request; default: max-model-len")
    p.add_argument("--concurrency", type=int, default=1, help="target concurrent requests per replica")
    p.add_argument("--device-memory", type=float, default=None, help="GiB per device; default: this machine's RAM")
    p.add_argument("--gpus", type=int, default=None, help="devices to lay out; default: tp × pp × replicas")
    # The engine's flag names too (lmserve serve -tp/-pp/-dp), so that a plan and a serve command read alike.
    p.add_argument("--tp", "-tp", "--tensor-parallel-size", dest="tp", type=int, default=1)
    p.add_argument("--pp", "-pp", "--pipeline-parallel-size", dest="pp", type=int, default=1)
    p.add_argument("--replicas", "-dp", "--data-parallel-size", dest="replicas", type=int, default=None,
                   help="data-parallel replicas; default: gpus / (tp × pp)")
    p.add_argument("--devices-per-node", type=int, default=None,
                   help="devices of one machine: a layout on more of them is served with Ray (default: unknown)")
    p.add_argument("--max-num-batched-tokens", type=int, default=SchedulerConfig.max_num_batched_tokens)
    p.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--overhead-gib", type=float, default=None,
                   help="stated framework overhead per device (default 1.0: CUDA context, allocator, buffers)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--itl-target-ms", type=float, default=None,
                   help="also say whether prefill/decode separation meets this inter-token latency for "
                        "--concurrency streams while prompts of --prompt-len arrive (needs --cost-model)")
    p.add_argument("--prompt-len", type=int, default=None, help="with --itl-target-ms: the arriving prompts' length")
    p.add_argument("--cost-model", default=None,
                   help="with --itl-target-ms: JSON {ms_per_position, ms_per_step} from `lmserve schedule --calibrate`")
    p.set_defaults(func=cmd_plan, log_level="WARNING")


def cmd_plan(args: argparse.Namespace) -> int:
    import json

    from lmserve.plan.comm import comm_per_token, render_comm
    from lmserve.plan.memory import (
        DEFAULT_OVERHEAD_GIB,
        GiB,
        PlanSettings,
        compare_layouts,
        make_plan,
        render_plan,
    )
    from lmserve.plan.model_spec import Layout, load_spec
    from lmserve.plan.serve_command import recommended_plan, serve_command

    if args.model_tag is not None:
        if (args.model or args.config or args.model_tag) != args.model_tag:
            raise ValueError(f"two models: {args.model_tag} and --{'model' if args.model else 'config'} "
                             f"{args.model or args.config}; give one")
        args.model = args.model_tag
    spec = load_spec(args.model if args.model or args.config else DEFAULT_MODEL, args.config)
    group = args.tp * args.pp
    if args.gpus is None:  # `lmserve plan -tp 2` plans two devices, as `lmserve serve -tp 2` runs two ranks
        args.gpus = group * (args.replicas or 1)
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
    if args.devices_per_node is not None and args.devices_per_node < 1:
        raise ValueError("--devices-per-node must be >= 1")
    plan = make_plan(spec, settings)
    options = compare_layouts(spec, settings, args.gpus) if args.gpus > 1 else []
    comm = comm_per_token(spec, plan.layout, plan.dtype)
    serve = recommended_plan(plan, options)
    model = args.model or (_model_of_config(args.config) if args.config else DEFAULT_MODEL)
    command = serve_command(model, serve, args.devices_per_node)
    if args.json:
        print(json.dumps({
            **plan.to_dict(), "compared": [o.to_dict() for o in options], "comm_per_token": {**asdict(comm), "per_rank_max": comm.per_rank_max},
            "serve_command": command, "serve_layout": asdict(serve.layout),
        }, indent=2))
    else:
        print(render_plan(plan, options))
        print("\n".join(["", *render_comm(comm), ""]))
        if serve is not plan:
            which = f"instead: TP{serve.layout.tp}×PP{serve.layout.pp}×{serve.layout.replicas}, which fits"
        else:
            which = "this layout" if plan.fits else "this layout, which does not fit"
        print(f"serve ({which}):\n  {command}")
    if args.itl_target_ms is not None:
        from lmserve.plan.cost_model import CostModel
        from lmserve.plan.disaggregation import separation_advice

        if args.cost_model is None or args.prompt_len is None:
            raise ValueError("--itl-target-ms needs --cost-model (lmserve schedule --calibrate) and --prompt-len")
        advice = separation_advice(CostModel.load(args.cost_model), args.prompt_len, args.concurrency,
                                   args.max_num_batched_tokens, args.itl_target_ms, model)
        print("\n" + advice.render())
    return 0 if plan.fits else 1


def _model_of_config(config_file: str) -> str:
    """An HF directory's config.json stands for the directory; a lone config file for no model lmserve can load."""
    from pathlib import Path

    path = Path(config_file)
    return str(path.parent) if path.name == "config.json" else "MODEL"


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

    from lmserve.plan.cost_model import CostModel, calibrate
    from lmserve.plan.schedule import ScheduleSettings, render, replay
    from lmserve.plan.workload import load_requests, parse_request

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
