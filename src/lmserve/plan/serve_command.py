"""The `lmserve serve` command of a plan: the planner's layout and KV budget in the engine's own flags."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from lmserve.config import SchedulerConfig
from lmserve.config_values import MiB
from lmserve.kv_sizing import blocks_needed
from lmserve.plan.memory import LayoutOption, Plan
from lmserve.plan.model_spec import CONFIG_DIR, SHIPPED_CONFIGS

# The engine's --kv-cache-dtype choices (config.CacheConfig); a bfloat16 KV cache is the engine's 'auto' for it.
ENGINE_KV_DTYPES = ("float32", "float16", "int8")


def serve_model_name(model: str) -> str:
    """What `lmserve serve` can load for a planner's model name: a shipped config's name stands for its Hub repo
    (served from the local HF cache); paths, registered names and Hub ids stay as given."""
    from lmserve.models import REGISTERED_MODELS  # late: lmserve.models imports transformers

    shipped = SHIPPED_CONFIGS.get(model.lower())
    if shipped is None or model in REGISTERED_MODELS or Path(model).exists():
        return model
    source = json.loads((CONFIG_DIR / shipped).read_text()).get("_source", "")
    return source.split()[0] if source else model


def kv_cache_memory_for_target(plan: Plan) -> int:
    """Bytes per rank for the plan's target (concurrency × context per replica), on the stage with most layers:
    every rank gets the same --kv-cache-memory and the engine keeps the blocks of its smallest pool."""
    blocks = plan.concurrency * blocks_needed(plan.context, plan.block_size)
    return blocks * plan.block_size * max(d.kv_bytes_per_token for d in plan.devices)


def serve_command(model: str, plan: Plan, devices_per_node: int | None = None) -> str:
    """`lmserve serve MODEL -tp .. -pp .. -dp .. --dtype .. --max-model-len .. --kv-cache-memory ..`; Ray as the
    executor only when the planner knows the devices per node and the layout needs more than one node."""
    layout = plan.layout
    args = ["lmserve", "serve", serve_model_name(model)]
    for flag, size in (("-tp", layout.tp), ("-pp", layout.pp), ("-dp", layout.replicas)):
        if size > 1:
            args += [flag, str(size)]
    if devices_per_node is not None and layout.gpus > devices_per_node:
        args += ["--distributed-executor-backend", "ray"]
    # A GGUF's blocks run on CPU only with float32 compute, the engine's auto there (bfloat16 on CUDA): a planned
    # bfloat16 or float16 would dequantize every matrix.
    if plan.stored_bits is None or plan.dtype == "float32":
        args += ["--dtype", plan.dtype]
    if plan.kv_dtype != plan.dtype and plan.kv_dtype in ENGINE_KV_DTYPES:
        args += ["--kv-cache-dtype", plan.kv_dtype]
    args += ["--max-model-len", str(plan.max_model_len)]
    args += ["--kv-cache-memory", f"{-(-kv_cache_memory_for_target(plan) // MiB)}MiB"]
    if plan.token_budget != SchedulerConfig.max_num_batched_tokens:
        args += ["--max-num-batched-tokens", str(plan.token_budget)]
    if plan.max_num_seqs != SchedulerConfig.max_num_seqs:
        args += ["--max-num-seqs", str(plan.max_num_seqs)]
    return shlex.join(args)


def recommended_plan(plan: Plan, options: list[LayoutOption]) -> Plan:
    """The plan's own layout when it fits; else the compared layout lmserve can serve that fits with the most
    concurrent requests; else the plan's own (its shortage says why)."""
    if plan.fits:
        return plan
    # Prefill/decode separation is a comparison, not a layout `lmserve serve` runs.
    servable = [o for o in options if o.plan is not None and o.plan.fits and o.name != "prefill/decode split"]
    return max(servable, key=lambda o: o.max_concurrency).plan if servable else plan  # type: ignore[return-value]

