"""The front-end's layout check: a split the engine cannot run, or ranks that do not fit, refused before any weight."""

from __future__ import annotations

import sys

import pytest

from lmserve.config import make_engine_config
from lmserve.models import DEFAULT_MODEL, load_hf_config, read_config_dict, resolve_model
from lmserve.plan import fit
from lmserve.plan.layout import check_layout, engine_model_spec
from lmserve.plan.memory import GiB
from lmserve.plan.model_spec import Layout, ModelSpec, stage_params


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"tensor_parallel_size": 2},
     "-tp 2 does not divide the 9 attention heads / 3 KV heads of smollm2-135m-instruct; sizes that do: 1, 3"),
    ({"tensor_parallel_size": 9}, ("-tp 9 does not divide the MLP intermediate size 1536 of smollm2-135m-instruct; "
                                  "sizes that do: 1, 3")),  # 9 ranks would be 3 per KV head, if the MLP split
    ({"tensor_parallel_size": 6}, "-tp 6 does not divide the 9 attention heads of smollm2-135m-instruct"),
    ({"pipeline_parallel_size": 31}, "-pp 31 is more stages than the 30 layers of smollm2-135m-instruct"),
])  # fmt: skip
def test_a_split_the_model_does_not_allow_is_refused_with_its_reason(kwargs, message):
    with pytest.raises(ValueError) as caught:
        check_layout(make_engine_config(**kwargs))
    assert message in str(caught.value)


def test_an_hf_directory_is_read_from_its_config(tiny_llama_dir):
    with pytest.raises(ValueError, match="-tp 3 does not divide the 4 attention heads / 2 KV heads .*; sizes that do: "
                                         "1, 2, 4$"):
        check_layout(make_engine_config(str(tiny_llama_dir), tensor_parallel_size=3))
    check_layout(make_engine_config(str(tiny_llama_dir), tensor_parallel_size=4))  # each KV head on two ranks


def test_tp_zero_is_refused_by_the_config():
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1, got 0"):
        make_engine_config(tensor_parallel_size=0)


@pytest.mark.parametrize("model", [DEFAULT_MODEL, "tiny_qwen3_gguf", "tiny_qwen2_dir"])
def test_the_check_reads_the_sizes_the_engine_loads_without_torch(model, request):
    """read_config_dict (no torch) and load_hf_config (transformers' config, which imports torch) agree."""
    if model != DEFAULT_MODEL:
        model = str(request.getfixturevalue(model))
    source = resolve_model(model)
    assert ModelSpec.from_hf_dict("m", read_config_dict(source)) == ModelSpec.from_hf_dict(
        "m", load_hf_config(source).to_dict()
    )


