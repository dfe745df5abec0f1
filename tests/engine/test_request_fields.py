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


def assert_second_eos_id_ends_requests(tmp_path: Path, tiny_llama_dir: Path, file: str, second: int) -> None:
    """Lists a second EOS id in one of the model's files; the engine, the front-end and a request honour it."""
    model = shutil.copytree(tiny_llama_dir, tmp_path / file.removesuffix(".json"))
    settings = json.loads((model / file).read_text())
    first = settings["eos_token_id"]
    settings["eos_token_id"] = [first, second]
    (model / file).write_text(json.dumps(settings))
    llm = LLM(model=str(model), dtype="float32", num_blocks=16)
    assert second in llm.engine.eos_token_ids
    assert {first, second} <= set(llm.input_processor.eos_token_ids)
    # Whichever EOS id a request samples ends it: bias the second one to be certain to come first.
    (out,) = llm.generate([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=8, logit_bias={second: 100.0}))
    assert out.outputs[0].token_ids == [second] and out.outputs[0].finish_reason == "stop"


def test_every_eos_id_of_the_model_config_reaches_the_requests(tmp_path: Path, tiny_llama_dir: Path) -> None:
    assert_second_eos_id_ends_requests(tmp_path, tiny_llama_dir, "config.json", 17)


def test_a_second_eos_id_in_generation_config_ends_a_request(tmp_path: Path, tiny_llama_dir: Path) -> None:
    assert_second_eos_id_ends_requests(tmp_path, tiny_llama_dir, "generation_config.json", 23)


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
