"""Communication bytes per token: the planner's formula on hand-computed examples, and in `lmserve plan`'s output."""

from __future__ import annotations

import json

from lmserve.cli import main
from lmserve.plan.comm import comm_per_token
from lmserve.plan.model_spec import Layout, load_spec


def test_tp3_pp2_of_smollm2_in_float32_by_hand():
    # SmolLM2-135M: hidden 576, 30 layers (15 per stage), vocabulary 49,152; float32 is 4 bytes.
    comm = comm_per_token(load_spec("smollm2-135m"), Layout(tp=3, pp=2), "float32")
    # Stage 0: 2 all-reduces × 15 layers + the embedding's = 31 × 576 × 4; stage 1: 30 × 576 × 4.
    assert comm.tp_all_reduce == [31 * 576 * 4, 30 * 576 * 4] == [71_424, 69_120]
    assert comm.tp_all_gather == 49_152 // 3 * 4 == 65_536  # this rank's third of the logits
    assert comm.pp_send == 2 * 576 * 4 == 4_608 and comm.pp_boundaries == 1  # hidden states + residual
    # The busiest rank: stage 1's all-reduces and logits (69,120 + 65,536) beat stage 0's (71,424 + 4,608 sent).
    assert comm.per_rank_max == 134_656


def test_no_split_moves_nothing_and_pp_alone_only_sends():
    spec = load_spec("llama-3-8b")  # hidden 4096
    assert comm_per_token(spec, Layout(), "bfloat16").per_rank_max == 0
    pp4 = comm_per_token(spec, Layout(pp=4), "bfloat16")
    assert pp4.tp_all_reduce == [0] * 4 and pp4.tp_all_gather == 0
    assert pp4.pp_send == 2 * 4096 * 2 and pp4.pp_boundaries == 3


def test_plan_shows_the_bytes_in_text_and_json(capsys):
    assert main(["plan", "-tp", "3", "--dtype", "float32", "--device-memory", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["comm_per_token"]["tp_all_reduce"] == [61 * 576 * 4]
    assert out["comm_per_token"]["per_rank_max"] == 61 * 576 * 4 + 65_536
    assert main(["plan", "-tp", "3", "--dtype", "float32", "--device-memory", "16"]) == 0
    text = capsys.readouterr().out
    assert "comm per token       float32 activations" in text and "140,544" in text
