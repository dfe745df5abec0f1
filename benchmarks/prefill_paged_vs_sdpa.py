"""What issue 32's fix costs: a long prompt's prefill with every chunk on the paged kernel (paged-cpu, now) against
SDPA for prompt chunks (`--attention-backend sdpa`), on the default model, in alternating engines in one process.

    .venv/bin/python benchmarks/prefill_paged_vs_sdpa.py
    LMSERVE_DISABLE_CPU_FEATURES=amx .venv/bin/python benchmarks/prefill_paged_vs_sdpa.py            # Zen 4's path
    LMSERVE_KERNEL_MARCH=haswell LMSERVE_DISABLE_CPU_FEATURES=amx,vnni .venv/bin/python benchmarks/...  # AVX2 build

A prompt of ~1,800 tokens (max_tokens 1, so the time is the prefill), median of 3 after a warm-up, two rounds.
"""

from __future__ import annotations

import statistics
import time

from lmserve import LLM, SamplingParams


def main() -> None:
    words = " ".join(f"w{i}" for i in range(480))
    results: dict[str, list[float]] = {}
    tokens = 0
    for backend in ("sdpa", "paged-cpu", "sdpa", "paged-cpu"):
        llm = LLM(attention_backend=backend, max_model_len=4096)
        params = SamplingParams(temperature=0, max_tokens=1)
        tokens = len(llm.tokenizer.encode(words))
        llm.generate([words], params)
        times = []
        for i in range(3):
            started = time.perf_counter()
            llm.generate([f"{i} " + words], params)
            times.append(time.perf_counter() - started)
        results.setdefault(backend, []).append(statistics.median(times))
        llm.shutdown()
    print(f"prompt of {tokens} tokens, prefill seconds per round: "
          + ", ".join(f"{k} {' / '.join(f'{v:.3f}' for v in vs)}" for k, vs in results.items()))
    ratio = statistics.median(results["paged-cpu"]) / statistics.median(results["sdpa"])
    print(f"paged-cpu / sdpa time: {ratio:.2f}")


if __name__ == "__main__":
    main()
