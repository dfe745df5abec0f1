"""lmserve plan: KV and weight sizes from configs, fit verdicts, layouts, and the engine sharing the KV formula."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from lmserve.cli import main
from lmserve.plan import memory, model_spec
from lmserve.plan.memory import GiB, PlanSettings, make_plan
from lmserve.plan.model_spec import Layout, load_spec, stage_params


def run_plan(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict]:
    code = main(["plan", *args, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_kv_bytes_per_token_smollm2(capsys):
    code, out = run_plan(capsys, "--model", "smollm2-135m", "--dtype", "bfloat16", "--device-memory", "16")
    assert out["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 2 == 23_040
    assert out["devices"][0]["kv_bytes_per_token"] == 23_040
    assert code == 0 and out["fits"]


def test_kv_bytes_per_token_llama3_8b(capsys):
    code, out = run_plan(capsys, "--model", "llama-3-8b", "--dtype", "bfloat16", "--device-memory", "80")
    assert out["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * 2 == 131_072
    assert code == 0


def test_llama3_8b_weights_match_its_parameter_count(capsys):
    _, out = run_plan(capsys, "--model", "llama-3-8b", "--device-memory", "80")
    assert out["weight_bytes"] == pytest.approx(8.03e9 * 2, rel=0.01)
    assert out["devices"][0]["weights"] == out["weight_bytes"]


@pytest.mark.parametrize(("name", "params"), [
    ("llama-3-8b", 8.03e9), ("llama-3-70b", 70.55e9), ("qwen2.5-7b", 7.62e9), ("mistral-7b", 7.25e9),
    ("smollm2-135m", 134.5e6), ("meta-llama/Meta-Llama-3-8B", 8.03e9),
])  # fmt: skip
def test_shipped_configs_give_published_parameter_counts(name, params):
    assert load_spec(name).num_params == pytest.approx(params, rel=0.01)


@pytest.mark.parametrize(
    "fixture", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir", "tiny_gemma2_dir", "tiny_gemma3_dir",
                "tiny_phi3_dir"],
)  # fmt: skip
def test_parameter_count_equals_the_saved_checkpoint(fixture, request):
    """Untied Llama, Qwen2 with q/k/v biases and tied embeddings, Qwen3's and Gemma 3's q/k norms, Gemma's four
    norms a layer, Phi-3's fused matrices: the config implies exactly what is stored."""
    from safetensors import safe_open

    directory: Path = request.getfixturevalue(fixture)
    stored = 0
    for file in directory.glob("*.safetensors"):
        with safe_open(file, framework="numpy") as f:
            names = f.keys()  # safe_open handles are not iterable
            stored += sum(math.prod(f.get_slice(name).get_shape()) for name in names)
    assert load_spec(str(directory)).num_params == stored


def test_llama3_70b_on_one_80gib_device_does_not_fit_weights_short(capsys):
    code, out = run_plan(capsys, "--model", "llama-3-70b", "--device-memory", "80")
    assert code != 0 and not out["fits"]
    shortage = out["shortage"]
    assert shortage["resource"] == "weights"
    # The full target is short by more than the weights' own overflow (~51 GiB).
    assert shortage["short_by"] > out["weight_bytes"] - 80 * GiB > 50 * GiB
    assert main(["plan", "--model", "llama-3-70b", "--device-memory", "80"]) != 0
    text = capsys.readouterr().out
    assert "DOES NOT FIT" in text and "short resource: weights" in text


