"""An abort that arrives while a step computes: from the moment the engine reports the request "gone", its count of
positions no longer changes (issue 68: test_n3_stream_closed_aborts_every_child once saw 40 -> 43 after the abort).

The count grew because positions were added when a step's output came back: the step under way when the abort
arrived (and, with async scheduling, the batch after it) was counted after the request was already "gone". Nothing
was computed for the request that had not been handed to the model before the abort.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lmserve import LLM, SamplingParams
from lmserve.engine.request import Request

TINY = {"dtype": "float32", "quantization": "none", "max_num_batched_tokens": 48, "num_blocks": 14,
        "max_model_len": 512}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_positions_are_final_once_an_aborted_request_is_gone(tiny_llama_dir: Path, async_scheduling: bool) -> None:
    with LLM(str(tiny_llama_dir), **TINY, async_scheduling=async_scheduling) as llm:
        engine = llm.engine
        children = [f"p-{i}" for i in range(3)]
        for index, child in enumerate(children):
            engine.add_request(Request(child, [1, 2, 3, 4], SamplingParams(max_tokens=200, ignore_eos=True),
                                       eos_token_ids=[], parent_id="p", index=index))
        for _ in range(6):  # prefill, then decoding
            engine.step()
        at_abort = []

        def abort_during_the_step() -> None:  # as core_proc's drain does when the abort arrives mid-step
            if not at_abort:
                engine.abort_requests(children)
                at_abort.append(engine.stats(["p"]))

        while not at_abort:
            engine.step(after_execute=abort_during_the_step)
        [seen] = at_abort
        assert seen.request_status["p"] == "gone"
        while engine.has_unfinished_requests():  # the batches in flight come back
            engine.step()
        after = engine.stats(["p"])
        assert after.request_positions["p"] == seen.request_positions["p"], "positions kept growing after the abort"
        assert after.num_requests_running == 0 and after.kv_blocks_free == after.kv_blocks_total
