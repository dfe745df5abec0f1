"""vLLM's model-facing flags: --generation-config / --override-generation-config (the model's default sampling),
--tokenizer, --chat-template and the dtype aliases half / float."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from lmserve import LLM, SamplingParams
from lmserve.api.protocol import ChatCompletionRequest, CompletionRequest
from lmserve.cli import build_parser
from lmserve.config import engine_kwargs, make_engine_config
from lmserve.frontend.input_processor import InputProcessor
from lmserve.generation_config import default_sampling
from lmserve.models import resolve_model

PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def model_with_defaults(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Path:
    model = shutil.copytree(tiny_llama_dir, tmp_path_factory.mktemp("defaults") / "model")
    settings = json.loads((model / "generation_config.json").read_text())
    settings.update(temperature=0.0, top_p=0.9, max_new_tokens=3, do_sample=True)
    (model / "generation_config.json").write_text(json.dumps(settings))
    return model


def test_default_sampling_reads_vllms_keys(model_with_defaults: Path, tmp_path: Path) -> None:
    source = resolve_model(str(model_with_defaults))
    assert default_sampling(source) == {"temperature": 0.0, "top_p": 0.9, "max_tokens": 3}
    assert default_sampling(source, "vllm") == {}
    assert default_sampling(source, "vllm", {"temperature": 0.5}) == {"temperature": 0.5}
    merged = default_sampling(source, "auto", {"temperature": 0.5, "max_new_tokens": 7, "top_k": 4})
    assert merged == {"temperature": 0.5, "top_p": 0.9, "max_tokens": 7, "top_k": 4}
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": 9}))
    assert default_sampling(source, str(tmp_path)) == {"top_k": 9}
    with pytest.raises(ValueError, match="no generation_config.json"):
        default_sampling(source, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="not a sampling parameter"):
        default_sampling(source, "vllm", {"bogus": 1})
    with pytest.raises(ValueError, match="temperature"):
        default_sampling(source, "vllm", {"temperature": -1})


def test_offline_llm_uses_the_models_defaults_unless_told_vllm(model_with_defaults: Path) -> None:
    llm = LLM(model=str(model_with_defaults), dtype="float32", num_blocks=16)
    assert llm.get_default_sampling_params().max_tokens == 3
    (out,) = llm.generate(PROMPT)
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == greedy.outputs[0].token_ids[: len(out.outputs[0].token_ids)]
    assert len(out.outputs[0].token_ids) <= 3
    plain = LLM(model=str(model_with_defaults), dtype="float32", num_blocks=16, generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()


def test_requests_take_the_defaults_only_for_fields_they_leave_unset() -> None:
    defaults = {"temperature": 0.3, "top_k": 5, "max_tokens": 7}
    unset = CompletionRequest(prompt="hi").to_sampling_params(defaults)
    assert (unset.temperature, unset.top_k, unset.max_tokens) == (0.3, 5, None)  # max_tokens: the front-end's
    chosen = CompletionRequest(prompt="hi", temperature=1.0, max_tokens=16).to_sampling_params(defaults)
    assert (chosen.temperature, chosen.top_k, chosen.max_tokens) == (1.0, 5, 16)
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], max_completion_tokens=2)
    assert chat.to_sampling_params(defaults).max_tokens == 2
    assert CompletionRequest(prompt="hi").to_sampling_params({}).max_tokens == 16  # OpenAI's completions default


def test_a_default_max_tokens_is_capped_by_the_room_the_prompt_leaves(default_tokenizer) -> None:
    inputs = InputProcessor(default_tokenizer, max_model_len=32, vocab_size=50_000, default_max_tokens=20)
    assert inputs.check_length(4, SamplingParams(max_tokens=None)).max_tokens == 20
    assert inputs.check_length(20, SamplingParams(max_tokens=None)).max_tokens == 12


def test_tokenizer_and_chat_template_flags(tmp_path: Path, tiny_llama_dir: Path) -> None:
    # A model directory without tokenizer files runs with --tokenizer naming another.
    model = shutil.copytree(tiny_llama_dir, tmp_path / "bare",
                            ignore=shutil.ignore_patterns("tokenizer*", "special_tokens_map.json"))
    template = "{% for m in messages %}<<{{ m['role'] }}:{{ m['content'] }}>>{% endfor %}"
    llm = LLM(model=str(model), tokenizer=str(tiny_llama_dir), chat_template=template, dtype="float32",
              num_blocks=16)
    rendered = llm.input_processor.render_chat([{"role": "user", "content": "hey"}], True, {})
    assert llm.tokenizer.decode(rendered) == "<<user:hey>>"
    file = tmp_path / "template.jinja"
    file.write_text(template.replace("<<", "[["))
    llm = LLM(model=str(tiny_llama_dir), chat_template=str(file), dtype="float32", num_blocks=16)
    assert llm.tokenizer.decode(llm.input_processor.render_chat([{"role": "user", "content": "x"}], True, {})) \
        == "[[user:x>>"
    with pytest.raises(ValueError, match="no such file"):
        LLM(model=str(tiny_llama_dir), chat_template=str(tmp_path / "missing.jinja"), dtype="float32", num_blocks=16)


def test_vllm_flags_parse() -> None:
    args = build_parser().parse_args([
        "serve", "some-model", "--dtype", "half", "--tokenizer", "tok", "--chat-template", "t.jinja",
        "--generation-config", "vllm", "--override-generation-config", '{"temperature": 0.5}',
    ])
    config = make_engine_config(**engine_kwargs(args))
    assert config.model.dtype == "float16" and config.model.tokenizer == "tok"
    assert config.model.chat_template == "t.jinja" and config.model.generation_config == "vllm"
    assert config.model.override_generation_config == {"temperature": 0.5}
    assert make_engine_config(dtype="float").model.dtype == "float32"
    with pytest.raises(ValueError, match="JSON object"):
        make_engine_config(override_generation_config="[1]")
