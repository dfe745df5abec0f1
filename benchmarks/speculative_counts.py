"""Speculative decoding by counts, not timings (issue 38): the steps, drafts and kept drafts of benchmarks/
speculative.py's three workloads (editing, random greedy, random sampled), offline, and what they give at an assumed
cost of a drafted row. A 2-vCPU VM's timings move by 10% between rounds; these counts do not move at all, so a change
to the gate or the proposer can be judged here first.

Modelled speed over plain decoding: tokens / (decode steps + row_cost x drafted rows), where row_cost is what one
more row adds to a one-stream decode step relative to it: ~0.5 on the AVX2 build's int16 kernels, ~0.3 at int8,
~0.15 on VNNI (Qwen2.5-Coder 0.5B Q4_K_M; docs/benchmarks.md, "8-bit activations for every row").
`--pause-below` sets the gate's pause threshold (spec_decode/speculator.py's PAUSE_BELOW) for a run of each.

    .venv/bin/python benchmarks/speculative_counts.py MODEL.gguf [--pause-below 0.25 0.5] [--row-costs 0.15 0.3 0.5]
"""

from __future__ import annotations

import argparse

from speculative import DEFAULT_SPEC, editing_requests, random_requests

from lmserve import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--spec", default=DEFAULT_SPEC)
    parser.add_argument("--pause-below", type=float, nargs="+", default=[0.25])
    parser.add_argument("--row-costs", type=float, nargs="+", default=[0.15, 0.3, 0.5])
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args()
    vocab = 32000  # as speculative.py: ids below it are tokens of every vocabulary here
    workloads = {
        "editing": [(r["messages"], SamplingParams(temperature=0, max_tokens=args.max_tokens))
                    for r in editing_requests(args.max_tokens)],
        "random": [(r["prompt"], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
                   for r in random_requests(vocab)],
        "sampled": [(r["prompt"], SamplingParams(temperature=1.0, seed=r["seed"], max_tokens=64, ignore_eos=True))
                    for r in random_requests(vocab, temperature=1.0)],
    }
    with LLM(args.model, max_model_len=4096, speculative_config=args.spec) as llm:
        for name, items in workloads.items():
            for threshold in args.pause_below:
                llm.engine.scheduler.speculator.pause_below = threshold
                tokens = steps = drafted = accepted = 0
                for prompt, params in items:
                    before, steps_before = llm.engine.stats(), llm.engine.num_steps
                    (out,) = llm.chat(prompt, params) if name == "editing" else llm.generate([prompt], params)
                    after = llm.engine.stats()
                    tokens += len(out.outputs[0].token_ids) - 1  # the first comes from the prefill
                    steps += llm.engine.num_steps - steps_before - 1  # one prefill step (prompts below the budget)
                    drafted += after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
                    accepted += after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
                modelled = "  ".join(f"row cost {c}: {tokens / (steps + c * drafted):.3f}x" for c in args.row_costs)
                print(f"{name:8} pause below {threshold}: {tokens} tokens in {steps} decode steps, {drafted} drafted, "
                      f"{accepted} kept;  {modelled}", flush=True)


if __name__ == "__main__":
    main()
