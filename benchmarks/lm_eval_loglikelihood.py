"""lm-eval's own `local-completions` model class against a real `lmserve serve`: its loglikelihoods must equal the
offline engine's prompt logprobs of the same tokens (docs/benchmarks.md, "lm-eval loglikelihood").

lm-eval is too heavy for `make test` (datasets, pandas, pyarrow, evaluate, ...); tests/api/test_server_e2e.py sends
its exact request shape instead. To run this, put lm-eval where our venv can import it, without its dependency tree:

    python3.11 -m venv /tmp/lmeval && /tmp/lmeval/bin/pip install --no-deps lm_eval==0.4.13 sacrebleu portalocker \
        tabulate colorama lxml evaluate datasets multiprocess pandas pyarrow dill \
        xxhash sqlitedict aiohttp tenacity aiohappyeyeballs aiosignal frozenlist multidict yarl propcache accelerate peft
    PYTHONPATH=/tmp/lmeval/lib/python3.11/site-packages .venv/bin/python benchmarks/lm_eval_loglikelihood.py
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile

from timing import start_lmserve

from lmserve import LLM, SamplingParams
from lmserve.model_tokenizer import load_tokenizer
from lmserve.models import resolve_model

EXAMPLES = [
    ("The capital of France is", " Paris"),
    ("The capital of France is", " London"),
    ("Water boils at a temperature of 100 degrees", " Celsius"),
    ("One, two, three, four,", " five"),
    ("The opposite of hot is", " cold"),
    ("def add(a, b):\n    return", " a + b"),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tolerance", type=float, default=1e-3)
    args = parser.parse_args()

    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    process, url = start_lmserve(args.model)
    try:
        with tempfile.TemporaryDirectory() as tokenizer_dir:
            # lm-eval loads its tokenizer with AutoTokenizer, which cannot open a GGUF: hand it a saved copy.
            load_tokenizer(resolve_model(args.model)).save_pretrained(tokenizer_dir)
            lm = LocalCompletionsAPI(base_url=f"{url}/v1/completions", model=args.model, tokenizer=tokenizer_dir,
                                     num_concurrent=1, max_retries=1)
            requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(EXAMPLES)]
            served = lm.loglikelihood(requests)
            encoded = [lm._encode_pair(context, continuation) for context, continuation in EXAMPLES]
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(30)

    offline = LLM(args.model)
    worst = 0.0
    print(f"{'context':<46} {'continuation':<14} {'lm-eval (served)':>17} {'offline':>10} {'greedy':>7}")
    for (context, continuation), (logprob, greedy), (context_ids, continuation_ids) in zip(
        EXAMPLES, served, encoded, strict=True
    ):
        (out,) = offline.generate(context_ids + continuation_ids,
                                  SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
        expected = sum(e.logprob for e in out.prompt_logprobs[len(context_ids):])
        worst = max(worst, abs(logprob - expected))
        print(f"{context!r:<46} {continuation!r:<14} {logprob:>17.4f} {expected:>10.4f} {greedy!s:>7}")
    print(f"largest difference: {worst:.2e} (tolerance {args.tolerance})")
    nonzero = all(logprob != 0.0 for logprob, _ in served)
    return 0 if worst <= args.tolerance and nonzero else 1


if __name__ == "__main__":
    sys.exit(main())
