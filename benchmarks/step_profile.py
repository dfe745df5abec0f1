"""Where one stream's decode step goes, offline (no server): the step's wall time, or cProfile (Python and ops by
self time), or the torch profiler (ops). One 128-token prompt, then greedy decoding.

    .venv/bin/python benchmarks/step_profile.py MODEL.gguf [time|cprof|torch]
"""

import cProfile
import pstats
import statistics
import sys
import time

import torch

from lmserve import LLM, SamplingParams

path = sys.argv[1]
mode = sys.argv[2] if len(sys.argv) > 2 else "time"
llm = LLM(path, max_num_seqs=8, enable_prefix_caching=False, max_model_len=2048)
params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
prompt = torch.randint(1000, 20000, (128,), generator=torch.Generator().manual_seed(0)).tolist()
llm._add(prompt, params, 0)
for _ in range(20):
    llm._step()
times = []
if mode == "time":
    for _ in range(100):
        started = time.perf_counter()
        llm._step()
        times.append(time.perf_counter() - started)
    print("step median ms", statistics.median(times) * 1e3, "p10", sorted(times)[10] * 1e3)
elif mode == "cprof":
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(100):
        llm._step()
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(45)
elif mode == "torch":
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(50):
            llm._step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
llm.shutdown()