def test_llama3_70b_on_8_devices_with_tp8_fits_per_device(capsys):
    code, out = run_plan(capsys, "--model", "llama-3-70b", "--device-memory", "80", "--gpus", "8", "--tp", "8")
    assert code == 0 and out["fits"] and out["shortage"] is None
    assert out["layout"] == {"tp": 8, "pp": 1, "replicas": 1, "gpus": 8}
    device = out["devices"][0]
    # Per device: an eighth of the weights (norms are replicated, hence approx) and of the KV heads.
    assert device["weights"] == pytest.approx(out["weight_bytes"] / 8, rel=0.001)
    assert device["kv_bytes_per_token"] == 2 * 80 * 1 * 128 * 2 == out["kv_bytes_per_token"] // 8
    assert device["kv_tokens"] >= 8192 and out["max_concurrency"] >= 1
    compared = {o["name"]: o for o in out["compared"]}
    assert not compared["replicas"]["fits"] and compared["replicas"]["shortage"]["resource"] == "weights"
    assert compared["tensor parallel"]["fits"] and compared["tensor parallel"]["comm_bytes_per_token"] > 0
    assert compared["pipeline parallel"]["fits"]
    assert {"TP×PP", "prefill/decode split"} <= compared.keys()
    assert main(["plan", "--model", "llama-3-70b", "--device-memory", "80", "--gpus", "8", "--tp", "8"]) == 0
    text = capsys.readouterr().out
    assert "fits                 yes" in text and "8 devices compared" in text


def test_tp_and_pp_split_weights_and_kv():
    spec = load_spec("llama-3-8b")
    layout = Layout(tp=2, pp=2)
    per_device = [sum(stage_params(spec, layout, s).values()) for s in range(2)]
    # Every parameter is held by exactly one of the 2×2 devices, except the replicated norms.
    norms = (2 * spec.num_layers + 1) * spec.hidden_size
    assert sum(per_device) * 2 == spec.num_params + norms
    plan = make_plan(spec, PlanSettings(layout=layout, device_memory=40 * GiB))
    assert [d.kv_bytes_per_token for d in plan.devices] == [131_072 // 4] * 2
    assert plan.devices[1].logits > 0 and plan.devices[0].logits == 0  # the head lives on the last stage


def test_kv_cache_shortage_names_kv_and_reports_reachable_concurrency(capsys):
    code, out = run_plan(capsys, "--model", "llama-3-8b", "--device-memory", "24", "--concurrency", "64")
    assert code != 0 and out["shortage"]["resource"] == "KV cache"
    assert 0 < out["max_concurrency"] < 64
    kv_needed = 64 * 8192 * 131_072
    assert out["shortage"]["short_by"] == kv_needed - out["devices"][0]["kv_bytes"]


def test_concurrency_and_context_trade_off():
    spec = load_spec("smollm2-135m")
    plan = make_plan(spec, PlanSettings(device_memory=4 * GiB, context=1024, concurrency=8))
    d = plan.devices[0]
    assert d.kv_blocks == d.kv_bytes // (16 * 23_040)
    assert plan.max_concurrency == d.kv_blocks // 64
    assert plan.max_context == min(8192, d.kv_blocks // 8 * 16)


def test_an_int8_kv_cache_counts_its_values_and_scales(capsys):
    """34 bytes per 32 values (llama.cpp's q8_0): 68 per kv head's row of 64 where float16 takes 128; the planned
    serve command carries --kv-cache-dtype int8."""
    code, out = run_plan(capsys, "--model", "smollm2-135m", "--dtype", "float32", "--kv-dtype", "int8",
                         "--device-memory", "16")
    assert out["kv_bytes_per_token"] == 2 * 30 * 3 * 68 == 12_240
    assert out["devices"][0]["kv_bytes_per_token"] == 12_240 and code == 0
    assert "--kv-cache-dtype int8" in out["serve_command"]
    _, wider = run_plan(capsys, "--model", "smollm2-135m", "--dtype", "float32", "--kv-dtype", "float16",
                        "--device-memory", "16")
    assert out["max_context"] >= wider["max_context"] and out["devices"][0]["kv_blocks"] > 1.8 * wider["devices"][0][
        "kv_blocks"]


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "float32", "int8"])
def test_engine_sizes_its_kv_cache_with_the_planner_formula(kv_cache_dtype: str):
    """The planner's bytes per block are what the engine's KV tensors hold for one block, and what it divides its
    memory by: its plan for the default model is the engine's allocation."""
    from lmserve.config import CacheConfig, ModelConfig
    from lmserve.worker.model_runner import ModelRunner

    assert memory.kv_bytes_per_block(30, 3, 64, 16, 2) == 16 * 23_040
    runner = ModelRunner(ModelConfig(), CacheConfig(num_blocks=8, kv_cache_dtype=kv_cache_dtype))
    itemsize = {"float16": 2, "float32": 4, "int8": "int8"}[kv_cache_dtype]
    allocated = sum(t[0].nbytes for layer in runner.kv_caches for t in layer)  # block 0 of every K and V tensor
    assert runner.kv_bytes_per_block == memory.kv_bytes_per_block(30, 3, 64, 16, itemsize) == allocated
    assert runner.num_blocks == 8