def test_the_layout_check_imports_no_torch():
    import subprocess

    code = ("import sys; from lmserve.config import make_engine_config; from lmserve.plan.layout import check_layout;"
            " check_layout(make_engine_config(kv_cache_memory='256MiB')); assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, env=_env())


def test_llm_refuses_a_bad_layout_before_loading_anything(monkeypatch):
    import lmserve.frontend.llm as llm_module

    def must_not_run(*_args, **_kwargs):
        raise AssertionError("loaded before the layout was checked")

    monkeypatch.setattr(llm_module, "EngineCore", must_not_run)
    monkeypatch.setattr(llm_module, "load_frontend_tokenizer", must_not_run)
    for kwargs, message in (
        ({"tensor_parallel_size": 2}, "-tp 2 does not divide"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be an integer >= 1"),
        ({"pipeline_parallel_size": 31}, "-pp 31 is more stages than the 30 layers"),
        ({"kv_cache_memory": "100000GiB", "device": "cpu"}, "of memory, this machine has"),
    ):
        with pytest.raises(ValueError, match=message):
            llm_module.LLM(**kwargs)


# ---------------------------------------------------------------------------------------------------- fitting


def test_an_absurd_kv_cache_is_refused_with_the_planners_numbers():
    config = make_engine_config(kv_cache_memory="100000GiB", device="cpu")
    spec = engine_model_spec(config.model)
    need = fit.layout_memory(spec, config)
    rank = need.ranks[0]
    assert rank.kv_cache == 100000 * GiB
    # The default model's Q4_1 file at its stored size (4.5 bits a weight in the matrices), not float32, and the
    # 2-byte prompt copy of its layers that the AVX2 and AMX kinds build for a model this small.
    assert spec.stored_bits is not None and 4.5 < spec.stored_bits < 6
    copy = 2 * stage_params(spec, Layout(), 0)["layers"]
    assert rank.weights == int(spec.num_params * spec.stored_bits / 8) + copy < spec.num_params * 4
    with pytest.raises(ValueError) as caught:
        fit.check_fits(spec, config, available=20 * GiB)
    message = str(caught.value)
    assert f"needs {need.total / GiB:.2f} GiB of memory, this machine has 20.00 GiB available" in message
    assert f"{rank.weights / GiB:.2f} GiB weights (as the file stores them)" in message
    assert "100000.00 GiB KV cache" in message
    kv_that_fits = (20 * GiB - (need.total - rank.kv_cache)) // (1 << 20)
    assert f"lower --kv-cache-memory to at most {kv_that_fits}MiB per rank" in message
    assert "fewer ranks" not in message  # one rank: there are no fewer


def test_too_many_ranks_even_without_kv_cache_says_use_fewer_ranks():
    config = make_engine_config(tensor_parallel_size=3, pipeline_parallel_size=2, data_parallel_size=2, device="cpu")
    with pytest.raises(ValueError, match="× 12 rank.*use fewer ranks"):
        fit.check_fits(engine_model_spec(config.model), config, available=2 * GiB)


def test_the_default_configuration_fits_this_machine():
    config = make_engine_config(device="cpu")
    need = fit.check_fits(engine_model_spec(config.model), config)
    assert need is not None and need.ranks[0].kv_cache == 2 * GiB  # the engine's default budget


@pytest.mark.parametrize("kwargs", [
    {"tensor_parallel_size": 3}, {"pipeline_parallel_size": 2}, {"data_parallel_size": 2},
    {"tensor_parallel_size": 3, "pipeline_parallel_size": 2, "data_parallel_size": 2},
])  # fmt: skip
def test_small_layouts_of_the_default_model_fit_a_24_gib_machine(kwargs):
    config = make_engine_config(kv_cache_memory="256MiB", device="cpu", **kwargs)
    spec = engine_model_spec(config.model)
    need = fit.check_fits(spec, config, available=16 * GiB)  # less than 24 GiB: other processes run too
    assert need is not None and need.num_ranks == config.parallel.world_size * config.parallel.data_parallel_size
    # Weights split tp × pp ways: the ranks of one replica hold the whole model once, plus replicated norms and,
    # under PP, the last stage's copy of the tied embedding as its output layer.
    replica_weights = sum(r.weights for r in need.ranks) * config.parallel.tensor_parallel_size
    head_copy = spec.weight_bytes(spec.vocab_size * spec.hidden_size, 4) if config.parallel.pipeline_parallel_size > 1 \
        else 0
    # At the file's stored size, with the layers' 2-byte prompt copy (bytes rounded down once per rank).
    whole = spec.weight_bytes(spec.num_params, 4) + 2 * stage_params(spec, Layout(), 0)["layers"]
    assert whole - need.num_ranks <= replica_weights - head_copy < whole * 1.01


def test_cuda_and_ray_are_not_checked_against_this_machines_memory():
    spec = engine_model_spec(make_engine_config().model)
    for kwargs in ({"device": "cuda"}, {"device": "cpu", "distributed_executor_backend": "ray"}):
        assert fit.check_fits(spec, make_engine_config(kv_cache_memory="100000GiB", **kwargs), available=GiB) is None


def test_data_parallel_replicas_are_bounded_by_this_machine_whatever_runs_their_ranks():
    """Each -dp replica is an engine process here even when its ranks are on CUDA or Ray: -dp 100000 is refused
    before a single process starts."""
    spec = engine_model_spec(make_engine_config().model)
    for kwargs in ({"device": "cuda"}, {"device": "cpu", "distributed_executor_backend": "ray"}):
        with pytest.raises(ValueError, match="-dp 100000 starts 100000 engine processes here"):
            fit.check_fits(spec, make_engine_config(data_parallel_size=100000, **kwargs), available=24 * GiB)
        assert fit.check_fits(spec, make_engine_config(data_parallel_size=2, **kwargs), available=24 * GiB) is None


def test_the_fit_check_uses_the_engines_defaults():
    from lmserve.worker import memory, model_runner

    assert fit.DEFAULT_KV_CACHE_MEMORY == memory.DEFAULT_KV_CACHE_MEMORY
    assert fit.DEFAULT_CPU_DTYPE == model_runner.DEFAULT_CPU_DTYPE


def _env() -> dict[str, str]:
    """This checkout's lmserve for child processes, whatever the installed one is."""
    import os
    from pathlib import Path

    import lmserve

    return {**os.environ, "PYTHONPATH": str(Path(lmserve.__file__).parents[1])}


def test_a_gguf_is_checked_at_its_stored_size_unless_asked_to_dequantize(tiny_kquant_gguf):
    """Serve's check counted a GGUF's weights as float32 (an 8B Q4_K_M file as 32 GB): under auto the engine holds
    the file's blocks, as `lmserve plan` counts them; --quantization none dequantizes them to float32."""
    config = make_engine_config(model=str(tiny_kquant_gguf), device="cpu")
    spec = engine_model_spec(config.model)
    assert spec.stored_bits is not None and spec.stored_bits < 9
    from lmserve.plan.model_spec import load_spec

    assert spec.stored_bits == load_spec(str(tiny_kquant_gguf)).stored_bits
    assert fit.layout_memory(spec, config).ranks[0].weights < spec.num_params * 4 / 2
    dequantized = make_engine_config(model=str(tiny_kquant_gguf), device="cpu", quantization="none")
    assert engine_model_spec(dequantized.model).stored_bits is None
    in_bfloat16 = make_engine_config(model=str(tiny_kquant_gguf), device="cpu", dtype="bfloat16")  # dequantized too
    assert engine_model_spec(in_bfloat16.model).stored_bits is None
    assert fit.layout_memory(engine_model_spec(dequantized.model), dequantized).ranks[0].weights == \
        spec.num_params * 4


@pytest.mark.parametrize("fixture", ["tiny_kquant_gguf", "tiny_gemma3_dir", "tiny_phi3_q8_gguf"])
def test_the_planner_and_the_engine_count_the_same_decoder_weights(request, fixture):
    """Serve's check counts a prompt copy only below the line where the engine takes 8-bit activations: both must
    count a model's decoder weights alike (plan.ModelSpec and worker.models.llama, each from its own config reader)."""
    from lmserve.worker.models.llama import decoder_linear_weights

    model = str(request.getfixturevalue(fixture))
    config = make_engine_config(model=model, device="cpu")
    assert engine_model_spec(config.model).decoder_linear_weights == decoder_linear_weights(load_hf_config(
        resolve_model(model)))


def test_a_kquant_slice_that_is_no_whole_blocks_is_counted_as_float16_under_tp(tiny_kquant_gguf) -> None:
    """Under -tp 2 a row-parallel K-quant matrix whose slice of columns is no multiple of 256 loads as float16
    (the tiny file's o_proj: 256 columns, 128 a rank), and the plan counted it at its stored size: the check and
    `lmserve plan` now count 2 bytes a weight for it, and only under the -tp that splits it so."""
    import math

    from lmserve.formats.block_formats import held_bytes_per_weight
    from lmserve.formats.gguf_file import ggml_type_name, gguf_held_bits, read_gguf_header, shard_fits_blocks

    assert not shard_fits_blocks("q4_k", 256, 2) and shard_fits_blocks("q4_k", 512, 2)
    assert shard_fits_blocks("q4_k", 4864, 1) and not shard_fits_blocks("q4_k", 4864, 2)  # Qwen2.5 0.5B's down_proj
    assert shard_fits_blocks("q8_0", 4864, 2)  # 2432 columns: whole blocks of 32
    tensors = read_gguf_header(tiny_kquant_gguf).tensors
    elements = sum(math.prod(t.shape) for t in tensors)
    o_proj = [t for t in tensors if t.name.endswith("attn_output.weight")]
    widened = sum(math.prod(t.shape) * (2 - held_bytes_per_weight(ggml_type_name(t.ggml_type).lower()))
                  for t in o_proj)
    assert len(o_proj) == 2 and widened > 0
    one, two = gguf_held_bits(tiny_kquant_gguf, 1), gguf_held_bits(tiny_kquant_gguf, 2)
    assert two - one == pytest.approx(8 * widened / elements)
    config = make_engine_config(model=str(tiny_kquant_gguf), device="cpu", tensor_parallel_size=2)
    spec = engine_model_spec(config.model)
    assert spec.weight_bytes(spec.num_params, 4, tp=1) == int(spec.num_params * one / 8)
    assert spec.weight_bytes(spec.num_params, 4, tp=2) == int(spec.num_params * two / 8)
