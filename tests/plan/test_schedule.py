"""lmserve schedule: the budget example through the command line, the table formats, errors, the cost model, and
agreement with the live engine on the tiny test model."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from lmserve.cli import main
from lmserve.plan.schedule import ScheduleSettings, replay
from lmserve.plan.workload import RequestSpec, parse_request

BUDGET_EXAMPLE = ["--request", "a:1:30", "--request", "b:1:30", "--request", "p:10:3@2"]


def run_schedule(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main(["schedule", *args, "--format", "json"]) == 0
    return json.loads(capsys.readouterr().out)


def summary(out: dict, name: str) -> dict:
    return next(r for r in out["requests"] if r["name"] == name)


def test_budget_example_chunks_4_4_2(capsys):
    out = run_schedule(capsys, "--budget", "6", *BUDGET_EXAMPLE)
    its = out["iterations"]
    assert its[0]["scheduled"] == {"a": 1, "b": 1}
    assert its[1]["scheduled"] == {"a": 1, "b": 1, "p": 4}
    assert its[2]["scheduled"] == {"a": 1, "b": 1, "p": 4}
    assert its[3]["scheduled"] == {"a": 1, "b": 1, "p": 2}
    assert [it["sampled"] for it in its[1:4]] == [["a", "b"], ["a", "b"], ["a", "b", "p"]]
    p = summary(out, "p")
    assert p["prefill_chunks"] == [4, 4, 2]
    # p arrives in iteration 2; its first token comes in the 3rd iteration of its life (absolute iteration 4).
    assert (p["arrival"], p["first_token_iteration"], p["iterations_to_first_token"]) == (2, 4, 3)
    # Both decodes get a token in every iteration until they finish.
    for name in ("a", "b"):
        served = [it["iteration"] for it in its if name in it["sampled"]]
        assert served == list(range(1, 31))
        assert summary(out, name)["finish_reason"] == "length"
    # p's chunks delayed a's and b's tokens: (4 + 4 + 2) positions × 2 tokens, at most 4 positions on one token.
    assert (p["stall_positions"], p["max_stall_positions"]) == (20, 4)
    assert p["finished_iteration"] == 6


def test_budget_12_is_one_chunk_of_10(capsys):
    out = run_schedule(capsys, "--budget", "12", *BUDGET_EXAMPLE)
    assert out["iterations"][1]["scheduled"] == {"a": 1, "b": 1, "p": 10}
    p = summary(out, "p")
    assert p["prefill_chunks"] == [10]
    assert (p["first_token_iteration"], p["iterations_to_first_token"]) == (2, 1)
    # The same total stall, in one 10-position spike instead of three of at most 4.
    assert (p["stall_positions"], p["max_stall_positions"]) == (20, 10)


def test_json_shape(capsys):
    out = run_schedule(capsys, "--budget", "6", "--blocks", "8", *BUDGET_EXAMPLE)
    assert set(out) == {"settings", "iterations", "requests", "cost_model"}
    first = out["iterations"][0]
    assert {"iteration", "scheduled", "sampled", "waiting", "blocks_used"} <= first.keys()
    assert first["iteration"] == 1 and first["waiting"] == [] and first["blocks_used"] == 2
    assert out["settings"]["num_blocks"] == 8 and out["cost_model"] is None
    assert out["iterations"][1]["kinds"] == {"a": "decode", "b": "decode", "p": "prefill"}


def test_waiting_queue_and_max_num_seqs(capsys):
    out = run_schedule(capsys, "--budget", "64", "--max-num-seqs", "2", "--request", "a:4:2", "--request", "b:4:2",
                       "--request", "c:4:2")
    assert out["iterations"][0]["scheduled"] == {"a": 4, "b": 4}
    assert out["iterations"][0]["waiting"] == ["c"]
    assert summary(out, "c")["first_scheduled"] == 3


def test_long_prefill_threshold_caps_chunks(capsys):
    out = run_schedule(capsys, "--budget", "64", "--long-prefill-token-threshold", "4", "--request", "p:10:1")
    assert summary(out, "p")["prefill_chunks"] == [4, 4, 2]


def test_preemption_shows_in_the_table(capsys):
    out = run_schedule(capsys, "--budget", "64", "--blocks", "3", "--block-size", "4",
                       "--request", "a:4:8", "--request", "b:4:8")
    assert any(it["preempted"] for it in out["iterations"])
    assert summary(out, "b")["num_preemptions"] >= 1  # the latest arrival is the victim
    assert "recompute" in {k for it in out["iterations"] for k in it["kinds"].values()}
    for name in ("a", "b"):
        assert sum(name in it["sampled"] for it in out["iterations"]) == 8
        assert summary(out, name)["finish_reason"] == "length"
    assert all(it["blocks_used"] <= 3 for it in out["iterations"])


def test_table_and_markdown(capsys):
    assert main(["schedule", "--budget", "6", *BUDGET_EXAMPLE]) == 0
    table = capsys.readouterr().out
    assert "P4" in table and "P2*" in table and "D1*" in table and "first token" in table
    assert main(["schedule", "--budget", "6", "--format", "markdown", *BUDGET_EXAMPLE]) == 0
    markdown = capsys.readouterr().out
    assert markdown.startswith("**budget 6") and "| iter | a | b | p |" in markdown


def test_requests_file_matches_the_command_line(capsys, tmp_path: Path):
    file = tmp_path / "requests.json"
    file.write_text(json.dumps({"requests": [
        {"name": "a", "prompt_len": 1, "output_len": 30}, "b:1:30",
        {"name": "p", "prompt_len": 10, "output_len": 3, "arrival": 2},
    ]}))
    from_file = run_schedule(capsys, "--budget", "6", "--requests-file", str(file))
    assert from_file == run_schedule(capsys, "--budget", "6", *BUDGET_EXAMPLE)


def test_cost_model_turns_iterations_into_estimated_ms(capsys, tmp_path: Path):
    cost = tmp_path / "cost.json"
    cost.write_text(json.dumps({"ms_per_position": 0.5, "ms_per_step": 2.0}))
    out = run_schedule(capsys, "--budget", "6", "--cost-model", str(cost), *BUDGET_EXAMPLE)
    its = out["iterations"]
    assert its[0]["est_ms"] == 2.0 + 0.5 * 2
    assert its[1]["est_ms"] == 2.0 + 0.5 * 6
    p = summary(out, "p")
    assert p["est_ttft_ms"] == 2 * (2.0 + 0.5 * 6) + (2.0 + 0.5 * 4)  # iterations 2, 3 (6 positions), 4 (4)
    assert p["est_stall_ms"] == 20 * 0.5
    assert "estimate" in out["cost_model"]["note"]
    assert main(["schedule", "--budget", "6", "--cost-model", str(cost), *BUDGET_EXAMPLE]) == 0
    assert "ESTIMATE" in capsys.readouterr().out


@pytest.mark.parametrize(("args", "message"), [
    (["--request", "a:1"], "malformed request 'a:1'"),
    (["--request", "a:x:3"], "malformed request"),
    (["--request", "a:1:3@"], "malformed request"),
    (["--request", ":1:3"], "malformed request"),
    (["--request", "a:0:3"], "must be >= 1"),
    (["--request", "a:1:3@0"], "numbered from 1"),
    ([], "no requests"),
    (["--request", "a:1:3", "--request", "a:2:3"], "unique"),
    (["--request", "a:100:1", "--blocks", "2"], "more than max_model_len"),
    (["--request", "a:1:1", "--budget", "0"], "must be >= 1"),
    (["--requests-file", "/no/such/file.json"], "No such file"),
])  # fmt: skip
def test_bad_input_is_a_clear_error(capsys, args, message):
    assert main(["schedule", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lmserve: error:") and message in err


def test_parse_request():
    assert parse_request("p:10:3@2") == RequestSpec("p", 10, 3, 2)
    assert parse_request("long-name_1:512:128") == RequestSpec("long-name_1", 512, 128, 1)


WORKLOADS = {
    "mixed arrivals": (
        [RequestSpec("a", 5, 4), RequestSpec("b", 20, 3), RequestSpec("c", 3, 6, 2), RequestSpec("p", 37, 2, 3)],
        ScheduleSettings(budget=8, max_num_seqs=4),
    ),
    "preemption": (
        [RequestSpec("a", 20, 30), RequestSpec("b", 20, 30), RequestSpec("c", 10, 5, 4)],
        ScheduleSettings(budget=64, max_num_seqs=8, long_prefill_token_threshold=12, num_blocks=5),
    ),
}


@pytest.mark.parametrize("workload", WORKLOADS)
def test_schedule_agrees_with_the_live_engine(tiny_llama_dir: Path, workload: str):
    """The same workload through LLM's engine with the tiny model: identical per-step positions per request."""
    from lmserve import LLM, SamplingParams
    from lmserve.engine.request import Request

    specs, settings = WORKLOADS[workload]
    predicted = replay(specs, settings)
    llm = LLM(
        str(tiny_llama_dir), dtype="float32", device="cpu", num_blocks=predicted.num_blocks,
        max_num_batched_tokens=settings.budget, max_num_seqs=settings.max_num_seqs,
        long_prefill_token_threshold=settings.long_prefill_token_threshold,
    )
    engine = llm.engine
    assert engine.scheduler.kv_cache_manager.block_size == settings.block_size
    recorded: list[dict[str, int]] = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        recorded.append({s.request_id: s.num_tokens for s in out.scheduled})
        return out

    engine.scheduler.schedule = recording_schedule
    rng = random.Random(0)
    pending = sorted(specs, key=lambda s: s.arrival)
    iteration = 0
    while pending or engine.has_unfinished_requests():
        iteration += 1
        while pending and pending[0].arrival <= iteration:
            spec = pending.pop(0)
            prompt = [rng.randrange(100, engine.vocab_size) for _ in range(spec.prompt_len)]
            params = SamplingParams(max_tokens=spec.output_len, ignore_eos=True, temperature=0.0)
            engine.add_request(Request(spec.name, prompt, params, eos_token_ids=engine.eos_token_ids))
        engine.step()
    assert recorded == [it.scheduled for it in predicted.iterations]
    assert any(it.preempted for it in predicted.iterations) == (workload == "preemption")
