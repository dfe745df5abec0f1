"""Draft-model speculation on the pair at hand (issue 38): the default model as the target in another precision
(`--quantization none`: float32, or q8_0), its own file's q4_1 blocks as the draft. One stream, greedy chats of 128
tokens, in process; run each mode in its own process, alternating:

    for m in plain draft plain draft; do .venv/bin/python benchmarks/speculative_draft.py $m 3 q8_0; done
"""

import sys
import time

from lmserve import LLM, SamplingParams
from lmserve.models import DEFAULT_MODEL, resolve_model

path = str(resolve_model(DEFAULT_MODEL).path)
mode, k = sys.argv[1], int(sys.argv[2])
prompts = ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
           "Explain how a refrigerator works, step by step.",
           "List ten facts about the planet Mars."]
greedy = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
kw = {"speculative_config": {"model": path, "num_speculative_tokens": k}} if mode == "draft" else {}
llm = LLM(path, quantization=sys.argv[3] if len(sys.argv) > 3 else "none", max_model_len=1024, **kw)
llm.generate(["warm up"], SamplingParams(max_tokens=8))
rates = []
for p in prompts:
    t = time.perf_counter()
    out = llm.chat([{"role": "user", "content": p}], greedy)[0].outputs[0]
    rates.append(len(out.token_ids) / (time.perf_counter() - t))
s = llm.engine.stats()
print(mode, [round(r, 2) for r in rates], "drafts", s.spec_decode_num_drafts, "draft tokens", s.spec_decode_num_draft_tokens,
      "accepted", s.spec_decode_num_accepted_tokens, "per position", s.spec_decode_num_accepted_tokens_per_pos)