def test_configs_ship_as_package_data():
    for file in model_spec.SHIPPED_CONFIGS.values():
        assert (model_spec.CONFIG_DIR / file).is_file()
    pyproject = Path(__file__).parents[2] / "pyproject.toml"
    assert '"plan/configs/*.json"' in pyproject.read_text()


@pytest.mark.parametrize(("args", "message"), [
    (["--model", "no-such-model"], "unknown model 'no-such-model'"),
    (["--model", "llama-3-8b", "--tp", "3", "--gpus", "3"], "does not divide"),
    (["--model", "llama-3-8b", "--tp", "2", "--gpus", "1"], "needs more than --gpus 1"),
    (["--model", "llama-3-8b", "--context", "100000"], "exceeds max_model_len"),
    (["--config", "/no/such/config.json"], "no such config file"),
    (["--max-model-len", "0"], "max_model_len must be >= 1 (leave it out for the model's own), got 0"),
    (["--context", "0"], "context must be >= 1"),
    (["llama-3-8b", "--model", "qwen2.5-7b"], "two models: llama-3-8b and --model qwen2.5-7b"),
])  # fmt: skip
def test_bad_input_is_a_clear_error(capsys, args, message):
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lmserve: error:") and message in err


def test_the_model_is_the_first_argument_as_serve_takes_it(capsys):
    """`lmserve plan MODEL`, as `lmserve serve MODEL` (it was "unrecognized arguments"); --model says the same."""
    outputs = []
    for args in (["llama-3-8b"], ["--model", "llama-3-8b"], ["llama-3-8b", "--model", "llama-3-8b"]):
        main(["plan", *args, "--json", "--device-memory", "80"])
        outputs.append(json.loads(capsys.readouterr().out))
    assert outputs[0]["model"] == "llama-3-8b" and outputs[0]["num_params"] == 8_030_261_248
    assert outputs[0] == outputs[1] == outputs[2]


def test_a_gguf_is_planned_at_its_stored_size_with_the_prompt_copy(tiny_kquant_gguf, mixed_gguf):
    """Issue 34: a quantized file's weights are what it stores (here ~4.6-6.6 bits a parameter in the matrices, float32
    norms), not bfloat16; serve's own check adds the 2-byte prompt copy of the layers unless --batched-weights none."""
    import gguf
    import numpy as np

    from lmserve.config import EngineConfig, ModelConfig
    from lmserve.formats.gguf_file import read_gguf_header
    from lmserve.plan.fit import layout_memory

    # Bytes a weight as the engine holds each matrix (tests/worker/test_stored_formats.py and test_kquant_formats.py
    # check the layers): K-quants (Q2_K and Q3_K too), Q4_0, Q5_0 and Q8_0 as stored; fused layers: tiny_kquant's
    # layer 1 q/k/v (Q2_K, Q3_K, Q5_K) and gate/up (Q5_K, Q2_K) each part in its own format, mixed's gate and up
    # (Q5_0, Q4_0) and q/k/v (Q5_0, Q5_0, Q8_0) all q8_0. Both tied embeddings (Q6_K, Q5_0) keep their blocks, which
    # their output layers share; vectors are float32.
    held = {"Q2_K": 84 / 256, "Q3_K": 110 / 256, "Q4_K": 144 / 256, "Q5_K": 176 / 256, "Q6_K": 210 / 256,
            "Q5_0": 22 / 32, "Q8_0": 34 / 32, "Q4_0": 18 / 32, "F32": 4.0}

    def rate(path, t) -> float:
        if path == mixed_gguf and any(f".{part}." in t.name for part in ("attn_q", "attn_k", "attn_v", "ffn_gate",
                                                                          "ffn_up")):
            return 34 / 32
        return held[gguf.GGMLQuantizationType(t.ggml_type).name]

    for path in (tiny_kquant_gguf, mixed_gguf):
        spec = load_spec(str(path))
        tensors = read_gguf_header(path).tensors
        expected = sum(int(np.prod(t.shape)) * rate(path, t) for t in tensors)
        assert spec.stored_bits is not None and 4 < spec.stored_bits < 9
        plan = make_plan(spec, PlanSettings(device_memory=8 * GiB))
        # The planner's parameters are the file's (the tied output layer once): its weights what the engine holds.
        assert plan.weight_bytes == pytest.approx(expected, rel=0.01)
        assert plan.weight_bytes < spec.num_params * 2 / 1.7  # not bfloat16's
        assert any("stored size" in note for note in plan.notes)
        layers = stage_params(spec, Layout(), 0)["layers"]
        with_copy = layout_memory(spec, EngineConfig(model=ModelConfig(model=str(path)))).ranks[0].weights
        without = layout_memory(spec, EngineConfig(model=ModelConfig(model=str(path), batched_weights="none")))
        assert with_copy - without.ranks[0].weights == 2 * layers
        assert without.ranks[0].weights == plan.devices[0].weights


