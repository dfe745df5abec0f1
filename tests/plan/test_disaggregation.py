"""`lmserve plan --itl-target-ms`: when prefill/decode separation meets an ITL target that one instance misses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmserve.cli import main
from lmserve.plan.cost_model import CostModel
from lmserve.plan.disaggregation import separation_advice

COST = CostModel(ms_per_position=0.5, ms_per_step=10.0)  # a 2k-token chunk: ~1 s beside the decodes


def test_long_prompts_and_a_tight_target_call_for_separation() -> None:
    advice = separation_advice(COST, prompt_len=4000, streams=8, budget=2048, itl_target_ms=50, model="M")
    assert advice.colocated_worst_itl_ms == pytest.approx(10 + 0.5 * (2048 + 8))
    assert advice.separated_itl_ms == pytest.approx(2 * (10 + 0.5 * 8))
    assert advice.colocated_ttft_ms == pytest.approx(2 * (10 + 0.5 * 2056))
    assert advice.pays and "kv_producer" in advice.commands[0] and "kv_consumer" in advice.commands[1]
    assert advice.commands[2].startswith("lmserve router --prefill")
    assert '"kv_connector": "PyNcclConnector"' in advice.render()  # the way across machines


def test_short_prompts_or_a_loose_target_keep_one_instance() -> None:
    assert not separation_advice(COST, prompt_len=20, streams=8, budget=2048, itl_target_ms=50, model="M").pays
    assert not separation_advice(COST, prompt_len=4000, streams=8, budget=2048, itl_target_ms=5000, model="M").pays
    # A target the decode half cannot meet either: separation does not pay.
    assert not separation_advice(COST, prompt_len=4000, streams=8, budget=2048, itl_target_ms=20, model="M").pays
    with pytest.raises(ValueError):
        separation_advice(COST, prompt_len=0, streams=8, budget=2048, itl_target_ms=50, model="M")


def test_the_plan_command_prints_the_advice(tmp_path: Path, capsys) -> None:
    cost = tmp_path / "cost.json"
    cost.write_text(json.dumps({"ms_per_position": 0.5, "ms_per_step": 10.0}))
    main(["plan", "--concurrency", "8", "--itl-target-ms", "50", "--prompt-len", "4000", "--cost-model", str(cost)])
    out = capsys.readouterr().out
    assert "separate prefill and decode" in out and "lmserve router" in out
    assert main(["plan", "--itl-target-ms", "50"]) == 2  # without a cost model: refused, saying what it needs
    assert "--itl-target-ms needs --cost-model" in capsys.readouterr().err
