"""lmserve plan for hybrid linear-attention models (Qwen3.5, Qwen3-Next): the parameters the config implies are the
checkpoint's, KV is counted for the full-attention layers only, and each request's linear-attention state (constant
in its length) is counted beside its KV, in the engine's bytes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import transformers
from hybrid_models import HYBRID_FAMILIES

from lmserve.plan.memory import GiB, PlanSettings, make_plan
from lmserve.plan.model_spec import Layout, check_layout, load_spec

# worker/models/gated_deltanet.py's LinearStates for the tiny models: 3 linear layers, each a conv state of 96
# channels x 3 inputs and 4 value heads' 16 x 8 recurrent state, float32.
TINY_STATE_BYTES = 3 * 4 * (96 * 3 + 4 * 16 * 8)


@pytest.mark.parametrize("family", list(HYBRID_FAMILIES))
def test_parameter_count_and_state_bytes_of_the_tiny_checkpoints(hybrid_dirs, family: str) -> None:
    from safetensors import safe_open

    directory: Path = hybrid_dirs[family]
    stored = 0
    with safe_open(directory / "model.safetensors", framework="numpy") as f:
        names = f.keys()
        stored = sum(math.prod(f.get_slice(name).get_shape()) for name in names)
    spec = load_spec(str(directory))
    assert spec.num_params == stored
    assert spec.linear_state_bytes == TINY_STATE_BYTES and spec.kv_layers == 1


def qwen3_5_config(path: Path, all_attention: bool = False) -> Path:
    """transformers' default Qwen3.5 text config (a 9B-class shape: 32 layers, 8 of them full attention), or the same
    model with every layer full attention (the pure-attention model of the same size)."""
    config = transformers.Qwen3_5TextConfig().to_dict()
    if all_attention:
        config["layer_types"] = ["full_attention"] * config["num_hidden_layers"]
    path.write_text(json.dumps(config))
    return path


def test_kv_for_full_attention_layers_only_and_a_constant_state_per_request(tmp_path) -> None:
    hybrid = load_spec(config_file=str(qwen3_5_config(tmp_path / "qwen3_5.json")))
    dense = load_spec(config_file=str(qwen3_5_config(tmp_path / "qwen3_5_all_attention.json", all_attention=True)))
    assert hybrid.kv_layers == 8 and dense.kv_layers == 32
    # 24 linear layers: conv over 2 x 16 x 128 + 32 x 128 channels (3 inputs), 32 heads of 128 x 128, float32.
    assert hybrid.linear_state_bytes == 24 * 4 * (8192 * 3 + 32 * 128 * 128)
    fits = {}
    for context in (4096, 32768):
        settings = PlanSettings(device_memory=64 * GiB, context=context, dtype="bfloat16")
        plan, twin = make_plan(hybrid, settings), make_plan(dense, settings)
        assert plan.kv_bytes_per_token * 4 == twin.kv_bytes_per_token
        per_request = context * plan.kv_bytes_per_token + hybrid.linear_state_bytes
        assert plan.max_concurrency == plan.devices[0].kv_bytes // per_request
        assert any("MiB of state per request whatever its length" in note for note in plan.notes)
        fits[context] = (plan.max_concurrency, twin.max_concurrency)
    print(f"\nrequests that fit in 64 GiB (hybrid, all attention): 4k {fits[4096]}, 32k {fits[32768]}")
    assert fits[4096][0] > fits[4096][1] and fits[32768][0] > 3 * fits[32768][1]


def test_a_hybrid_model_is_planned_on_one_rank(hybrid_dirs) -> None:
    spec = load_spec(str(hybrid_dirs["qwen3_next"]))
    check_layout(spec, Layout(tp=1, pp=1, replicas=2))
    with pytest.raises(ValueError, match="hybrid linear-attention model .*one rank"):
        check_layout(spec, Layout(tp=2))
