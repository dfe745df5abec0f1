"""What travels with each request: all of the model's EOS ids, and a child's parent id and index."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from test_scheduler import FakeRunner, make_scheduler, step

from lmserve import LLM, SamplingParams
from lmserve.engine.request import Request


def test_any_of_a_requests_eos_ids_ends_it() -> None:
    sched = make_scheduler()
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=10), eos_token_ids=[5, 7])
    sched.add_request(request)
    tokens = iter([4, 7, 9])
    runner = FakeRunner(lambda _: next(tokens))
    step(sched, runner)
    _, outputs = step(sched, runner)
    assert outputs[0].finish_reason == "stop" and request.output_token_ids == [4, 7]


def test_every_eos_id_of_the_model_config_reaches_the_requests(tmp_path: Path, tiny_llama_dir: Path) -> None:
    model = shutil.copytree(tiny_llama_dir, tmp_path / "two-eos")
    config = json.loads((model / "config.json").read_text())
    config["eos_token_id"] = [config["eos_token_id"], 17]
    (model / "config.json").write_text(json.dumps(config))
    llm = LLM(model=str(model), dtype="float32", num_blocks=16)
    assert 17 in llm.engine.eos_token_ids
    assert 17 in llm.input_processor.eos_token_ids and config["eos_token_id"][0] in llm.input_processor.eos_token_ids
    # Whichever EOS id a request samples ends it: bias the second one to be certain to come first.
    (out,) = llm.generate([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=8, logit_bias={17: 100.0}))
    assert out.outputs[0].token_ids == [17] and out.outputs[0].finish_reason == "stop"


def test_a_second_eos_id_in_generation_config_ends_a_request(tmp_path: Path, tiny_llama_dir: Path) -> None:
    model = shutil.copytree(tiny_llama_dir, tmp_path / "generation-eos")
    generation = json.loads((model / "generation_config.json").read_text())
    generation["eos_token_id"] = [generation["eos_token_id"], 23]
    (model / "generation_config.json").write_text(json.dumps(generation))
    llm = LLM(model=str(model), dtype="float32", num_blocks=16)
    assert 23 in llm.engine.eos_token_ids and 23 in llm.input_processor.eos_token_ids
    (out,) = llm.generate([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=8, logit_bias={23: 100.0}))
    assert out.outputs[0].token_ids == [23] and out.outputs[0].finish_reason == "stop"


def test_children_carry_their_parent_id_and_index(tiny_llama_dir: Path) -> None:
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", num_blocks=16)
    added: list[Request] = []
    original = llm.engine.add_request

    def spy(request: Request) -> None:
        added.append(request)
        original(request)

    llm.engine.add_request = spy  # type: ignore[method-assign]
    (out,) = llm.generate([1, 2, 3], SamplingParams(n=3, max_tokens=2, ignore_eos=True))
    assert [(r.parent_id, r.index) for r in added] == [(out.request_id, i) for i in range(3)]
    stats = llm.engine.stats([out.request_id])
    assert stats.request_positions[out.request_id] == sum(3 + 1 for _ in range(3))  # prompt + one decode each
