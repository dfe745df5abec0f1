"""`lmserve plan` prints the `lmserve serve` command of its layout, in flags lmserve's own parser reads back."""

from __future__ import annotations

import json
import shlex

import pytest

from lmserve.cli import build_parser, main
from lmserve.config import EngineConfig, engine_kwargs, make_engine_config
from lmserve.plan import fit
from lmserve.plan.layout import engine_model_spec


def plan_json(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict]:
    code = main(["plan", *args, "--json"])
    return code, json.loads(capsys.readouterr().out)


def parsed_serve_command(command: str) -> EngineConfig:
    argv = shlex.split(command)
    assert argv[:2] == ["lmserve", "serve"]
    return make_engine_config(**engine_kwargs(build_parser().parse_args(argv[1:])))


@pytest.mark.parametrize("args", [
    [],
    ["-tp", "3", "--dtype", "float32", "--max-model-len", "4096"],
    ["--tp", "3", "--pp", "2", "--replicas", "2", "--concurrency", "4", "--max-num-seqs", "32"],
    ["--model", "llama-3-70b", "--device-memory", "80", "--gpus", "16", "--tp", "8", "--pp", "2"],
])  # fmt: skip
def test_the_serve_command_parses_into_the_planned_layout(capsys, args):
    code, out = plan_json(capsys, *args)
    assert code == 0
    config = parsed_serve_command(out["serve_command"])
    layout = out["layout"]
    assert (config.parallel.tensor_parallel_size, config.parallel.pipeline_parallel_size,
            config.parallel.data_parallel_size) == (layout["tp"], layout["pp"], layout["replicas"])
    assert out["serve_layout"] == {k: layout[k] for k in ("tp", "pp", "replicas")}
    # A GGUF keeps the engine's auto dtype unless float32 was planned: --dtype bfloat16 would dequantize its blocks
    # on CPU (the default model is planned from its shipped config, as a float model).
    expected_dtype = "auto" if out["stored_bits"] and out["dtype"] != "float32" else out["dtype"]
    assert config.model.max_model_len == out["max_model_len"] and config.model.dtype == expected_dtype
    assert config.scheduler.max_num_seqs == out["max_num_seqs"]
    # The KV budget per rank holds the plan's target on every stage.
    blocks = out["concurrency"] * -(-out["context"] // 16)
    assert config.cache.kv_cache_memory >= max(blocks * 16 * d["kv_bytes_per_token"] for d in out["devices"])
    assert config.parallel.distributed_executor_backend is None  # the planner was not told the nodes


def test_the_default_plan_serves_the_default_model_and_serve_accepts_it(capsys):
    _, out = plan_json(capsys, "--dtype", "float32")
    assert out["serve_command"].startswith("lmserve serve smollm2-135m-instruct --dtype float32 --max-model-len 8192")
    config = parsed_serve_command(out["serve_command"])
    config.model.device = "cpu"
    assert fit.check_fits(engine_model_spec(config.model), config) is not None


def test_ray_only_when_the_layout_needs_more_than_one_node(capsys):
    base = ["--model", "llama-3-70b", "--device-memory", "80", "--tp", "8", "--pp", "2"]
    _, out = plan_json(capsys, *base, "--devices-per-node", "8")
    assert "-tp 8 -pp 2 --distributed-executor-backend ray" in out["serve_command"]
    assert parsed_serve_command(out["serve_command"]).parallel.executor_backend == "ray"
    _, out = plan_json(capsys, *base, "--devices-per-node", "16")
    assert "--distributed-executor-backend" not in out["serve_command"]


def test_a_layout_that_does_not_fit_is_replaced_by_one_that_does(capsys):
    code, out = plan_json(capsys, "--model", "llama-3-70b", "--device-memory", "80", "--gpus", "8")
    assert code != 0 and out["layout"]["replicas"] == 8  # eight whole copies do not fit 80 GiB each
    assert out["serve_layout"] == {"tp": 8, "pp": 1, "replicas": 1}
    assert out["serve_command"].startswith("lmserve serve meta-llama/Meta-Llama-3-70B -tp 8 ")
    assert main(["plan", "--model", "llama-3-70b", "--device-memory", "80", "--gpus", "8"]) != 0
    assert "serve (instead: TP8×PP1×1, which fits):" in capsys.readouterr().out


def test_a_split_the_engine_refuses_is_refused_by_the_planner_too(capsys):
    assert main(["plan", "-tp", "2"]) == 2
    assert "-tp 2 does not divide the 9 attention heads / 3 KV heads" in capsys.readouterr().err


def test_a_gguf_plans_a_serve_command_that_keeps_its_blocks(capsys, tiny_kquant_gguf):
    """`lmserve plan FILE.gguf` planned bfloat16 and printed `--dtype bfloat16`, with which the engine on CPU
    dequantizes every matrix instead of running the file's blocks (check_quantization: float32 only)."""
    from lmserve.worker.weights.kernel_choice import check_quantization

    _, out = plan_json(capsys, str(tiny_kquant_gguf))  # the plan's dtype is bfloat16 by default
    assert out["stored_bits"] is not None and out["dtype"] == "bfloat16"
    assert "--dtype" not in out["serve_command"]
    config = parsed_serve_command(out["serve_command"])
    import torch

    from lmserve.worker.model_runner import resolve_dtype

    dtype = resolve_dtype(config.model.dtype, torch.device("cpu"))
    assert check_quantization(config.model.quantization, torch.device("cpu"), dtype, "q4_k") == "q4_k"
    assert check_quantization(None, torch.device("cpu"), torch.bfloat16, "q4_k") == "none"  # what bfloat16 did