def test_sliding_window_layers_are_planned_at_their_window(tiny_gemma3_dir):
    """Gemma 3's local layers hold a window and a chunk, not the context: the plan counts the engine's blocks (one
    layer each here: 1 global + 5 local layers) and so fits more requests than the same model without windows."""
    from dataclasses import replace

    spec = load_spec(str(tiny_gemma3_dir))
    assert spec.sliding_window == 8 and spec.layer_types.count("sliding_attention") == 5
    settings = PlanSettings(device_memory=1 * GiB, overhead=0, context=512, max_num_batched_tokens=64)
    windowed, full = make_plan(spec, settings), make_plan(replace(spec, sliding_window=None), settings)
    one_layer = windowed.devices[0].kv_bytes_per_token
    assert full.devices[0].kv_bytes_per_token == 6 * one_layer  # a block of every layer against one of one
    # A 512-token request: 32 blocks of the global layer + 5 × (8 + 64 positions: 6 blocks) against 32 of all six.
    assert windowed.max_concurrency == windowed.devices[0].kv_blocks // (32 + 5 * 6)
    assert full.max_concurrency == full.devices[0].kv_blocks // 32
    assert windowed.max_concurrency > 2 * full.max_concurrency
    assert any("sliding-window layers" in note for note in windowed.notes)


def test_serves_check_counts_no_prompt_copy_where_the_model_takes_8_bit_activations():
    """A Q4_K_M file of an 8B model takes 8-bit activations under auto and no prompt copy on any CPU kind; serve's
    memory check counted a 2-byte copy of its 7 B decoder weights anyway, and refused it on a 16 GiB machine (with
    the default 2 GiB of KV cache)."""
    from dataclasses import replace

    from lmserve.config import INT8_ACTIVATIONS_FROM_WEIGHTS, EngineConfig, ModelConfig
    from lmserve.plan.fit import check_fits, layout_memory

    spec = replace(load_spec("llama-3-8b"), stored_bits=4.89)  # as a Q4_K_M file of it holds its weights
    # 32 layers x (4096 x (2 x 4096 + 2 x 1024) + 3 x 4096 x 14336), as the worker counts from the same config.
    assert spec.decoder_linear_weights == 6_979_321_856 >= INT8_ACTIVATIONS_FROM_WEIGHTS

    def config(**settings) -> EngineConfig:
        return EngineConfig(model=ModelConfig(model="llama-3-8b", **settings))

    def weights(**settings) -> int:
        return layout_memory(spec, config(**settings)).ranks[0].weights

    stored = weights(batched_weights="none")
    assert weights() == weights(block_activations="int8") == weights(batched_weights="prompt-int8") == stored
    copy = 2 * stage_params(spec, Layout(), 0)["layers"]
    assert weights(block_activations="int16") == weights(batched_weights="prompt-fp16") == stored + copy
    assert check_fits(spec, config(), available=16 * GiB) is not None
    with pytest.raises(ValueError, match="needs"):
        check_fits(spec, config(block_activations="int16"), available=16 * GiB)
